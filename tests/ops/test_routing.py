"""Routing and balancing functions: selection, gate weights, the pooled quantile, and balancing speed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3lit.ops import aux_loss, expert_load, max_violation, quantile_bias, route, sign_bias_update
from k3lit.ops.routing import (
    capacity_route,
    capacity_threshold_from_histogram,
    causal_capacity_route,
    chooser_score_histogram,
    expert_counts,
    first_overflow,
    quantile_bias_from_histogram,
    required_bias_histogram,
    sliding_average,
)


def _scores(m: int, n: int, skew: torch.Tensor | None = None) -> torch.Tensor:
    logits = torch.randn(m, n)
    return torch.sigmoid(logits if skew is None else logits + skew)


def test_route_weights_normalised_and_bias_selects_only(seed):
    m, n, k = 257, 12, 3
    scores = _scores(m, n).requires_grad_(True)
    bias = torch.randn(n) * 0.5
    idx, w = route(scores, bias, k)
    assert idx.dtype == torch.int64 and idx.shape == (m, k) and w.shape == (m, k)
    # selection: the top-k of s + b (as a set per token)
    expect = (scores.detach() + bias).topk(k, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, expect.sort(-1).values)
    # weights: from s alone, normalised over the selected experts
    s_sel = scores.detach().gather(1, idx)
    torch.testing.assert_close(w.detach(), s_sel / s_sel.sum(-1, keepdim=True))
    torch.testing.assert_close(w.sum(-1).detach(), torch.ones(m))
    # the bias changes which experts are chosen, but not the weight formula: with a huge bias on expert 0
    # every token picks it, and its weight is s_i0 / (sum of the selected s), not anything involving b
    big = torch.zeros(n)
    big[0] = 10.0
    idx0, w0 = route(scores, big, k)
    assert (idx0 == 0).any(-1).all()
    s0 = scores.detach().gather(1, idx0)
    torch.testing.assert_close(w0.detach(), s0 / s0.sum(-1, keepdim=True))
    assert not torch.equal(idx0.sort(-1).values, idx.sort(-1).values)
    # differentiable with respect to the scores only
    (w * torch.randn(m, k)).sum().backward()
    assert scores.grad is not None and scores.grad.abs().sum() > 0


@pytest.mark.parametrize("m,n,k", [(1000, 7, 3), (1024, 8, 2), (333, 64, 5), (50, 16, 15)])
def test_quantile_bias_is_the_hazen_pooled_quantile(seed, m, n, k):
    """Against numpy's Hazen quantile, and the load it gives with alpha held fixed: round(m k / n)."""
    scores = _scores(m, n, torch.randn(n))
    bias = torch.randn(n) * 0.1
    s64, b64 = scores.double().numpy(), bias.double().numpy()
    alpha = -np.sort(-(s64 + b64), axis=1)[:, k]  # (k+1)-th largest
    ref = -np.quantile(s64 - alpha[:, None], 1 - k / n, axis=0, method="hazen")
    raw = quantile_bias(scores, bias, k, center=False)
    assert raw.dtype == torch.float32 and raw.shape == (n,)
    np.testing.assert_allclose(raw.numpy(), ref, atol=2e-6)
    centred = quantile_bias(scores, bias, k)
    np.testing.assert_allclose(centred.numpy(), ref - ref.mean(), atol=2e-6)
    # with alpha held fixed, each expert is picked by the integer count nearest to q = m k / n (q is not an
    # integer in most cases): #{r < b'} <= round(q) <= #{r <= b'} for the required biases r = alpha - s.
    # The "<=" side matters: every token for which expert j is the (k+1)-th choice has r_ij = b_j (the old
    # bias) up to rounding, a mass point the quantile may land on (then the bias stays where it is).
    target = int(np.floor(m * k / n + 0.5))
    required = torch.from_numpy(alpha[:, None] - s64)
    below = (required < raw.double() - 1e-6).sum(0)
    at_or_below = (required <= raw.double() + 1e-6).sum(0)
    assert torch.all(below <= target) and torch.all(at_or_below >= target), (target, below, at_or_below)
    # away from the mass points the count is exact
    exact = at_or_below == below
    assert torch.all(((scores.double() + raw.double()) > torch.from_numpy(alpha)[:, None]).sum(0)[exact] == target)


def test_quantile_bias_rejects_k_without_a_cutoff():
    with pytest.raises(ValueError, match="k must satisfy"):
        quantile_bias(torch.rand(10, 4), torch.zeros(4), 4)
    with pytest.raises(ValueError, match="bias must be"):
        quantile_bias(torch.rand(10, 4), torch.zeros(5), 2)


def _simulate(balancer: str, m: int, n: int, k: int, updates: int, skew: torch.Tensor) -> list[float]:
    """MaxVio of batch t (fresh tokens) routed with the bias from batches < t; update after each batch."""
    bias = torch.zeros(n)
    vio = []
    for _ in range(updates + 1):
        scores = _scores(m, n, skew)
        idx, _ = route(scores, bias, k)
        load = expert_load(idx, n)
        vio.append(max_violation(load, k, m).item())
        if balancer == "quantile":
            bias = quantile_bias(scores, bias, k)
        elif balancer == "sign":
            bias = sign_bias_update(bias, load, 1e-3)
    return vio


@pytest.mark.parametrize("m,n,k", [(32768, 16, 4), (32768, 32, 8), (16384, 16, 8)])
def test_quantile_balancing_beats_sign_and_none(seed, m, n, k):
    # strongly skewed router: per-expert offsets of std 2 on the logits (MaxVio starts at 2 .. n/k - 1).
    # m is large enough that the sampling noise of a fresh batch (std sqrt(m p (1-p)) per expert) stays
    # well below the 0.05 bar.
    skew = 2.0 * torch.randn(n)
    quantile = _simulate("quantile", m, n, k, 10, skew)
    sign = _simulate("sign", m, n, k, 10, skew)
    none = _simulate("none", m, n, k, 10, skew)
    print(f"quantile {np.round(quantile, 3)}\nsign {np.round(sign, 3)}\nnone {np.round(none, 3)}")
    assert quantile[0] > 0.5  # the test starts skewed
    first = next(t for t, v in enumerate(quantile + [0.0]) if v < 0.05)
    assert first <= 10, f"quantile balancing needed more than 10 updates: {quantile}"
    assert max(quantile[first:]) < 0.1, f"quantile balancing did not stay balanced: {quantile}"
    assert min(none) > 0.5
    assert min(sign) > 0.5  # u = 1e-3 moves the bias 0.01 in 10 steps: far from balanced


def test_sign_bias_update_rule():
    bias = torch.tensor([0.0, 0.5, -0.25, 1.0])
    load = torch.tensor([10.0, 2.0, 6.0, 6.0])  # mean 6
    new = sign_bias_update(bias, load, 0.1)
    torch.testing.assert_close(new, torch.tensor([-0.1, 0.6, -0.25, 1.0]))
    assert new.dtype == torch.float32


def test_aux_loss_values_and_gradient(seed):
    n, k = 4, 1
    # uniform: f = P = 1/n -> loss 1
    scores = torch.full((8, n), 0.5)
    idx = torch.arange(8).remainder(n)[:, None]
    torch.testing.assert_close(aux_loss(scores, idx, n, k), torch.tensor(1.0))
    # all tokens on expert 0 with probability mass 0.7 there: n * 1 * 0.7 = 2.8
    scores = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(5, 1)
    idx = torch.zeros(5, 1, dtype=torch.int64)
    torch.testing.assert_close(aux_loss(scores, idx, n, k), torch.tensor(2.8))
    # gradient reaches the router logits
    logits = torch.randn(64, 8, requires_grad=True)
    s = torch.sigmoid(logits)
    idx, _ = route(s, torch.zeros(8), 2)
    aux_loss(s, idx, 8, 2).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_expert_load_and_max_violation():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    load = expert_load(idx, 5)
    torch.testing.assert_close(load, torch.tensor([4.0, 2.0, 1.0, 1.0, 0.0]))
    # mean = m k / n = 4 * 2 / 5 = 1.6 -> (4 - 1.6) / 1.6 = 1.5
    torch.testing.assert_close(max_violation(load, 2, 4), torch.tensor(1.5))
    loads = torch.stack([load, torch.full((5,), 1.6)])
    torch.testing.assert_close(max_violation(loads, 2, 4), torch.tensor([1.5, 0.0]))


def test_expert_counts_match_numpy_bincount(seed):
    idx = torch.randint(0, 37, (513, 3))
    want = np.bincount(idx.numpy().ravel(), minlength=40)
    got = expert_counts(idx, 40)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert expert_counts(idx[:0], 5).tolist() == [0] * 5


def _hazen_bias64(s: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """float64 reference of the centred one-step quantile bias (numpy's Hazen quantile)."""
    n = s.shape[1]
    alpha = -np.sort(-(s + b), axis=1)[:, k]
    ref = -np.quantile(s - alpha[:, None], 1 - k / n, axis=0, method="hazen")
    return ref - ref.mean()


@pytest.mark.parametrize("rate", [1.0, 0.3, 0.05])
def test_sliding_average_quantile_follows_the_float64_recursion(seed, rate):
    """b_{t+1} = b_t + rate (Q_t(b_t) - b_t) over a run of fresh batches, against the same recursion in float64."""
    m, n, k = 4096, 16, 2
    skew = torch.randn(n)
    bias, ref = torch.zeros(n), np.zeros(n)
    for _ in range(8):
        scores = _scores(m, n, skew)
        bias = sliding_average(bias, quantile_bias(scores, bias, k), rate)
        ref = ref + rate * (_hazen_bias64(scores.double().numpy(), ref, k) - ref)
        assert bias.dtype == torch.float32
        np.testing.assert_allclose(bias.numpy(), ref, atol=1e-5)
    assert abs(float(bias.sum())) < 1e-5  # the average of centred biases stays centred


def test_sliding_average_rate_one_is_the_estimate_and_rate_is_checked():
    running, estimate = torch.randn(8), torch.randn(8)
    assert torch.equal(sliding_average(running, estimate, 1.0), estimate)
    torch.testing.assert_close(sliding_average(running, estimate, 0.25), 0.75 * running + 0.25 * estimate)
    for rate in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="rate must lie"):
            sliding_average(running, estimate, rate)
    with pytest.raises(ValueError, match="estimate must have"):
        sliding_average(running, torch.zeros(9), 0.5)


@pytest.mark.parametrize("rate", [1.0, 0.1])
def test_sliding_average_of_the_histogram_estimate_within_a_bin(seed, rate):
    """The histogram estimator inside the running average: within rate x (one bin, plus one for the centring)."""
    m, n, k, bins = 8192, 16, 2, 1000
    bias = torch.randn(n) * 0.2
    bias -= bias.mean()
    scores = _scores(m, n, torch.randn(n))
    lo, hi = bias.min() - 1, bias.max() + 1
    est = quantile_bias_from_histogram(required_bias_histogram(scores, bias, k, lo, hi, bins), lo, hi, k)
    got = sliding_average(bias, est, rate)
    b64 = bias.double().numpy()
    ref = b64 + rate * (_hazen_bias64(scores.double().numpy(), b64, k) - b64)
    width = float(hi - lo) / bins
    assert np.abs(got.double().numpy() - ref).max() <= rate * 2 * width + 1e-6


def _choosers64(scores: torch.Tensor, bias: torch.Tensor, k: int) -> list[np.ndarray]:
    """Per expert, the float64 scores of its choosers: tokens whose top k of the float32 key ``s + b`` holds it, the
    key as the routing ops form it. Sigmoid scores repeat in float32, so two experts' keys can tie exactly at the
    k-th place: the choice there is torch.topk's, as in the ops (a stable sort would take the lower index)."""
    s = scores.double().numpy()
    top = (scores.float() + bias.float()).topk(k, dim=-1).indices.numpy()
    return [s[(top == j).any(axis=1), j] for j in range(s.shape[1])]


@pytest.mark.parametrize("cf", [0.5, 1.0, 1.25])
def test_capacity_threshold_brackets_the_exact_count(seed, cf):
    """At most ``c`` choosers of each expert score above ``threshold + 1/B``, more than ``c`` above
    ``threshold - 1/B`` (float64 counts); 0 for an expert with at most ``c`` choosers."""
    m, n, k, bins = 5000, 12, 3, 1000
    scores = _scores(m, n, torch.randn(n))
    bias = torch.randn(n) * 0.1
    counts = chooser_score_histogram(scores, bias, k, bins)
    assert counts.dtype == torch.int64 and counts.shape == (n, bins)
    choosers = _choosers64(scores, bias, k)
    assert counts.sum(1).tolist() == [len(c) for c in choosers]
    cap = cf * m * k / n
    theta = capacity_threshold_from_histogram(counts, cap)
    assert theta.dtype == torch.float32 and theta.shape == (n,)
    limited = 0
    for j, c in enumerate(choosers):
        t = float(theta[j])
        if len(c) <= cap:
            assert t == 0.0, (j, len(c), cap)
            continue
        limited += 1
        assert (c >= t + 1 / bins).sum() <= cap < (c >= t - 1 / bins).sum(), (j, t)
    assert limited > 0  # the skew overloads some experts at every cf tested


def _threshold_route_loop(scores: torch.Tensor, bias: torch.Tensor, k: int, theta: torch.Tensor):
    """Per-token reference: the first k candidates of s + b whose score reaches the expert's threshold (candidates
    ranked by the float32 key as the op ranks them, so exact float32 ties fall the same way)."""
    s, th = scores.double().numpy(), theta.double().numpy()
    key = scores.float() + bias.float()
    ranked, top = key.argsort(dim=-1, descending=True).numpy(), key.topk(k, dim=-1).indices.numpy()
    m = s.shape[0]
    idx = np.full((m, k), -1)
    rerouted = dropped = 0
    for i in range(m):
        ok = [j for j in ranked[i] if s[i, j] >= th[j]][:k]
        idx[i, : len(ok)] = ok
        rerouted += sum(j not in top[i] for j in ok)
        dropped += k - len(ok)
    return idx, rerouted, dropped


def test_capacity_route_with_min_score_is_per_token_and_causal(seed):
    m, n, k = 600, 8, 2
    scores = _scores(m, n, torch.randn(n))
    bias = torch.randn(n) * 0.01
    theta = 0.4 + 0.5 * torch.rand(n)  # high enough that some tokens find fewer than k admitting experts
    theta[0] = 0.0  # expert 0 admits everyone
    # whatever the draw, one token with a re-routed slot and one with a dropped slot: the first admits only
    # expert 0, below its first two candidates (experts 1 and 2, rejected); the second admits only expert 0
    scores[-2] = 0.05
    scores[-2, 1:3] = 0.35
    scores[-1] = 0.05
    scores.requires_grad_(True)
    idx, w, rerouted, dropped = capacity_route(scores, bias, k, min_score=theta)
    ref, ref_rerouted, ref_dropped = _threshold_route_loop(scores.detach(), bias, k, theta)
    np.testing.assert_array_equal(np.sort(idx.numpy(), axis=1), np.sort(ref, axis=1))
    assert (int(rerouted), int(dropped)) == (ref_rerouted, ref_dropped) and ref_rerouted > 0 and ref_dropped > 0
    kept = idx >= 0
    s_sel = scores.detach().gather(1, idx.clamp(min=0)) * kept
    torch.testing.assert_close(w.detach(), s_sel / s_sel.sum(-1, keepdim=True).clamp_min(1e-30))
    (w * torch.randn(m, k)).sum().backward()
    assert scores.grad.abs().sum() > 0
    # causality: new scores for the later tokens leave the earlier tokens' routing as it was
    cut = m // 2
    later = scores.detach().clone()
    later[cut:] = _scores(m - cut, n, 3.0 * torch.randn(n))
    idx2 = capacity_route(later, bias, k, min_score=theta)[0]
    assert torch.equal(idx2[:cut], idx[:cut])
    # the count limit per call is not causal: the same change moves some earlier tokens
    fixed = capacity_route(scores.detach(), bias, k, 1.0)[0]
    fixed2 = capacity_route(later, bias, k, 1.0)[0]
    assert not torch.equal(fixed2[:cut], fixed[:cut])


def _causal_capacity_loop(scores: torch.Tensor, bias: torch.Tensor, k: int, cap: int, seq_len: int) -> np.ndarray:
    """Token by token, position-major: each token takes its first k experts of s + b that hold fewer than cap."""
    m, n = scores.shape
    count = [0] * n
    idx = np.full((m, k), -1)
    for t in range(seq_len):
        for b in range(m // seq_len):
            i = b * seq_len + t
            open_ = [j for j in (scores[i] + bias).argsort(descending=True).tolist() if count[j] < cap][:k]
            for slot, j in enumerate(open_):
                idx[i, slot] = j
                count[j] += 1
    return idx


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("B,T,n,k,cf", [(3, 60, 8, 2, 1.0), (3, 60, 8, 2, 1.25), (4, 33, 5, 3, 1.0),
                                        (2, 150, 16, 2, 1.1), (4, 300, 16, 2, 1.05), (1, 9, 4, 4, 0.5)])
def test_causal_capacity_route_is_the_token_by_token_admission(seed, backend, B, T, n, k, cf):
    """Both backends against the token-by-token loop, in float64: the experts (in the order of s + b), the counts,
    the weights and their gradient. The Triton kernel (under the interpreter on CPU) walks blocks of 256 tokens:
    m = 300 spans two, m = 1,200 five, m = 9 (every expert full after 9 tokens at cf 0.5, so slots drop) part of
    one; 5 experts pad to 16 columns."""
    m = B * T
    scores = _scores(m, n, 2.0 * torch.randn(n)).double().requires_grad_(True)  # skewed: some experts fill up
    bias = torch.randn(n, dtype=torch.float64) * 0.01
    idx, w, rerouted, dropped = causal_capacity_route(scores, bias, k, cf, T, backend=backend)
    cap = int(np.ceil(cf * m * k / n))
    ref = _causal_capacity_loop(scores.detach(), bias, k, cap, T)
    np.testing.assert_array_equal(idx.numpy(), ref)
    assert int(expert_counts(idx[idx >= 0], n).max()) <= cap
    top = (scores.detach() + bias).topk(k, dim=-1).indices
    want_rerouted = sum(int(j) not in top[i].tolist() for i in range(m) for j in idx[i] if j >= 0)
    assert (int(rerouted), int(dropped)) == (want_rerouted, int((idx < 0).sum()))
    assert want_rerouted > 0 if k < n else int(dropped) > 0  # with k = n no slot can move, only drop
    kept = idx >= 0
    s_sel = scores.detach().gather(1, idx.clamp(min=0)) * kept
    torch.testing.assert_close(w.detach(), s_sel / s_sel.sum(-1, keepdim=True).clamp_min(1e-300))
    (w * torch.randn(m, k, dtype=torch.float64)).sum().backward()
    assert scores.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("B", [1, 5])
def test_causal_capacity_route_of_a_decoding_step(seed, backend, B):
    """One new token per sequence (T = 1), as `k3lit generate` routes after the prompt, at `small`'s 16 experts,
    top-2 and cf 1.1: the capacity is ceil(1.1 B 2 / 16) = 1 token an expert. One sequence keeps its plain top 2;
    five share the experts in sequence order, as the token-by-token loop admits them."""
    n, k, cf = 16, 2, 1.1
    scores = _scores(B, n, 2.0 * torch.randn(n)).double()
    bias = torch.randn(n, dtype=torch.float64) * 0.01
    idx, _, rerouted, dropped = causal_capacity_route(scores, bias, k, cf, 1, backend=backend)
    np.testing.assert_array_equal(idx.numpy(), _causal_capacity_loop(scores, bias, k, 1, 1))
    assert int(dropped) == 0
    if B == 1:
        assert int(rerouted) == 0 and set(idx[0].tolist()) == set((scores + bias).topk(k).indices[0].tolist())


class _OpNames(TorchDispatchMode):
    """The names of the operators a call dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("B,capacity_work", [(1, False), (2, True)])
def test_causal_capacity_route_skips_a_count_that_cannot_bind(seed, B, capacity_work):
    """With the capacity at m tokens (one sequence's decoding step: ceil(1.1 · 1 · 2 / 16) = 1) no expert can
    overflow, so no capacity round runs; two tokens can share an expert whose capacity is 1, so they run."""
    n, k = 16, 2
    scores, bias = _scores(B, n), torch.zeros(n)
    with _OpNames() as ops:
        idx = causal_capacity_route(scores, bias, k, 1.1, 1, backend="torch")[0]
    assert ("k3lit.first_overflow" in ops.names) == capacity_work
    np.testing.assert_array_equal(idx.numpy(), _causal_capacity_loop(scores, bias, k, 1, 1))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_causal_capacity_route_closes_an_expert_that_fills_at_a_block_boundary(backend):
    """One sequence of 1,024 tokens, top-1, cf 2 (512 tokens an expert): the first 768 tokens prefer expert 0, then
    expert 1; the rest prefer expert 2. Expert 0 fills with token 511, the last of the kernel's second block of 256,
    so the blocks before it are final as the parallel pass chose them and the third block is admitted token by
    token: tokens 512-767 move to expert 1."""
    m, n = 1024, 4
    scores = torch.full((m, n), 0.1)
    scores[:768, 0], scores[:768, 1], scores[768:, 2] = 0.9, 0.5, 0.9
    idx, _, rerouted, dropped = causal_capacity_route(scores, torch.zeros(n), 1, 2.0, m, backend=backend)
    want = torch.cat([torch.zeros(512), torch.ones(256), torch.full((256,), 2)]).long()[:, None]
    assert torch.equal(idx, want) and (int(rerouted), int(dropped)) == (256, 0)


def test_causal_capacity_kernel_compiles_into_one_graph(seed):
    """The Triton route is one opaque op to ``torch.compile`` (no graph break) and routes as it does eagerly."""
    B, T, n, k = 2, 40, 8, 2
    scores = _scores(B * T, n, 2.0 * torch.randn(n))
    bias = torch.zeros(n)
    eager = causal_capacity_route(scores, bias, k, 1.1, T, backend="triton")
    fn = torch.compile(lambda s, b: causal_capacity_route(s, b, k, 1.1, T, backend="triton"), fullgraph=True,
                       backend="aot_eager")
    got = fn(scores, bias)
    assert torch.equal(got[0], eager[0]) and int(got[2]) == int(eager[2]) > 0
    torch.testing.assert_close(got[1], eager[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_causal_capacity_route_ignores_later_positions(seed, backend):
    """New scores at positions >= 30 of one sequence leave every token before position 30 (of every sequence)
    routed as it was; the count limit of :func:`capacity_route` over the same tokens does not."""
    B, T, n, k = 4, 64, 8, 2
    scores = _scores(B * T, n, 2.0 * torch.randn(n))
    bias = torch.zeros(n)
    later = scores.clone().view(B, T, n)
    later[1, 30:] = _scores(T - 30, n, 3.0 * torch.randn(n))
    later = later.view(B * T, n)
    idx = causal_capacity_route(scores, bias, k, 1.0, T, backend=backend)[0].view(B, T, k)
    idx2 = causal_capacity_route(later, bias, k, 1.0, T, backend=backend)[0].view(B, T, k)
    assert torch.equal(idx2[:, :30], idx[:, :30]) and not torch.equal(idx2[:, 30:], idx[:, 30:])
    fixed = capacity_route(scores, bias, k, 1.0)[0].view(B, T, k)
    fixed2 = capacity_route(later, bias, k, 1.0)[0].view(B, T, k)
    assert not torch.equal(fixed2[:, :30], fixed[:, :30])


def test_first_overflow_is_the_row_that_passes_the_count():
    """Per column, the first row at which the running count of ones exceeds cap (a token-by-token count as the
    reference); m for a column that never does. Compiled to one graph without a break, as the route uses it."""
    torch.manual_seed(0)
    m, n, cap = 300, 6, 40
    taken = (torch.rand(m, n) < torch.tensor([0.05, 0.1, 0.14, 0.3, 0.9, 0.0])).int()
    want = []
    for j in range(n):
        count, row = 0, m
        for r in range(m):
            count += int(taken[r, j])
            if count > cap:
                row = r
                break
        want.append(row)
    assert want[0] == want[-1] == m and min(want) < m  # columns that never pass, and some that do
    got = first_overflow(taken, cap)
    assert got.dtype == torch.int64 and got.tolist() == want
    compiled = torch.compile(lambda t: first_overflow(t, cap) + 0, fullgraph=True, backend="aot_eager")
    assert compiled(taken).tolist() == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_causal_capacity_route_compiles_with_inductor_at_the_small_recipe_shape(backend):
    """inductor on CUDA at the ``small`` recipe's MoE shape (m = 16 x 2048 tokens, 16 experts, top-2, cf 1.1): the
    same routing as eager, the kernel the same as the torch rounds (inductor 2.11 failed to generate the running
    count's kernel before ``first_overflow``), and neither synchronises the host."""
    torch.manual_seed(0)
    scores = _scores(16 * 2048, 16, 2.0 * torch.randn(16)).cuda()
    bias = torch.zeros(16, device="cuda")
    eager = causal_capacity_route(scores, bias, 2, 1.1, 2048, backend=backend)
    compiled = torch.compile(causal_capacity_route, fullgraph=True)(scores, bias, 2, 1.1, 2048, backend=backend)
    assert torch.equal(compiled[0], eager[0]) and int(compiled[2]) == int(eager[2]) > 0
    rounds = causal_capacity_route(scores, bias, 2, 1.1, 2048, backend="torch")
    assert torch.equal(eager[0], rounds[0]) and (int(eager[2]), int(eager[3])) == (int(rounds[2]), int(rounds[3]))
    torch.cuda.set_sync_debug_mode("error")  # a call after the first: any host synchronisation raises
    try:
        causal_capacity_route(scores, bias, 2, 1.1, 2048, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_causal_capacity_route_rejects_partial_sequences():
    with pytest.raises(ValueError, match="not whole sequences of seq_len=4"):
        causal_capacity_route(torch.rand(10, 4), torch.zeros(4), 2, 1.0, 4)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        causal_capacity_route(torch.rand(8, 4), torch.zeros(4), 2, 0.0, 4)
    with pytest.raises(ValueError, match="backend must be"):
        causal_capacity_route(torch.rand(8, 4), torch.zeros(4), 2, 1.0, 4, backend="cuda")
    with pytest.raises(ValueError, match="capacity_factor must be > 0 and finite"):
        causal_capacity_route(torch.rand(8, 4), torch.zeros(4), 2, float("inf"), 4)
    with pytest.raises(ValueError, match="scores must be a floating"):
        causal_capacity_route(torch.ones(8, 4, dtype=torch.int64), torch.zeros(4), 2, 1.0, 4)


def test_capacity_route_needs_a_limit():
    with pytest.raises(ValueError, match="needs a capacity_factor"):
        capacity_route(torch.rand(5, 4), torch.zeros(4), 2)
    with pytest.raises(ValueError, match="min_score must be"):
        capacity_route(torch.rand(5, 4), torch.zeros(4), 2, min_score=torch.zeros(3))


def test_causal_capacity_kernel_takes_no_expert_with_a_non_finite_score():
    """A NaN or -inf score is an expert the token never takes, and the slots left without one count as dropped, in
    the blocks the kernel admits token by token and in the ones it keeps from its parallel pass (-inf: as the torch
    rounds do)."""
    torch.manual_seed(0)
    m, n, k = 600, 4, 4
    scores = torch.rand(m, n)
    scores[3, 1] = scores[400, 2] = float("-inf")  # block 0 fits as chosen; block 1 overflows (cf 0.8)
    idx, _, _, dropped = causal_capacity_route(scores, torch.zeros(n), k, 0.8, m, backend="triton")
    ref = causal_capacity_route(scores, torch.zeros(n), k, 0.8, m, backend="torch")
    assert torch.equal(idx, ref[0]) and int(dropped) == int(ref[3]) == int((idx < 0).sum()) > 2
    scores[5, 0] = float("nan")
    idx = causal_capacity_route(scores, torch.zeros(n), k, 0.8, m, backend="triton")[0]
    assert 0 not in idx[5].tolist() and idx[5].tolist().count(-1) == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_causal_capacity_route_of_no_tokens(backend):
    idx, w, rerouted, dropped = causal_capacity_route(torch.rand(0, 4), torch.zeros(4), 2, 1.0, 8, backend=backend)
    assert idx.shape == w.shape == (0, 2) and int(rerouted) == int(dropped) == 0
