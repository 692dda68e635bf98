"""Triton KDA kernels against the float64 token-by-token reference (docs/MATH.md §1).

CPU: the kernels run under ``TRITON_INTERPRET=1`` (set in conftest.py) on tiny float32 shapes. GPU (``-m gpu``):
bfloat16 inputs at training shapes, with the tolerances of docs/MATH.md §1. Every float ``torch.empty`` made while a
kernel runs is NaN-filled, so an output element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from k3lit.kernels.kda import chunk_bwd, chunk_fwd, common, index, pipeline, plan
from k3lit.ops.kda import kda, kda_reference
from k3lit.testing import rel_rms

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("q", "k", "v", "g", "beta", "h0")
# float32 inputs on CPU: the interpreter's arithmetic is float32 throughout.
TOL_F32 = 2e-5
# docs/MATH.md §1: bf16 inputs against a float64 reference, relative RMS error.
TOL_BF16 = {"o": 0.005, "ht": 0.005, "q": 0.008, "k": 0.008, "v": 0.008, "g": 0.02, "beta": 0.02, "h0": 0.008}


def make_inputs(B, T, H, K, V, dtype=torch.float32, g_min=-5.0, gate="random", collinear=False, N=None, device=DEV):
    q = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1)
    if collinear:  # every key within ~1e-3 of one direction: A_kk entries near 1, M badly conditioned
        base = torch.randn(1, 1, H, K, device=device)
        k = F.normalize(base + 1e-3 * torch.randn(B, T, H, K, device=device), dim=-1)
    else:
        k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1)
    v = torch.randn(B, T, H, V, device=device)
    if gate == "min":
        g = torch.full((B, T, H, K), g_min, device=device)
    elif gate == "zero":
        g = torch.zeros(B, T, H, K, device=device)
    else:
        g = g_min * torch.sigmoid(torch.randn(B, T, H, K, device=device) * 2)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device))
    h0 = torch.randn(N or B, H, K, V, device=device) * 0.5
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return q, k, v, g, beta, h0


def run_both(inputs, cu_seqlens=None, g_min=-5.0, use_h0=True, fn=None):
    """Forward + backward of the Triton op and of the float64 reference on the same (rounded) values."""
    from k3lit.kernels.kda import kda_triton

    fn = fn or (lambda *a, **kw: kda_triton(*a, **kw, g_min=g_min))
    ours = [x.detach().clone().requires_grad_() for x in inputs]
    ref = [x.detach().double().requires_grad_() for x in inputs]
    h0_o, h0_r = (ours[5], ref[5]) if use_h0 else (None, None)
    o, ht = fn(*ours[:5], None, h0_o, True, cu_seqlens)
    o_r, ht_r = kda_reference(*ref[:5], None, h0_r, True, cu_seqlens)
    do = torch.randn_like(o_r)
    dht = torch.randn_like(ht_r)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((o_r * do).sum() + (ht_r * dht).sum()).backward()
    err = {"o": rel_rms(o, o_r), "ht": rel_rms(ht, ht_r)}
    for name, a, b in zip(NAMES, ours, ref):
        if name == "h0" and not use_h0:
            continue
        err[name] = rel_rms(a.grad, b.grad)
    return err


@pytest.fixture(params=["plain", "transposed"])
def scan_layout(request, monkeypatch):
    """Run the test with each state layout of the two scans (``plan.TUNING``; by default picked per shape)."""
    monkeypatch.setitem(plan.TUNING, "fwd_scan", request.param)
    monkeypatch.setitem(plan.TUNING, "bwd_scan", request.param)
    return request.param


def spy_launches(monkeypatch, names, record):
    """Wrap the ``chunk_fwd`` kernels ``names`` so that each launch first appends ``record(name, kwargs)`` to the
    returned list, then runs."""
    seen = []
    for name in names:
        kernel = getattr(chunk_fwd, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel, name=name):
                def launch(*args, **kw):
                    seen.append(record(name, kw))
                    return kernel[grid](*args, **kw)
                return launch

        monkeypatch.setattr(chunk_fwd, name, Spy())
    return seen


def assert_errors(err, tol):
    bad = {n: e for n, e in err.items() if not e <= (tol[n] if isinstance(tol, dict) else tol)}
    assert not bad, f"relative RMS errors above tolerance: {bad} (all: {err})"


@pytest.mark.parametrize(
    "B,T,H,K,V",
    [
        # T = 1. Two sequences and heads: with one, dbeta is a single sum of O(1) terms that can cancel to ~1e-3
        # (seed 241671548: -1.76e-3), where float32's absolute error of ~5e-7 is a relative 3e-4; over four values
        # the relative RMS error is set by the largest
        (2, 1, 2, 16, 16),
        (2, 20, 2, 24, 20),  # T below the chunk, K and V not powers of two
        (1, 70, 1, 16, 32),  # T not a multiple of the chunk, three chunks
        (1, 33, 1, 80, 72),  # K, V above one 64-wide block: the blocked loops and their masks
    ],
)
def test_forward_backward_matches_reference(seed, scan_layout, B, T, H, K, V):
    assert_errors(run_both(make_inputs(B, T, H, K, V)), TOL_F32)


def test_narrow_forward_blocks_match_reference(seed, monkeypatch):
    """The 32-wide key / value steps of the split forward's per-chunk kernels (``plan.TUNING`` alternatives), at K
    and V that span more than one step and are not multiples of it."""
    for key, value in dict(fwd_prep="split", intra_bk=32, intra_warps=4, wy_bk=32, wy_bv=32, wy_warps=2).items():
        monkeypatch.setitem(plan.TUNING, key, value)
    blocks = spy_launches(monkeypatch, ("_intra_fwd", "_wy_fwd"),
                          lambda name, kw: (name, kw["BK"], kw.get("BV"), kw["num_warps"]))
    assert_errors(run_both(make_inputs(1, 70, 2, 80, 72)), TOL_F32)
    assert set(blocks) == {("_intra_fwd", 32, None, 4), ("_wy_fwd", 32, 32, 2)}


@pytest.mark.gpu  # also on the CPU: the GPU suite runs it for the bit-for-bit check at K = V = 128
@pytest.mark.parametrize("fused", [False, True])
def test_inference_forward_equals_training_forward(seed, monkeypatch, scan_layout, fused):
    """Without a backward to follow, the forward skips what only the backward reads (M; the states and Delta where
    the scan writes the output: the transposed scan, and the plain one at K, V <= 128, in place of ``_out_fwd``):
    the final state stays bit-identical to that of the forward that saves them, and so does o but on the plain
    layout, where the scan's output products and ``_out_fwd``'s (other value blocks; on the GPU other tensor-core
    instructions) sum in another float32 order: there o may differ only where that order flips a bf16 rounding,
    a few elements in ten thousand at a relative RMS difference below 1e-4 (bf16's own rounding is 2^-8 = 3.9e-3
    relative; o's error against float64 is ~2.4e-3; on the H200 none to 3 of the 179,200 elements differed,
    relative RMS <= 5e-10; under the interpreter none to one of the 10,080, depending on the seed). bf16 inputs
    (float32 ones keep ``_out_fwd``); K = 80 and V = 72 on the CPU (keys above one 64-wide step, value blocks part
    masked), 128 on the GPU, over 16 draws there: a G_last taken from another cumsum than the one Kd is formed
    with changes the final state's last bit in about one draw in eight with the fused gate, which one draw misses."""
    from k3lit.kernels.kda import kda_triton

    launched = spy_launches(monkeypatch, ("_out_fwd",), lambda name, kw: name)
    K, V, T, draws = (128, 128, 700, 16) if DEV == "cuda" else (80, 72, 70, 1)
    for draw in range(draws):
        launched.clear()
        q, k, v, g, beta, h0 = make_inputs(1, T, 2, K, V, N=2, dtype=torch.bfloat16)
        cu = torch.tensor([0, 9, T], device=DEV)
        kw = dict(use_gate_in_kernel=True, gate_bias=torch.randn(2 * K, device=DEV)) if fused else {}
        if fused:
            g = torch.randn_like(g)
        with torch.no_grad():
            o_inf, ht_inf = kda_triton(q, k, v, g, beta, None, h0, True, cu, **kw)
        assert launched == []
        o, ht = kda_triton(q, k, v, g.requires_grad_(), beta, None, h0, True, cu, **kw)
        assert launched == ([] if scan_layout == "transposed" else ["_out_fwd"])
        assert o.requires_grad
        assert torch.equal(ht_inf, ht.detach()), f"draw {draw}"
        if scan_layout == "plain":
            differ = (o_inf != o.detach()).float().mean().item()
            diff = rel_rms(o_inf, o.detach())
            print(f"o: {differ:.2e} of the elements differ, relative RMS {diff:.2e}")
            assert differ < 5e-4 and diff < 1e-4
        else:
            assert torch.equal(o_inf, o.detach()), f"draw {draw}"


@pytest.mark.gpu  # also on the CPU: the GPU suite runs it for the bit-for-bit check
def test_inference_forward_at_wide_keys_scans_128_wide_value_blocks(seed, monkeypatch):
    """At K > 128 the transposed forward scan runs in 128-wide value blocks without a backward to follow and in
    64-wide ones when it stores the states for the backward (plan._scan_plan). V = 200: two 128-wide blocks, the
    last one part masked. The inference forward matches the float64 reference and the training forward (on the GPU
    bit for bit: each value column's products are the same; under the interpreter to float32 rounding, as numpy's
    matrix products may sum in another order at another block shape)."""
    from k3lit.kernels.kda import kda_triton

    monkeypatch.setitem(plan.TUNING, "fwd_scan", "transposed")
    widths = spy_launches(monkeypatch, ("_scan_fwd_t",), lambda name, kw: kw["BV"])
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    q, k, v, g, beta, h0 = make_inputs(1, 70 if DEV == "cpu" else 700, 2, 136, 200, dtype=dtype)
    with torch.no_grad():
        o_inf, ht_inf = kda_triton(q, k, v, g, beta, None, h0, True)
    o, ht = kda_triton(q, k, v, g.requires_grad_(), beta, None, h0, True)
    assert widths == [128, 64]
    o_r, ht_r = kda_reference(*(x.double() for x in (q, k, v, g, beta)), None, h0.double(), True)
    tol = TOL_BF16 if DEV == "cuda" else TOL_F32
    assert_errors({"o": rel_rms(o_inf, o_r), "ht": rel_rms(ht_inf, ht_r)}, tol)
    if DEV == "cuda":
        assert torch.equal(o_inf, o.detach()) and torch.equal(ht_inf, ht.detach())
    else:
        assert rel_rms(o_inf, o.detach()) < 1e-6 and rel_rms(ht_inf, ht.detach()) < 1e-6


@pytest.mark.parametrize("segments,expect", [(4, [(0, 2, 0, 1), (2, 4, 1, 2), (4, 6, 2, 3), (6, 10, 3, 5)]),
                                             (9, [(2 * c, 2 * c + 2, c, c + 1) for c in range(5)])])
def test_pipelined_forward_and_backward_equal_one_pass(seed, scan_layout, monkeypatch, segments, expect):
    """The forward and backward in pipeline segments (``plan.TUNING["fwd_segments"]``, ``["bwd_segments"]``; on the
    GPU each segment's scan runs on a side stream beside the per-chunk kernels of another segment) give bit-identical
    outputs, final state and gradients: the state and its gradient cross each segment boundary in float32. B = 2
    sequences of 5 chunks (T = 150)."""
    from k3lit.kernels.kda import kda_triton

    table, segs = pipeline._segment_table(2, 5, segments, torch.device(DEV))
    assert list(segs) == expect  # (table rows, chunk range); 9 asked of 5 chunks: 5 segments
    assert table.tolist() == [[n, c] for lo, hi in [(s[2], s[3]) for s in expect] for n in (0, 1)
                              for c in range(lo, hi)]
    inputs = make_inputs(2, 150, 2, 16, 24)
    do = torch.randn(2, 150, 2, 24, device=DEV)
    t = "_t" if scan_layout == "transposed" else ""
    results = []
    for P in (1, segments):
        monkeypatch.setitem(plan.TUNING, "fwd_segments", P)
        monkeypatch.setitem(plan.TUNING, "bwd_segments", P)
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        scans = []
        for name in (f"_scan_fwd{t}", f"_scan_bwd{t}"):
            module = chunk_fwd if name.startswith("_scan_fwd") else chunk_bwd
            launch = getattr(module, name)

            class Spy:
                def __getitem__(self, grid, launch=launch, name=name, scans=scans):
                    def run(*args, **kw):
                        at = 10 if name.startswith("_scan_fwd") else 12  # it_lo, it_hi follow cu, coff
                        scans.append((name[:9], *args[at:at + 2]))
                        return launch[grid](*args, **kw)
                    return run

            monkeypatch.setattr(module, name, Spy())
        o, ht = kda_triton(*xs[:5], None, xs[5], True)
        (o * do).sum().add(ht.sum()).backward()
        ranges = [(0, 2**31 - 1)] if P == 1 else [(lo, hi) for *_, lo, hi in expect]
        assert scans == [("_scan_fwd", *r) for r in ranges] + [("_scan_bwd", *r) for r in reversed(ranges)]
        results.append([o, ht, *(x.grad for x in xs)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block", [2, 8, 32])
@pytest.mark.parametrize("collinear", [False, True])
def test_blocked_inverse(seed, monkeypatch, block, collinear):
    """``TUNING["inverse_block"]``: M = (I + Diag(beta) A)^-1 from substituted diagonal blocks doubled up with
    products (``chunk_fwd._inverse``) matches the float64 reference like the plain substitution, also with
    near-collinear keys (M badly conditioned), on a varlen batch with a partial chunk and K = 40; with the fused
    prep and with the split kernels (``_wy_fwd``). Every other test runs the default, 16; 32 is the plain
    substitution (no doubling), 2 and 8 double four and two times."""
    monkeypatch.setitem(plan.TUNING, "inverse_block", block)
    cu = torch.tensor([0, 9, 80], device=DEV)
    inputs = make_inputs(1, 80, 2, 40, 24, N=2, collinear=collinear)
    for prep in ("fused", "split"):
        monkeypatch.setitem(plan.TUNING, "fwd_prep", prep)
        assert_errors(run_both(inputs, cu_seqlens=cu), TOL_F32)


def _tf32_cases(device):
    """float32 values for the TF32 rounding tests: random magnitudes over the whole exponent range and both signs,
    exact ties (the 13 low bits 0x1000), one below and above them, carries into the exponent (0x1FFF low bits),
    subnormals, the largest finite float32, zeros and infinities."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 2**23, (1 << 16,), generator=gen, dtype=torch.int64)  # finite magnitudes
    low = torch.tensor([0x1000, 0x0FFF, 0x1001, 0x1FFF, 0x0000, 0x3000])
    edges = torch.tensor([0x7F7FFFFF, 0x7F7FF000, 0x00000001, 0x00001000, 0x007FFFFF, 0x00000000, 0x7F800000])
    bits = torch.cat([bits, (bits[:1024, None] & ~0x1FFF | low).flatten(), edges])
    bits = torch.cat([bits, bits | 0x80000000]).to(torch.int64)
    return (bits - (bits >= 2**31) * 2**32).to(torch.int32).view(torch.float32).to(device)


@triton.jit
def _tf32_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, common._tf32(tl.load(x + i, mask=i < n), False), mask=i < n)


@triton.jit
def _cvt_rna_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < n)
    tl.store(y + i, tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [v], dtype=tl.float32,
                                              is_pure=True, pack=1), mask=i < n)


def _elementwise(kernel, x):
    y = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def test_tf32_rounding_is_round_to_nearest_ties_away():
    """``common._tf32``'s bit form against the definition of ``cvt.rna.tf32.f32``, in float64: the nearest multiple
    of the TF32 unit (2^(e - 10) for a normal float32 of exponent e, 2^-136 below the normals), ties away from
    zero, overflowing to infinity past the largest TF32 value; infinities and zeros unchanged."""
    x = _tf32_cases(DEV)
    got = _elementwise(_tf32_kernel, x).double().cpu()
    xd = x.double().cpu()
    mag = xd.abs()
    finite = mag.isfinite() & (mag > 0)
    e = torch.floor(torch.log2(torch.where(finite, mag, 1.0))).clamp(min=-126)
    unit = torch.exp2(e - 10)
    want = torch.where(finite, torch.sign(xd) * torch.floor(mag / unit + 0.5) * unit, xd)
    want = torch.where(want.abs() > torch.finfo(torch.float32).max, torch.sign(xd) * float("inf"), want)
    assert torch.equal(got, want), (xd[got != want][:8], got[got != want][:8], want[got != want][:8])


def test_plain_output_rule(monkeypatch):
    """``TUNING["fwd_plain_out"] = "auto"``: the plain scan writes the output only without a backward to follow, at
    K, V <= 128, for bf16 and fp16 inputs; ``"fused"`` and ``"separate"`` are used as given."""
    rule = plan._plain_out_fused
    assert rule(False, 128, 128, torch.bfloat16) and rule(False, 64, 100, torch.float16)
    assert not rule(True, 128, 128, torch.bfloat16)
    assert not rule(False, 129, 128, torch.bfloat16) and not rule(False, 128, 256, torch.bfloat16)
    assert not rule(False, 128, 128, torch.float32)
    monkeypatch.setitem(plan.TUNING, "fwd_plain_out", "fused")
    assert rule(True, 256, 256, torch.float32)
    monkeypatch.setitem(plan.TUNING, "fwd_plain_out", "separate")
    assert not rule(False, 128, 128, torch.bfloat16)


def test_output_key_step_follows_the_plain_output_shapes(seed, monkeypatch):
    """``_out_fwd`` takes all keys in one product where the plain scan may write the output instead (K, V <= 128,
    bf16 or fp16 inputs), so that the two sum alike, and 64-wide key steps elsewhere (float32 inputs' 3xTF32
    products spill in one 128-wide step; V above 128)."""
    from k3lit.kernels.kda import kda_triton

    monkeypatch.setitem(plan.TUNING, "fwd_scan", "plain")
    steps = spy_launches(monkeypatch, ("_out_fwd",), lambda name, kw: kw["BK"])
    for K, V, dtype in ((80, 72, torch.bfloat16), (80, 72, torch.float32), (80, 136, torch.bfloat16)):
        q, k, v, g, beta, _ = make_inputs(1, 40, 1, K, V, dtype=dtype)
        kda_triton(q, k, v, g.requires_grad_(), beta, None, None, False, None)
    assert steps == [128, 64, 64]


def test_pipeline_segments_rule(monkeypatch):
    """``TUNING["bwd_segments"] = "auto"``: 4 segments only for a dense batch with B·H <= 16 and at least 512
    chunks a sequence; ``"fwd_segments" = "auto"``: never; one for varlen batches and single chunks; a number given
    in TUNING is used as given."""
    seg = plan._segments
    assert [seg("bwd", 1, 16, T, 32, None) for T in (8192, 16384, 32768)] == [1, 4, 4]
    assert [seg("fwd", B, 16, T, 32, None) for B, T in ((1, 65536), (1, 16384), (2, 8192), (8, 2048))] == [1] * 4
    assert seg("bwd", 2, 16, 65536, 32, None) == seg("bwd", 1, 96, 65536, 32, None) == 1  # B·H > 16
    assert seg("bwd", 1, 16, 65536, 32, torch.tensor([0, 65536])) == 1
    monkeypatch.setitem(plan.TUNING, "fwd_segments", 3)
    assert seg("fwd", 8, 16, 2048, 32, None) == 3 and seg("fwd", 8, 16, 32, 32, None) == 1
    assert seg("fwd", 1, 16, 65536, 32, torch.tensor([0, 65536])) == 1


@pytest.mark.parametrize("segments", [1, 2])
def test_plain_scan_with_fused_output(seed, monkeypatch, segments):
    """The plain forward scan writing the output itself (``TUNING["fwd_plain_out"] = "fused"``), with a backward
    to follow (it then also stores the states and Delta) and without, at K and V above one 64-wide block."""
    from k3lit.kernels.kda import kda_triton

    for key, value in dict(fwd_scan="plain", fwd_plain_out="fused", fwd_segments=segments).items():
        monkeypatch.setitem(plan.TUNING, key, value)
    inputs = make_inputs(2, 100, 2, 80, 72)
    assert_errors(run_both(inputs), TOL_F32)
    q, k, v, g, beta, h0 = inputs
    with torch.no_grad():
        o, ht = kda_triton(q, k, v, g, beta, None, h0, True)
    o_r, ht_r = kda_reference(*(x.double() for x in inputs[:5]), None, h0.double(), True)
    assert rel_rms(o, o_r) < TOL_F32 and rel_rms(ht, ht_r) < TOL_F32


@pytest.mark.parametrize("variant", [dict(fwd_prep="split"), dict(fwd_prep="fused", wy_bk=16, wy_bv=16)])
@pytest.mark.parametrize("fused", [False, True])
def test_forward_w_from_stored_kg(seed, monkeypatch, variant, fused):
    """The W pass reads the K⊙exp(G) that the intra-chunk pass stored in W's place (``fwd_prep = "split"``: from
    ``_intra_fwd`` to ``_wy_fwd``; ``"fused"``, the default: within ``_prep_fwd``, here in 16-wide steps at K = 24,
    V = 16: the blocked loops and their masks), with the fused gate's e and bias and the fused L2 norm too; with no
    backward to follow, only each chunk's last row of G is stored. Against the reference with and without a
    backward (varlen, a partial last chunk), and only those rows written without one."""
    from k3lit.kernels.kda import kda_triton

    for key, value in variant.items():
        monkeypatch.setitem(plan.TUNING, key, value)
    cu = torch.tensor([0, 9, 70], device=DEV)
    if fused:
        assert_errors(run_fused(1, 70, 2, 24, 16, cu_seqlens=cu, N=2), FUSED_TOL)
    else:
        assert_errors(run_both(make_inputs(1, 70, 2, 24, 16, N=2), cu_seqlens=cu), TOL_F32)
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 24, 16, N=2)
    with torch.no_grad():
        o, ht = kda_triton(q, k, v, g, beta, None, h0, True, cu)
    o_r, ht_r = kda_reference(*(x.double() for x in (q, k, v, g, beta)), None, h0.double(), True, cu)
    assert rel_rms(o, o_r) < TOL_F32 and rel_rms(ht, ht_r) < TOL_F32
    Gc = chunk_fwd.chunk_fwd(q, k, v, g, beta, 24**-0.5, h0, True, cu, 32, save=False)[2]
    last = [8, 40, 69]  # the chunks' last tokens: [0, 9), [9, 41), [41, 70)
    written = Gc[0].isfinite().all(-1).all(-1)  # every other row stays NaN (conftest's empty)
    assert written.nonzero().flatten().tolist() == last


@pytest.mark.parametrize("prep", ["fused", "split"])
@pytest.mark.parametrize("save", [True, False])
def test_inference_forward_skips_what_only_the_backward_reads(seed, scan_layout, monkeypatch, prep, save):
    """``chunk_fwd(save=False)`` leaves M unwritten (NaN: every buffer starts NaN here; split, Mi keeps L, zero on
    the diagonal, where M has ones) and, on the transposed scan, the per-chunk states and Delta; with ``save`` all
    are written. The plain scan's output kernel reads the states, so it writes them either way."""
    monkeypatch.setitem(plan.TUNING, "fwd_prep", prep)
    q, k, v, g, beta, _ = make_inputs(1, 70, 2, 16, 24)
    NC = 3  # chunks of 32 in T = 70
    _, _, _, _, Mi, _, _, _, h, D, _ = chunk_fwd.chunk_fwd(q, k, v, g, beta, 16**-0.5, None, True, None, 32,
                                                          qk_l2norm=True, save=save)
    rows = Mi[0, :, 0, :]  # [T, C]: row t of its chunk's matrix
    diag = rows[torch.arange(70), torch.arange(70) % 32]
    if save or prep == "split":
        assert torch.equal(diag, torch.full_like(diag, 1.0 if save else 0.0))
    else:
        assert bool(Mi.isnan().all())
    written = save or scan_layout == "plain"
    assert bool(h[:NC].isfinite().all()) == written and bool(D.isfinite().all()) == written


@pytest.mark.parametrize("gate", ["min", "zero"])
def test_gate_edges(seed, gate):
    """g = g_min everywhere puts the rebased exponents at their bound (80 at C = 32); g = 0 means no decay."""
    assert_errors(run_both(make_inputs(1, 40, 1, 16, 16, gate=gate)), TOL_F32)


@pytest.mark.parametrize(
    "T,gate",
    [
        (50, "min"),  # last chunk partly padded; exponents at their bound (80)
        (130, "min"),  # several full chunks and a partial one
        (130, "random"),
        (64, "zero"),  # a whole number of chunks, no decay
    ],
)
def test_several_chunks(seed, scan_layout, T, gate):
    assert_errors(run_both(make_inputs(1, T, 2, 24, 16, gate=gate)), TOL_F32)


def test_strong_bound_small_chunk(seed):
    """g_min = -10 forces C = 16 (exponent bound 80); gate pinned at the bound."""
    assert_errors(run_both(make_inputs(1, 37, 1, 16, 16, g_min=-10.0, gate="min"), g_min=-10.0), TOL_F32)


@pytest.mark.parametrize("gate", ["min", "random"])
def test_weak_bound_large_chunk(seed, gate):
    """g_min = -2.5 allows C = 64 (exponent bound 2.5 · 32 = 80): two full chunks and a partial one."""
    assert_errors(run_both(make_inputs(1, 150, 2, 24, 16, g_min=-2.5, gate=gate), g_min=-2.5), TOL_F32)


def test_near_collinear_keys(seed):
    assert_errors(run_both(make_inputs(1, 40, 1, 16, 16, collinear=True)), 1e-4)


def test_no_initial_state(seed):
    assert_errors(run_both(make_inputs(2, 9, 1, 16, 16), use_h0=False), TOL_F32)


@pytest.mark.parametrize("lens", [[5, 33, 0, 12], [70, 1, 64, 31, 129]])
def test_varlen_equals_separate_sequences(seed, scan_layout, lens):
    from k3lit.kernels.kda import kda_triton

    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=DEV)
    inputs = make_inputs(1, sum(lens), 1, 16, 16, N=len(lens))
    assert_errors(run_both(inputs, cu_seqlens=cu), TOL_F32)
    q, k, v, g, beta, h0 = inputs
    o, ht = kda_triton(q, k, v, g, beta, None, h0, True, cu)
    for n, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, ht_n = kda_triton(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], None,
                               h0[n : n + 1], True)
        torch.testing.assert_close(o[:, lo:hi], o_n, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ht[n : n + 1], ht_n, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="the Triton interpreter truncates float32 -> bfloat16 stores (twice round-to-nearest's error); "
    "bf16 accuracy is checked on the GPU (test_gpu_*)",
)
def test_bf16_inputs(seed):
    """bf16 operands with float32 accumulation stay inside the tolerances of docs/MATH.md §1."""
    assert_errors(run_both(make_inputs(1, 40, 1, 80, 72, dtype=torch.bfloat16)), TOL_BF16)


def test_dispatch_backend_triton(seed):
    q, k, v, g, beta, h0 = make_inputs(1, 10, 1, 16, 16)
    o, ht = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
    o_r, ht_r = kda_reference(q.double(), k.double(), v.double(), g.double(), beta.double(), None, h0.double(), True)
    assert rel_rms(o, o_r) < TOL_F32 and rel_rms(ht, ht_r) < TOL_F32


def test_recurrent_and_decode(seed):
    from k3lit.kernels.kda import kda_decode_triton, kda_recurrent_triton

    lens = [3, 0, 7]
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int64, device=DEV)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lens), 2, 20, 24, N=3)
    o, ht = kda_recurrent_triton(q, k, v, g, beta, None, h0, True, cu)
    o_r, ht_r = kda_reference(q.double(), k.double(), v.double(), g.double(), beta.double(), None, h0.double(),
                              True, cu)
    assert rel_rms(o, o_r) < TOL_F32 and rel_rms(ht, ht_r) < TOL_F32
    q, k, v, g, beta, h0 = make_inputs(3, 1, 2, 20, 24)
    state = h0.clone()
    o, s = kda_decode_triton(q, k, v, g, beta, state)
    o_r, ht_r = kda_reference(q.double(), k.double(), v.double(), g.double(), beta.double(), None, h0.double(), True)
    assert s is state and rel_rms(o, o_r) < TOL_F32 and rel_rms(state, ht_r) < TOL_F32


def test_errors():
    from k3lit.kernels.kda import kda_decode_triton, kda_triton

    q, k, v, g, beta, h0 = make_inputs(1, 4, 1, 16, 16)
    with pytest.raises(ValueError, match="too strong"):
        kda_triton(q, k, v, g, beta, g_min=-12.0)  # |g_min| * ceil(15 / 2) = 96 > 87 even at C = 16
    with pytest.raises(ValueError, match="chunk_size"):
        kda_triton(q, k, v, g, beta, chunk_size=128)
    big = torch.zeros(1, 4, 1, 300)
    with pytest.raises(ValueError, match="K, V <= 256"):
        kda_triton(big, big, big, big, beta.cpu())
    with pytest.raises(ValueError, match="T = 1"):
        kda_decode_triton(q, k, v, g, beta, h0)


@pytest.mark.parametrize(
    "which,NH,K,expect",
    [
        ("fwd", 64, 128, (True, 64)),  # enough programs for 64-wide transposed blocks
        ("fwd", 256, 256, (True, 64)),  # K = 256 too (2.74 against 3.29 ms at B8 H32); 128-wide unsaved
        ("fwd", 32, 128, (False, 32)),  # 32 x 8 = 256 programs at 16-wide blocks would share SMs
        ("fwd", 16, 128, (False, 16)),  # 16 x 8 = 128 programs < 132 SMs even 16-wide: narrower blocks
        ("bwd", 64, 128, (False, 32)),
        ("bwd", 96, 256, (True, 64)),
    ],
)
def test_scan_plan_rule(which, NH, K, expect):
    """The launch rule documented in k3lit/kernels/kda/README.md ("Compile time / tuning") and plan._scan_plan; with
    float32 operands at K = 256 always the plain state, in 2 pipeline stages (the shared memory of the transposed
    state, and of 3 stages, exceeds the H200's: test_sm90_compile.py)."""
    transposed, BK, BV, _, stages = plan._scan_plan(which, NH, K, 128, torch.device("meta"), False)
    assert (transposed, BV) == expect and BK == K and stages == 3
    # a forward with no backward to follow: 128-wide transposed blocks at K > 128, else as with one
    _, _, BV, _, _ = plan._scan_plan(which, NH, K, 128, torch.device("meta"), False, save=False)
    assert BV == (128 if which == "fwd" and expect[0] and K > 128 else expect[1])
    transposed, _, _, _, stages = plan._scan_plan(which, NH, K, 128, torch.device("meta"), True)
    assert transposed == (expect[0] and K <= 128) and stages == (2 if K > 128 else 3)


def test_torch_compile_no_graph_break(seed):
    """fullgraph=True fails on any graph break; aot_eager also traces the backward through the fake kernels."""
    from k3lit.kernels.kda import kda_triton

    q, k, v, g, beta, h0 = (x.requires_grad_() for x in make_inputs(1, 12, 1, 16, 16))

    def f(q, k, v, g, beta, h0):
        o, ht = kda_triton(q, k, v, g, beta, None, h0, True)
        return o.float().square().sum() + ht.sum()

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, h0)
    loss.backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o_r, ht_r = kda_reference(*ref[:5], None, ref[5], True)
    (o_r.square().sum() + ht_r.sum()).backward()
    for name, a, b in zip(NAMES, (q, k, v, g, beta, h0), ref):
        assert rel_rms(a.grad, b.grad) < TOL_F32, name


class _ZeroFills(TorchDispatchMode):
    """Records every zero-filling op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("zeros", "zeros_like", "new_zeros", "zero_") or (name == "fill_" and args[1] == 0):
            self.calls.append((name, tuple(out.shape)))
        return out


@pytest.mark.parametrize("used", ["o", "ht"])
def test_backward_fills_no_zero_gradients(seed, used):
    """The outputs saved only for the backward (Gc, h, W, ...) and an unused output get no zero gradient: autograd
    fills one per output by default, gigabytes a step at training shapes. Only the unused o (when only the final
    state is used) is materialised, by the backward itself."""
    from k3lit.kernels.kda import kda_triton

    q, k, v, g, beta, h0 = (x.requires_grad_() for x in make_inputs(1, 40, 2, 16, 8))
    o, ht = kda_triton(q, k, v, g, beta, None, h0, True)
    out = o if used == "o" else ht
    with _ZeroFills() as mode:
        out.backward(torch.randn_like(out))
    assert mode.calls == ([] if used == "o" else [("zeros_like", tuple(o.shape))])
    assert all(x.grad is not None for x in (q, k, v, g, beta, h0))


# ------------------------------------------------------------------------------------------------------------
# Fused gate (g = g_min * sigmoid(e + bias)) and q/k L2 norm inside the kernels
# ------------------------------------------------------------------------------------------------------------

FUSED_NAMES = ("q", "k", "v", "e", "beta", "h0", "bias")


def run_fused(B, T, H, K, V, gate=True, l2=True, g_min=-5.0, e_shift=0.0, tiny_q_row=False, cu_seqlens=None,
              dtype=torch.float32, device=DEV, N=None):
    """Raw (unnormalised, scaled) q, k and the gate pre-activation e through the fused kernels, against the
    float64 reference fed with F.normalize(q), F.normalize(k) and g_min * sigmoid(e + bias) formed in float64.
    Returns relative RMS errors of the outputs and of every input's gradient (bias included)."""
    from k3lit.kernels.kda import kda_triton

    q = torch.randn(B, T, H, K, device=device) * 3
    if tiny_q_row:  # norm ~4e-15 < 1e-12: F.normalize divides by 1e-12 instead (q̂ not unit, no projection)
        q[:, 0, 0] *= 1e-15
    k = torch.randn(B, T, H, K, device=device) * 0.3
    v = torch.randn(B, T, H, V, device=device)
    e = torch.randn(B, T, H, K, device=device) * 2 + e_shift
    beta = torch.sigmoid(torch.randn(B, T, H, device=device))
    h0 = torch.randn(N or B, H, K, V, device=device) * 0.5
    bias = torch.randn(H * K, device=device)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if not gate:
        e = g_min * torch.sigmoid(e)
    q, k, v, e = (x.to(dtype) for x in (q, k, v, e))
    inputs = [q, k, v, e, beta, h0, bias]
    ours = [x.detach().clone().requires_grad_() for x in inputs]
    ref = [x.detach().double().requires_grad_() for x in inputs]
    o, ht = kda_triton(*ours[:5], None, ours[5], True, cu_seqlens, g_min=g_min, use_gate_in_kernel=gate,
                       gate_bias=ours[6] if gate else None, use_qk_l2norm_in_kernel=l2)
    rq, rk, rv, re, rb, rh0, rbias = ref
    if l2:
        rq, rk = F.normalize(rq, dim=-1), F.normalize(rk, dim=-1)
    x = re + rbias.view(H, K)
    # sigmoid's autograd forms s (1 - s): at x = 30 even float64 keeps only ~3 digits of 1 - s. Each branch here
    # differentiates a sigmoid of a non-positive argument, whose s (1 - s) is exact to rounding.
    rg = g_min * torch.where(x >= 0, 1 - torch.sigmoid(-x), torch.sigmoid(x)) if gate else re
    o_r, ht_r = kda_reference(rq, rk, rv, rg, rb, None, rh0, True, cu_seqlens)
    do, dht = torch.randn_like(o_r), torch.randn_like(ht_r)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((o_r * do).sum() + (ht_r * dht).sum()).backward()
    err = {"o": rel_rms(o, o_r), "ht": rel_rms(ht, ht_r)}
    for name, a, b in zip(FUSED_NAMES, ours, ref):
        if name == "bias" and not gate:
            assert a.grad is None
            continue
        assert a.grad.dtype == a.dtype and a.grad.shape == a.shape, name
        err[name] = rel_rms(a.grad, b.grad)
    return err


FUSED_TOL = dict.fromkeys(("o", "ht") + FUSED_NAMES, TOL_F32)


@pytest.mark.parametrize(
    "B,T,H,K,V,gate,l2",
    [
        (1, 45, 2, 24, 16, True, True),  # T not a multiple of the chunk; both fusions
        (2, 33, 1, 80, 20, True, True),  # K above one 64-wide block: the norm spans blocks (pass 3 of the bwd)
        (1, 40, 1, 16, 16, True, False),  # gate only
        (1, 40, 1, 16, 16, False, True),  # L2 only
        (1, 1, 1, 16, 16, True, True),  # T = 1
    ],
)
def test_fused_gate_and_l2norm_match_reference(seed, B, T, H, K, V, gate, l2):
    assert_errors(run_fused(B, T, H, K, V, gate=gate, l2=l2), FUSED_TOL)


@pytest.mark.gpu  # also on the CPU: the interpreter's bits, and on the GPU the compiled code's rounding
@pytest.mark.parametrize("B,T,H,K,V,gate,l2,lens", [
    (1, 150, 2, 64, 64, True, True, None),  # `small`'s K = V = 64 (one key block), both fusions, 3 chunks
    (1, 45, 2, 24, 40, False, False, None),  # raw g, K narrower than its block
    (1, 45, 1, 16, 16, True, False, None),
    (1, 45, 1, 16, 16, False, True, None),
    (1, 100, 1, 32, 32, True, True, [0, 37, 100]),  # varlen: a chunk crossing a sequence start
    (1, 33, 1, 80, 20, True, True, None),  # two key blocks: "registers" falls back to the scratch
])
def test_main_bwd_keeps_key_results_in_registers_or_scratch_alike(seed, monkeypatch, B, T, H, K, V, gate, l2, lens):
    """``plan.TUNING["main_bwd_keep"]``: ``_main_bwd``'s pass-1 results (and the L2 norm's dq̂, dk̂) kept in registers
    where K fits one key block give the gradients of the float32 scratch round trip: bit for bit in the interpreter,
    which runs the same float32 operations in the same order; compiled for a GPU, where the two forms' code may
    contract or order a few products otherwise, within float32 rounding (relative RMS 5e-6 at ``small``'s shape,
    ``benchmarks/kda_tuning.py``). K = 80 spans two key blocks, so both settings run the scratch form: the same bits."""
    from k3lit.kernels.kda import kda_triton

    cu = None if lens is None else torch.tensor(lens, device=DEV, dtype=torch.int32)
    g_min = -5.0
    q, k = torch.randn(B, T, H, K, device=DEV) * 3, torch.randn(B, T, H, K, device=DEV) * 0.3
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    e = torch.randn(B, T, H, K, device=DEV) * 2
    if not gate:
        e = g_min * torch.sigmoid(e)
    inputs = [q, k, torch.randn(B, T, H, V, device=DEV), e, torch.sigmoid(torch.randn(B, T, H, device=DEV)),
              torch.randn(len(lens) - 1 if lens else B, H, K, V, device=DEV) * 0.5, torch.randn(H * K, device=DEV)]
    do = torch.randn(B, T, H, V, device=DEV)
    grads = {}
    for keep in ("scratch", "registers"):
        monkeypatch.setitem(plan.TUNING, "main_bwd_keep", keep)
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o, ht = kda_triton(*xs[:5], None, xs[5], True, cu, g_min=g_min, use_gate_in_kernel=gate,
                           gate_bias=xs[6] if gate else None, use_qk_l2norm_in_kernel=l2)
        (o * do).sum().add(ht.sum()).backward()
        grads[keep] = [x.grad for x in xs if x.grad is not None]
    assert len(grads["scratch"]) == (7 if gate else 6)
    for a, b in zip(grads["scratch"], grads["registers"], strict=True):
        assert torch.equal(a, b) if DEV == "cpu" or K > 64 else rel_rms(b, a) < 1e-5


@pytest.mark.parametrize("e_shift", [30.0, -30.0])
def test_fused_gate_saturated(seed, e_shift):
    """e + bias far above 0: g at g_min (exponents at their bound, sigmoid' ~ 0); far below: g = 0."""
    assert_errors(run_fused(1, 40, 1, 16, 16, e_shift=e_shift), FUSED_TOL)


def test_fused_varlen_and_strong_bound(seed):
    lens = [5, 33, 0, 12]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device=DEV)
    assert_errors(run_fused(1, sum(lens), 1, 16, 16, cu_seqlens=cu, N=len(lens)), FUSED_TOL)
    assert_errors(run_fused(1, 37, 1, 16, 16, g_min=-10.0), FUSED_TOL)  # C = 16
    assert_errors(run_fused(1, 150, 1, 16, 16, g_min=-2.5), FUSED_TOL)  # C = 64


def test_fused_l2norm_clamped_row(seed):
    """A query row with norm below F.normalize's eps = 1e-12: q / 1e-12 and gradient dq̂ / 1e-12, no projection."""
    assert_errors(run_fused(1, 20, 1, 16, 16, tiny_q_row=True), FUSED_TOL)


def test_fused_gate_without_bias_equals_log_decay_input(seed):
    from k3lit.kernels.kda import kda_triton

    q, k, v, _, beta, h0 = make_inputs(1, 40, 2, 16, 16)
    e = torch.randn(1, 40, 2, 16, device=DEV) * 3
    o, ht = kda_triton(q, k, v, e, beta, None, h0, True, use_gate_in_kernel=True)
    o_ref, ht_ref = kda_triton(q, k, v, -5.0 * torch.sigmoid(e), beta, None, h0, True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-5, atol=1e-6)


def test_fused_gate_bias_errors():
    from k3lit.kernels.kda import kda_triton

    q, k, v, g, beta, _ = make_inputs(1, 4, 2, 16, 16)
    with pytest.raises(ValueError, match="use_gate_in_kernel"):
        kda_triton(q, k, v, g, beta, gate_bias=torch.zeros(32))
    with pytest.raises(ValueError, match=r"\[H \* K\]"):
        kda_triton(q, k, v, g, beta, use_gate_in_kernel=True, gate_bias=torch.zeros(31))


def test_fused_torch_compile_no_graph_break(seed):
    from k3lit.kernels.kda import kda_triton

    q, k, v, e, beta, _ = make_inputs(1, 12, 1, 16, 16)
    bias = torch.zeros(16, device=DEV, requires_grad=True)
    q, k, v, e, beta = (x.requires_grad_() for x in (q * 2, k, v, e, beta))

    def f(q, k, v, e, beta, bias):
        o, _ = kda_triton(q, k, v, e, beta, use_gate_in_kernel=True, gate_bias=bias, use_qk_l2norm_in_kernel=True)
        return o.square().sum()

    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, e, beta, bias).backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, e, beta, bias))


# ------------------------------------------------------------------------------------------------------------
# GPU: bf16 inputs at training shapes, docs/MATH.md §1 tolerances
# ------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")


@pytest.mark.gpu
@gpu
def test_gpu_tf32_rounding_equals_cvt_rna():
    """On the GPU, ``common._tf32``'s bit form gives the bits of ``cvt.rna.tf32.f32`` on every case, ties and carries
    into the exponent included (the instruction it replaces in ``_intra_chunk``)."""
    x = _tf32_cases("cuda")
    got, want = _elementwise(_tf32_kernel, x), _elementwise(_cvt_rna_kernel, x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "B,T,H,K,V,dtype",
    [
        (2, 1024, 4, 128, 128, torch.bfloat16),
        (1, 777, 2, 64, 64, torch.bfloat16),
        (1, 512, 2, 256, 256, torch.bfloat16),
        (1, 300, 2, 100, 72, torch.bfloat16),
        (1, 512, 2, 128, 128, torch.float16),
    ],
)
def test_gpu_matches_reference(seed, scan_layout, B, T, H, K, V, dtype):
    assert_errors(run_both(make_inputs(B, T, H, K, V, dtype=dtype, device="cuda")), TOL_BF16)


@pytest.mark.gpu
@gpu
def test_gpu_float32_inputs_reach_float32_accuracy(seed, scan_layout):
    """float32 inputs multiply in 3xTF32 (common._dot), documented as float32 accuracy: the interpreter tests'
    float32 tolerance must hold on the GPU too (single TF32 products would miss it by ~100x)."""
    assert_errors(run_both(make_inputs(1, 300, 2, 128, 128, dtype=torch.float32, device="cuda")), TOL_F32)


@pytest.mark.gpu
@gpu
def test_gpu_float32_inputs_at_k256_with_many_heads(seed):
    """float32 inputs at K = V = 256 over 96 sequence-heads, where ``plan._scan_plan`` would pick the transposed
    scans for bf16: they, and the plain scans in 3 pipeline stages, need more shared memory than an H200 block has
    (kernel_resources.py); the plain scans in 2 stages launch and reach float32 accuracy."""
    assert_errors(run_both(make_inputs(1, 100, 96, 256, 256, dtype=torch.float32, device="cuda")), TOL_F32)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("gate", ["min", "zero"])
def test_gpu_gate_edges(seed, gate):
    assert_errors(run_both(make_inputs(1, 256, 2, 128, 128, dtype=torch.bfloat16, gate=gate, device="cuda")),
                  TOL_BF16)


@pytest.mark.gpu
@gpu
def test_gpu_varlen(seed, scan_layout):
    lens = [1, 100, 64, 300, 31]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64, device="cuda")
    inputs = make_inputs(1, sum(lens), 2, 128, 128, dtype=torch.bfloat16, N=len(lens), device="cuda")
    assert_errors(run_both(inputs, cu_seqlens=cu), TOL_BF16)


@pytest.mark.gpu
@gpu
def test_gpu_decode_matches_reference(seed):
    from k3lit.kernels.kda import kda_decode_triton

    q, k, v, g, beta, h0 = make_inputs(4, 1, 8, 128, 128, dtype=torch.bfloat16, device="cuda")
    state = h0.clone()
    o, _ = kda_decode_triton(q, k, v, g, beta, state)
    o_r, ht_r = kda_reference(q.double(), k.double(), v.double(), g.double(), beta.double(), None, h0.double(), True)
    assert rel_rms(o, o_r) < TOL_BF16["o"] and rel_rms(state, ht_r) < TOL_BF16["ht"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("K", [128, 100])
def test_gpu_fused_gate_and_l2norm(seed, K):
    err = run_fused(2, 600, 2, K, 128, dtype=torch.bfloat16, device="cuda")
    assert_errors(err, {**TOL_BF16, "e": TOL_BF16["g"], "bias": TOL_BF16["g"]})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,T", [(16, 2048), (4, 8192), (1, 32768)])
def test_gpu_fused_at_the_small_recipes_shapes(seed, B, T):
    """The fused op as the ``small`` model calls it (H = 12, K = V = 64, bf16, the launch plan ``"auto"`` picks):
    B16 T2048 takes the transposed scans, B4 T8192 (48 sequence-heads) the plain ones, B1 T32768 the plain ones with
    the backward in pipeline segments. Each within docs/MATH.md §1's tolerances of the float64 reference over the
    whole sequence."""
    err = run_fused(B, T, 12, 64, 64, dtype=torch.bfloat16, device="cuda")
    assert_errors(err, {**TOL_BF16, "e": TOL_BF16["g"], "bias": TOL_BF16["g"]})


@pytest.mark.gpu
@gpu
def test_gpu_dense_metadata_first_built_in_a_graph_capture(seed):
    """Chunk metadata made while a CUDA graph is captured holds its values only when the graph replays; an eager
    call of the same shape after the capture must not be handed those tensors (it gets ones built eagerly)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    B, T, C = 3, 203, 32  # a shape no other test uses: the capture builds the first copy
    index._dense_meta.cache_clear()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = index.chunk_meta(None, B, T, C, dev)
    eager = index.chunk_meta(None, B, T, C, dev)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(captured[:3], eager[:3]))
    n_per = -(-T // C)
    assert torch.equal(eager[0].cpu(), torch.arange(B + 1) * T) and eager[3] == B * n_per
    assert torch.equal(eager[1].cpu(), torch.stack([torch.arange(B).repeat_interleave(n_per),
                                                    torch.arange(n_per).repeat(B)], 1).int())
    assert index.chunk_meta(None, B, T, C, dev)[1] is eager[1]  # cached outside a capture


@pytest.mark.gpu
@gpu
def test_gpu_tables_are_kept_on_the_default_stream_only(seed):
    """Dense chunk tables and pipeline segment tables made on the default stream are reused; ones made on another
    stream (as a CUDA graph's warm-up runs, inside the graph's memory pool) are built afresh each call, with the
    same values."""
    dev = torch.device("cuda", torch.cuda.current_device())
    B, T, C = 2, 197, 32
    index._dense_meta.cache_clear()
    pipeline._segment_table_cached.cache_clear()
    kept = index.chunk_meta(None, B, T, C, dev), pipeline._segment_table(B, 7, 3, dev)
    assert index.chunk_meta(None, B, T, C, dev)[1] is kept[0][1]
    assert pipeline._segment_table(B, 7, 3, dev)[0] is kept[1][0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        made = [(index.chunk_meta(None, B, T, C, dev)[1], pipeline._segment_table(B, 7, 3, dev)[0]) for _ in range(2)]
    torch.cuda.synchronize()
    assert made[0][0] is not made[1][0] and made[0][1] is not made[1][1]
    assert all(m[0] is not kept[0][1] and torch.equal(m[0], kept[0][1]) for m in made)
    assert all(m[1] is not kept[1][0] and torch.equal(m[1], kept[1][0]) for m in made)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pipelined_forward_and_backward_equal_one_pass(seed, scan_layout, monkeypatch, graph):
    """On CUDA each pipeline segment's scan runs on a side stream: a missing wait between the streams would show
    as a result that differs from the one-pass forward (bit-identical otherwise), in eager calls and in a CUDA
    graph that captured the streams (replayed on fresh inputs); likewise the backward's gradients."""
    from k3lit.kernels.kda import kda_triton

    inputs = make_inputs(2, 4000, 4, 128, 128, dtype=torch.bfloat16, device="cuda")  # 125 chunks per sequence
    fresh = make_inputs(2, 4000, 4, 128, 128, dtype=torch.bfloat16, device="cuda")
    results = []
    for P in (1, 4):
        monkeypatch.setitem(plan.TUNING, "fwd_segments", P)
        xs = [x.clone() for x in inputs]

        def fwd(xs=xs):
            with torch.no_grad():
                return kda_triton(*xs[:5], None, xs[5], True)

        if graph:
            fwd()  # compile and build the tables outside the capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = fwd()
            for x, y in zip(xs, fresh):
                x.copy_(y)
            g.replay()
            torch.cuda.synchronize()
            results.append([t.clone() for t in out])
        else:
            results.append(list(fwd()))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    grads = []
    for P in (1, 4):  # the backward's pipeline, eagerly
        monkeypatch.setitem(plan.TUNING, "bwd_segments", P)
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o, ht = kda_triton(*xs[:5], None, xs[5], True)
        (o.float().square().sum() + ht.sum()).backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert_errors(run_both(inputs), TOL_BF16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", [dict(fwd_scan="plain", fwd_plain_out="fused"), dict(u_dtype="work"),
                                     dict(fwd_prep="split"),
                                     dict(fwd_prep="fused", prep_warps=2), dict(inverse_block=32),
                                     dict(inverse_block=8)])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_forward_variants(seed, monkeypatch, variant, fused):
    """The forward alternatives of ``plan.TUNING``, at bf16 within docs/MATH.md's tolerances (K = V = 256 for the
    plain scan's fused output, else 128)."""
    for key, value in variant.items():
        monkeypatch.setitem(plan.TUNING, key, value)
    D = 256 if "fwd_plain_out" in variant else 128
    if fused:
        err = run_fused(2, 600, 2, D, D, dtype=torch.bfloat16, device="cuda")
        assert_errors(err, {**TOL_BF16, "e": TOL_BF16["g"], "bias": TOL_BF16["g"]})
    else:
        assert_errors(run_both(make_inputs(1, 1000, 2, D, D, dtype=torch.bfloat16, device="cuda")), TOL_BF16)


def test_benchmark_input_variants_agree(seed):
    """benchmarks/kda.py --fused-inputs times these callables; on the same raw inputs they must compute one thing."""
    from benchmarks.kda import raw_inputs, variants

    xs = raw_inputs(1, 40, 2, 16, device=DEV, dtype=torch.float32)
    outs = {name: fn(*xs)[0] for name, fn in variants().items()}
    assert set(outs) == {"k3lit fused", "k3lit unfused"}
    assert rel_rms(outs["k3lit fused"], outs["k3lit unfused"]) < 1e-5
