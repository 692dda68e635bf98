"""MoE layer: grouped matmul, parity with a per-token loop, the float32 bias, and balancer bookkeeping."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from k3lit.nn import MoE, SwiGLU, update_balancers
from k3lit.ops import grouped_mm, max_violation, permute, quantile_bias, sign_bias_update
from k3lit.ops.grouped_mm import native_grouped_mm_supported
from k3lit.ops.routing import (
    capacity_route,
    capacity_threshold_from_histogram,
    chooser_score_histogram,
    quantile_bias_from_histogram,
    required_bias_histogram,
    route,
    sliding_average,
)
from tests.parallel._dist import run_workers


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _per_expert(x, w, counts):
    out, start = [], 0
    for e, c in enumerate(counts):
        out.append(x[start : start + c] @ w[e])
        start += c
    return torch.cat(out)


# ----------------------------------------------------------------------------------------- grouped_mm
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7], [1], [4, 4, 0, 0]])
def test_grouped_mm_matches_per_expert_loop_float64(seed, counts):
    E, d, f = len(counts), 5, 3
    x = torch.randn(sum(counts), d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(E, d, f, dtype=torch.float64, requires_grad=True)
    g = torch.randn(sum(counts), f, dtype=torch.float64)
    out = grouped_mm(x, w, _offsets(counts))
    gx, gw = torch.autograd.grad(out, (x, w), g)
    ref = _per_expert(x, w, counts)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)  # empty experts get an exact zero gradient
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, _offsets(counts)), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_native_and_fallback_agree(seed, dtype):
    """On this CPU torch's F.grouped_mm runs for float32/bfloat16 with 16-byte aligned rows: both paths agree."""
    counts = [5, 0, 9, 2]
    x = torch.randn(sum(counts), 16, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 16, 32, dtype=dtype, requires_grad=True)
    if not native_grouped_mm_supported(x, w):
        pytest.skip("torch.nn.functional.grouped_mm is not available for these operands in this build")
    offs = _offsets(counts)
    native = grouped_mm(x, w, offs, backend="native")
    loop = grouped_mm(x, w, offs, backend="loop")
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native, loop, **tol)
    # backward, including the stride-0 gradient of .sum() that the native kernel needs made dense
    gn = torch.autograd.grad(native.sum(), (x, w))
    gl = torch.autograd.grad(loop.sum(), (x, w))
    for a, b in zip(gn, gl, strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grouped_mm_rows_past_the_last_group_belong_to_no_group(seed, device):
    """The capacity path hands all m k slots over, the dropped ones past the last group: they take no part in the
    grouped rows' outputs or in any weight gradient, on the native kernel (bf16) as on the loop."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    counts, past = [5, 0, 9, 2], 6
    x = torch.randn(sum(counts) + past, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 16, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    if not native_grouped_mm_supported(x, w):
        pytest.skip("torch.nn.functional.grouped_mm is not available for these operands in this build")
    offs, n = _offsets(counts).to(device), sum(counts)
    g = torch.randn(n + past, 32, device=device, dtype=torch.bfloat16)  # nonzero past the groups as well
    native, loop = grouped_mm(x, w, offs, backend="native"), grouped_mm(x, w, offs, backend="loop")
    tol = dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(native[:n], loop[:n], **tol)
    (gx_n, gw_n), (gx_l, gw_l) = (torch.autograd.grad(o, (x, w), g) for o in (native, loop))
    torch.testing.assert_close(gw_n, gw_l, **tol)  # the rows past the last group add nothing to any expert
    assert gw_n.isfinite().all() and gx_n[:n].isfinite().all()
    torch.testing.assert_close(gx_n[:n], gx_l[:n], **tol)


def test_grouped_mm_unaligned_falls_back(seed):
    x, w = torch.randn(6, 5), torch.randn(2, 5, 3)  # 20-byte rows: the native kernel refuses them
    assert not native_grouped_mm_supported(x, w)
    torch.testing.assert_close(grouped_mm(x, w, _offsets([2, 4])), _per_expert(x, w, [2, 4]))


# --------------------------------------------------------------------------------------------- MoE
def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definition."""
    B, T, D = x.shape
    out = torch.zeros_like(x)
    wr = moe.router.weight
    for b in range(B):
        for t in range(T):
            xi = x[b, t]
            s = torch.sigmoid(wr @ xi)
            chosen = (s + moe.expert_bias.to(s.dtype)).topk(moe.top_k).indices
            y = torch.zeros(D, dtype=x.dtype)
            for j in chosen.tolist():
                gu = xi @ moe.w_gate_up[j]
                gate, up = gu[: moe.expert_dim], gu[moe.expert_dim :]
                y = y + s[j] / s[chosen].sum() * ((F.silu(gate) * up) @ moe.w_down[j])
            if moe.shared is not None:
                y = y + moe.shared(xi)
            out[b, t] = y
    return out


@pytest.mark.parametrize("n_shared", [0, 2])
def test_moe_matches_per_token_loop_float64(seed, n_shared):
    moe = MoE(dim=12, n_experts=6, top_k=2, expert_dim=7, n_shared_experts=n_shared).double()
    moe.expert_bias.copy_(torch.randn(6) * 0.3)  # the bias must steer the selection
    x = torch.randn(2, 9, 12, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    ref = _naive_moe(moe, x)
    torch.testing.assert_close(out, ref)
    params = [x, moe.router.weight, moe.w_gate_up, moe.w_down]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(ref, params, g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_swiglu_is_silu_gate_times_up(seed):
    mlp = SwiGLU(8, 5).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    wg, wu = mlp.w_gate_up.weight[:5], mlp.w_gate_up.weight[5:]
    torch.testing.assert_close(mlp(x), (F.silu(x @ wg.T) * (x @ wu.T)) @ mlp.w_down.weight.T)


def test_bad_config_errors_name_the_field():
    with pytest.raises(ValueError, match="balancer"):
        MoE(8, 4, 2, 8, balancer="quantiles")
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 4, 4, 8, balancer="quantile")
    with pytest.raises(ValueError, match="expert_dim"):
        MoE(8, 4, 2, 0)
    MoE(8, 4, 4, 8, balancer="none")  # k = n is fine without quantile balancing


def test_bias_stays_float32_under_casts(seed):
    moe = MoE(16, 8, 2, 16)
    bias = torch.randn(8) * 1e-3 + 0.1234567  # not representable in bfloat16 or float16
    moe.expert_bias.copy_(bias)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(), lambda m: m.float()):
        moe = cast(moe)
        assert moe.expert_bias.dtype == torch.float32
        assert torch.equal(moe.expert_bias, bias)  # no lossy round trip
    moe = moe.to(torch.bfloat16)
    assert moe.w_gate_up.dtype == torch.bfloat16 and moe.router.weight.dtype == torch.bfloat16
    # Lightning's bf16-true precision converts the module the same way
    from lightning.pytorch.plugins.precision import HalfPrecision

    moe = HalfPrecision("bf16-true").convert_module(moe)
    assert moe.expert_bias.dtype == torch.float32 and torch.equal(moe.expert_bias, bias)
    # a bf16 module still routes and balances in float32
    moe.train()
    y = moe(torch.randn(2, 8, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    moe.update_balancer()
    assert moe.expert_bias.dtype == torch.float32
    # state dict round trip keeps float32
    other = MoE(16, 8, 2, 16).to(torch.bfloat16)
    other.load_state_dict(moe.state_dict())
    assert other.expert_bias.dtype == torch.float32 and torch.equal(other.expert_bias, moe.expert_bias)


def test_autocast_forward_routes_in_float32(seed):
    moe = MoE(16, 8, 2, 16, n_shared_experts=1).train()
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert moe._pending_scores[0].dtype == torch.float32
    torch.testing.assert_close(y.float(), moe.eval()(x), atol=5e-2, rtol=5e-2)


def test_update_once_per_optimizer_step_from_all_micro_batches(seed):
    moe = MoE(16, 8, 2, 16).train()
    moe.expert_bias.copy_(torch.randn(8) * 0.1)
    bias0 = moe.expert_bias.clone()
    micro = [torch.randn(2, 7, 16) for _ in range(3)]
    for x in micro:
        moe(x).sum().backward()
        assert torch.equal(moe.expert_bias, bias0)  # never routed by a bias derived from its own batch
    assert moe.pending_tokens == 3 * 14
    with torch.no_grad():
        scores = torch.cat([moe.router_scores(x.reshape(-1, 16)) for x in micro])
    moe.update_balancer()
    torch.testing.assert_close(moe.expert_bias, quantile_bias(scores, bias0, 2))
    assert moe.pending_tokens == 0
    # a second call in the same step has nothing to consume and leaves the bias alone
    bias1 = moe.expert_bias.clone()
    moe.update_balancer()
    assert torch.equal(moe.expert_bias, bias1)


@pytest.mark.parametrize("balancer", ["quantile", "quantile_hist"])
def test_sliding_average_update_in_the_module(seed, balancer):
    """Each update moves the bias by quantile_rate towards the step's estimate from every micro-batch."""
    moe = MoE(16, 8, 2, 16, balancer=balancer, quantile_rate=0.25).train()
    for step in range(3):
        bias0 = moe.expert_bias.clone()
        micro = [torch.randn(2, 9, 16) for _ in range(2)]
        for x in micro:
            moe(x)
        with torch.no_grad():
            scores = torch.cat([moe.router_scores(x.reshape(-1, 16)) for x in micro])
        if balancer == "quantile":
            estimate = quantile_bias(scores, bias0, 2)
        else:
            lo, hi = bias0.min() - 1, bias0.max() + 1
            estimate = quantile_bias_from_histogram(required_bias_histogram(scores, bias0, 2, lo, hi, 1000), lo, hi, 2)
        moe.update_balancer()
        torch.testing.assert_close(moe.expert_bias, sliding_average(bias0, estimate, 0.25))
        assert int(moe.balancer_step) == step + 1


def _skewed_moe(capacity_mode: str, **kw) -> MoE:
    """An MoE whose router prefers a few experts (overloading them without a limit), capacity factor 1."""
    moe = MoE(16, 8, 2, 16, capacity_factor=1.0, capacity_mode=capacity_mode, **kw)
    with torch.no_grad():
        moe.router.weight[:, 0] = 3.0 * torch.randn(8)
    return moe


def _skewed_batch(b: int, t: int) -> torch.Tensor:
    x = torch.randn(b, t, 16)
    x[..., 0] = 1.0  # a constant feature: router column 0 carries the per-expert skew
    return x


@pytest.mark.parametrize("capacity_mode", [None, "causal"])
def test_the_triton_slot_sort_runs_the_same_layer(seed, monkeypatch, capacity_mode):
    """The MoE with the slots sorted by the Triton counting sort (the CUDA path; here under the interpreter) gives
    the output and gradients of the stable argsort, bit for bit: the same permutation, so the same sums. With the
    causal capacity some slots are dropped and sort after every expert."""
    import k3lit.nn.moe

    moe = _skewed_moe(capacity_mode) if capacity_mode else MoE(16, 8, 2, 16)
    x = _skewed_batch(2, 150)
    runs = []
    for backend in ("torch", "triton"):
        monkeypatch.setattr(k3lit.nn.moe, "sort_slots", functools.partial(permute.sort_slots, backend=backend))
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        y = moe(xi)
        y.square().sum().backward()
        runs.append((y, xi.grad, moe.experts.w_down.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    if capacity_mode:
        assert int(moe.last_stats["dropped"]) + int(moe.last_stats["rerouted"]) > 0


def test_quantile_capacity_threshold_update(seed):
    """The step's threshold is the score above which cf m k / n of the step's tokens chose each expert (routed
    by the bias of that step), averaged in at quantile_rate; the next forward applies it."""
    moe = _skewed_moe("quantile", balancer="none", quantile_rate=0.5).train()
    moe.capacity_threshold.fill_(0.9)  # a running estimate from earlier steps
    micro = [_skewed_batch(2, 50) for _ in range(2)]
    for x in micro:
        moe(x)
    assert moe.pending_tokens == 200
    with torch.no_grad():
        scores = torch.cat([moe.router_scores(x.reshape(-1, 16)) for x in micro])
    want = capacity_threshold_from_histogram(chooser_score_histogram(scores, torch.zeros(8), 2, 1000),
                                             1.0 * 200 * 2 / 8)
    assert (want > 0).any() and (want == 0).any()  # some experts overloaded, some not
    moe.update_balancer()
    torch.testing.assert_close(moe.capacity_threshold, sliding_average(torch.full((8,), 0.9), want, 0.5))
    moe(micro[0])  # the next forward routes by the new threshold: as capacity_route with it, and unlike route
    stats = {k: float(v) for k, v in moe.last_stats.items()}
    with torch.no_grad():
        s0 = moe.router_scores(micro[0].reshape(-1, 16))
    _, _, rerouted, dropped = capacity_route(s0, moe.expert_bias, 2, min_score=moe.capacity_threshold)
    assert (stats["rerouted"], stats["dropped"]) == (float(rerouted), float(dropped))
    top = route(s0, moe.expert_bias, 2)[0]
    turned_away = (s0.gather(1, top) < moe.capacity_threshold[top]).any()
    assert bool(turned_away) == (stats["rerouted"] + stats["dropped"] > 0)


@pytest.mark.parametrize("mode", ["quantile", "causal", "forward"])
def test_capacity_mode_causality(seed, mode):
    """quantile and causal capacity: new later tokens leave every earlier token's output as it was (its routing
    depends on its own scores and the module's state, or on earlier positions); the per-forward count limit in
    token order does not have that property."""
    moe = _skewed_moe(mode, quantile_rate=0.5).train()
    for _ in range(4):  # a few steps give the quantile threshold its running estimate
        moe(_skewed_batch(4, 64))
        moe.update_balancer()
    if mode == "quantile":
        assert (moe.capacity_threshold > 0).any()
    moe.eval()
    x = _skewed_batch(2, 96)
    later = x.clone()
    later[:, 48:] = _skewed_batch(2, 48) * 3.0
    with torch.no_grad():
        y, y_later = moe(x), moe(later)
    same = torch.allclose(y[:, :48], y_later[:, :48], atol=1e-6, rtol=1e-5)
    assert same == (mode != "forward")


@pytest.mark.parametrize("mode", ["causal", "causal-triton", "quantile"])
def test_capacity_compiles_as_one_graph_and_matches_eager(seed, monkeypatch, mode):
    """Capacity routing and the experts under ``torch.compile(fullgraph=True)`` (a graph break raises: a host sync
    or a data-dependent shape would), forward and backward traced by AOT autograd: the same outputs, gradients and
    re-routed counts as eager. bf16 autocast, as in training (the grouped products' compiled path). The gradients
    agree to float32 rounding: the router's products stay float32 in the traced backward too, where AOT autograd
    would otherwise run them in bf16 (relative errors of 1e-4 to 4e-3 before ``_Float32Linear``). ``causal-triton``:
    the causal route through its Triton kernel (the CUDA path; here under the interpreter)."""
    from torch._dynamo.utils import counters

    if mode == "causal-triton":
        import k3lit.nn.moe

        mode = "causal"
        monkeypatch.setattr(k3lit.nn.moe, "causal_capacity_route",
                            functools.partial(k3lit.nn.moe.causal_capacity_route, backend="triton"))

    eager = _skewed_moe(mode, quantile_rate=0.5).train()
    for _ in range(4):  # the bias moves; the quantile mode gets its running score threshold
        eager(_skewed_batch(4, 64))
        eager.update_balancer()
    x = _skewed_batch(2, 64).requires_grad_()
    if mode == "quantile":  # a threshold that surely turns slots away: each expert's median score on x
        with torch.no_grad():
            eager.capacity_threshold.copy_(eager.router_scores(x.reshape(-1, 16)).median(dim=0).values)
    compiled = _skewed_moe(mode, quantile_rate=0.5).train()
    compiled.load_state_dict(eager.state_dict())
    counters.clear()
    compiled.compile(fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref = eager(x)
        y = compiled(x)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(y, y_ref)
    g_ref = torch.autograd.grad(y_ref.float().square().sum(), [x, eager.experts.w_down, eager.router.weight])
    g = torch.autograd.grad(y.float().square().sum(), [x, compiled.experts.w_down, compiled.router.weight])
    for a, b in zip(g, g_ref):
        assert a.isfinite().all() and ((a - b).norm() / b.norm()).item() < 1e-5
    rerouted = [float(m.last_stats["rerouted"]) for m in (compiled, eager)]
    assert rerouted[0] == rerouted[1] > 0


def test_balancer_state_round_trips_through_the_state_dict(seed):
    """The running bias, the capacity threshold and the update count are buffers: a module loaded from the
    state dict continues exactly as the original does."""
    a = _skewed_moe("quantile", quantile_rate=0.3, sync_every=2).train()
    for _ in range(3):
        a(_skewed_batch(2, 40))
        a.update_balancer()
    state = a.state_dict()
    assert {"expert_bias", "capacity_threshold", "balancer_step"} <= state.keys() and int(state["balancer_step"]) == 3
    b = _skewed_moe("quantile", quantile_rate=0.3, sync_every=2).train()
    b.load_state_dict(state)
    for _ in range(2):
        x = _skewed_batch(2, 40)
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
        a.update_balancer()
        b.update_balancer()
    for name in ("expert_bias", "capacity_threshold", "balancer_step"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_aux_free_sums_loads_over_micro_batches(seed):
    moe = MoE(16, 8, 2, 16, balancer="aux_free", bias_update_rate=0.01).train()
    total = torch.zeros(8)
    for _ in range(3):
        moe(torch.randn(2, 7, 16))
        total += moe.last_load
    moe.update_balancer()
    torch.testing.assert_close(moe.expert_bias, sign_bias_update(torch.zeros(8), total, 0.01))


def test_eval_mode_is_frozen(seed):
    moe = MoE(16, 8, 2, 16).eval()
    moe(torch.randn(2, 7, 16))
    assert moe.pending_tokens == 0 and moe.last_load.sum() == 2 * 7 * 2
    moe.update_balancer()
    assert torch.equal(moe.expert_bias, torch.zeros(8))


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("balancer", ["quantile", "aux_free", "aux_loss"])
def test_no_double_counting_under_activation_checkpointing(seed, use_reentrant, balancer):
    moe = MoE(16, 8, 2, 16, balancer=balancer).train()
    calls = []
    moe.register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 7, 16, requires_grad=True)
    y = checkpoint(moe, x, use_reentrant=use_reentrant)
    load = moe.last_load.clone()
    aux = moe.aux_loss
    loss = y.square().sum() + (aux if aux is not None else 0)
    loss.backward()
    assert len(calls) == 2  # the forward really ran again inside backward
    assert x.grad is not None and moe.w_down.grad is not None
    assert torch.equal(moe.last_load, load) and moe.aux_loss is aux
    if balancer == "quantile":
        assert moe.pending_tokens == 14 and len(moe._pending_scores) == 1
    elif balancer == "aux_free":
        assert moe.pending_tokens == 14
        torch.testing.assert_close(moe._pending_load, load)


def test_aux_loss_trains_the_router(seed):
    moe = MoE(16, 8, 2, 16, balancer="aux_loss", aux_loss_coef=0.1).train()
    moe(torch.randn(2, 7, 16))
    assert moe.aux_loss is not None and moe.aux_loss.dim() == 0
    moe.aux_loss.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    assert moe.w_down.grad is None  # the loss depends on the router only
    moe.eval()
    moe(torch.randn(2, 7, 16))
    assert moe.aux_loss is None
    quantile = MoE(16, 8, 2, 16).train()
    quantile(torch.randn(2, 7, 16))
    assert quantile.aux_loss is None


def test_moe_quantile_balancer_balances_a_skewed_router(seed):
    """End to end through the module: a router skewed towards a few experts, 8 optimizer steps."""
    n, k, m = 16, 4, 16384
    moe = MoE(32, n, k, 8).train()
    with torch.no_grad():
        moe.router.weight.normal_(0.0, 32**-0.5)
        moe.router.weight[:, 0] = 0.0
        skew = 2.0 * torch.randn(n)
    vio = []
    for _ in range(9):
        x = torch.randn(1, m, 32)
        x[..., 0] = 1.0  # a constant feature: router column 0 carries the per-expert skew
        with torch.no_grad():
            moe.router.weight[:, 0] = skew
            moe(x)
        vio.append(max_violation(moe.last_load, k, m).item())
        update_balancers(moe)
    print(vio)
    assert vio[0] > 0.5 and min(vio[-3:]) < 0.08, vio


def _pooled_worker(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)  # same weights on every rank
    moe = MoE(16, 8, 2, 16).train()
    free = MoE(16, 8, 2, 16, balancer="aux_free", bias_update_rate=0.01).train()
    torch.manual_seed(100 + rank)
    xs = [torch.randn(1, 5 + 3 * rank, 16) for _ in range(2)]  # ranks see different token counts
    loads = []
    for x in xs:
        moe(x)
        free(x)
        loads.append(free.last_load)
    moe.update_balancer()
    free.update_balancer()
    torch.save({"bias": moe.expert_bias, "free": free.expert_bias, "xs": xs, "loads": loads}, f"{path}.{rank}")


def test_update_pools_all_ranks(tmp_path):
    """Two gloo ranks with different batches end with the same bias: the quantile of the pooled scores."""
    run_workers(_pooled_worker, 2, str(tmp_path / "out"), tmp_path=tmp_path)
    outs = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    torch.manual_seed(0)
    moe = MoE(16, 8, 2, 16)
    with torch.no_grad():
        scores = torch.cat([moe.router_scores(x.reshape(-1, 16)) for o in outs for x in o["xs"]])
    want = quantile_bias(scores, torch.zeros(8), 2)
    total = sum(sum(o["loads"]) for o in outs)
    for o in outs:
        torch.testing.assert_close(o["bias"], want)
        torch.testing.assert_close(o["free"], sign_bias_update(torch.zeros(8), total, 0.01))


def _local_sync_worker(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)  # same weights on every rank
    moe = MoE(16, 8, 2, 16, quantile_rate=0.5, sync_every=2).train()
    torch.manual_seed(100 + rank)
    xs, biases = [torch.randn(1, 20 + 7 * rank, 16) for _ in range(2)], []
    for x in xs:  # one micro-batch per step
        moe(x)
        moe.update_balancer()
        biases.append(moe.expert_bias.clone())
    torch.save({"xs": xs, "biases": biases}, f"{path}.{rank}")


def test_local_estimates_sync_every_n_steps(tmp_path):
    """sync_every=2 on two gloo ranks: step 1 moves each rank's bias by its own tokens' estimate, step 2 ends
    with the mean of the ranks' running estimates."""
    run_workers(_local_sync_worker, 2, str(tmp_path / "out"), tmp_path=tmp_path)
    outs = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    torch.manual_seed(0)
    moe = MoE(16, 8, 2, 16)
    running = []
    for o in outs:
        bias = torch.zeros(8)
        for step, x in enumerate(o["xs"]):
            with torch.no_grad():
                scores = moe.router_scores(x.reshape(-1, 16))
            bias = sliding_average(bias, quantile_bias(scores, bias, 2), 0.5)
            if step == 0:
                torch.testing.assert_close(o["biases"][0], bias)  # local: no communication
        running.append(bias)
    assert not torch.allclose(outs[0]["biases"][0], outs[1]["biases"][0])
    for o in outs:
        torch.testing.assert_close(o["biases"][1], (running[0] + running[1]) / 2)


def test_state_dict_without_running_quantile_buffers_loads():
    """A checkpoint from before ``capacity_threshold`` and ``balancer_step`` existed loads strictly, with the
    buffers at a fresh layer's values."""
    moe = MoE(8, 4, 2, 8)
    state = {k: v for k, v in moe.state_dict().items() if k not in ("capacity_threshold", "balancer_step")}
    other = MoE(8, 4, 2, 8)
    other.balancer_step.fill_(7)
    other.load_state_dict(state)
    assert other.balancer_step.item() == 0 and torch.equal(other.capacity_threshold, torch.zeros(4))
    torch.testing.assert_close(other.router.weight, moe.router.weight, rtol=0, atol=0)
