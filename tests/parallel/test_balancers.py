"""Distributed Quantile Balancing: the histogram estimator against the exact pooled quantile, and the pooled
quantile (not an average of per-rank quantiles) on real gloo processes."""

from __future__ import annotations

import math

import torch

from k3lit.nn.moe import HIST_BINS, MoE
from k3lit.ops.routing import quantile_bias, quantile_bias_from_histogram, required_bias_histogram
from tests.parallel._dist import run_workers


def test_histogram_within_one_bin_of_exact_quantile(seed):
    m, n, k = 3000, 32, 4
    offsets = torch.randn(n) * 0.7
    scores = torch.sigmoid(offsets + torch.randn(m, n))
    bias = torch.randn(n) * 0.3
    lo, hi = bias.min() - 1, bias.max() + 1
    width = ((hi - lo) / HIST_BINS).item()
    # micro-batches add up: three histograms summed == the histogram of the whole step
    parts = [required_bias_histogram(s, bias, k, lo, hi, HIST_BINS) for s in scores.split([1000, 1500, 500])]
    counts = sum(parts)
    assert torch.equal(counts, required_bias_histogram(scores, bias, k, lo, hi, HIST_BINS))
    assert counts.dtype == torch.int64 and (counts.sum(1) == m).all()
    exact = quantile_bias(scores, bias, k, center=False)
    est = quantile_bias_from_histogram(counts, lo, hi, k, center=False)
    assert (est - exact).abs().max() <= width, ((est - exact).abs().max(), width)
    centred = quantile_bias_from_histogram(counts, lo, hi, k)
    assert abs(centred.mean().item()) < 1e-6
    assert (centred - quantile_bias(scores, bias, k)).abs().max() <= 2 * width  # mean of errors < 1 bin too
    # and it is not trivially close: the bias moves by many bins
    assert (exact - exact.mean()).abs().max() > 20 * width


def _scores_of(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.reshape(-1, 4).double()).float()


def _pooled_worker(rank: int, world: int, path: str) -> None:
    # router = identity on 4 dims, so the scores are sigmoid(x): construct per-rank score distributions
    gen = torch.Generator().manual_seed(10 + rank)
    shift = torch.tensor([2.0, 0.0, -1.0, 0.5]) if rank == 0 else torch.tensor([-2.0, 1.5, 0.0, -0.5])
    xs = [shift + torch.randn(1, 30 * (2 - rank), 4, generator=gen) * (1 + 2 * rank) for _ in range(2)]
    out = {"xs": xs}
    for bal in ("quantile", "quantile_hist"):
        moe = MoE(4, 4, 1, 4, balancer=bal).train()
        with torch.no_grad():
            moe.router.weight.copy_(torch.eye(4))
        for x in xs:  # two micro-batches of one optimizer step
            moe(x)
        moe.update_balancer()
        out[bal] = moe.expert_bias.clone()
    torch.save(out, f"{path}.{rank}")


def test_pooled_quantile_not_average_of_rank_quantiles(tmp_path):
    run_workers(_pooled_worker, 2, str(tmp_path / "out"), tmp_path=tmp_path)
    outs = [torch.load(tmp_path / f"out.{r}") for r in range(2)]
    zero = torch.zeros(4)
    per_rank = [quantile_bias(torch.cat([_scores_of(x) for x in o["xs"]]), zero, 1) for o in outs]
    pooled = quantile_bias(torch.cat([_scores_of(x) for o in outs for x in o["xs"]]), zero, 1)
    averaged = torch.stack(per_rank).mean(0)
    width = 2.0 / HIST_BINS
    assert (averaged - pooled).abs().max() > 20 * width, (averaged, pooled)  # the constructed case differs
    for o in outs:  # every rank holds the same pooled bias, by either estimator
        torch.testing.assert_close(o["quantile"], pooled)
        assert (o["quantile_hist"] - pooled).abs().max() <= 2 * width, (o["quantile_hist"], pooled)
    assert torch.equal(outs[0]["quantile_hist"], outs[1]["quantile_hist"])


def test_capacity_route_reroutes_then_drops():
    from k3lit.ops.routing import capacity_route

    # every token ranks expert 0 > 1 > 2; m = 5, k = 1
    scores = torch.tensor([[0.9, 0.5, 0.1]]).repeat(5, 1).requires_grad_()
    idx, w, rerouted, dropped = capacity_route(scores, torch.zeros(3), 1, 1.0)  # c = ceil(5/3) = 2
    assert idx[:, 0].tolist() == [0, 0, 1, 1, 2] and (rerouted.item(), dropped.item()) == (3, 0)
    idx, w, rerouted, dropped = capacity_route(scores, torch.zeros(3), 1, 0.5)  # c = 1
    assert idx[:, 0].tolist() == [0, 1, 2, -1, -1] and (rerouted.item(), dropped.item()) == (2, 2)
    assert w[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    w.sum().backward()  # differentiable, no NaN from the all-dropped tokens
    assert torch.isfinite(scores.grad).all()


def test_capacity_route_never_exceeds_capacity(seed):
    from k3lit.ops.routing import capacity_route, expert_load

    m, n, k = 500, 16, 3
    scores = torch.sigmoid(torch.randn(n) * 2 + torch.randn(m, n))
    for cf in (0.5, 1.0, 1.25):
        idx, w, rerouted, dropped = capacity_route(scores, torch.zeros(n), k, cf)
        cap = math.ceil(cf * m * k / n)
        load = expert_load(idx, n)
        assert load.max() <= cap and load.sum() + dropped == m * k
        kept = idx >= 0
        assert all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in idx)  # distinct experts per token
        torch.testing.assert_close(w.sum(1)[kept.any(1)], torch.ones(int(kept.any(1).sum())))
    assert rerouted > 0  # cf = 1.25 still re-routes the skewed router's overflow
