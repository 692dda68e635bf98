"""MoE routing and load balancing as pure functions (no state, no ``nn.Module``).

Notation (docs/MATH.md §2): ``m`` tokens, ``n`` experts, ``k`` experts per token, router scores
``s = sigmoid(W_r x) ∈ (0, 1)^{m×n}``, a float32 expert bias ``b ∈ R^n`` that steers *selection only*,
and the target load ``q = m k / n`` tokens per expert.

Balancers:

* :func:`quantile_bias` -- Quantile Balancing (Kimi K3): one exact coordinate step on the dual of the
  balanced-assignment LP, computed from the pooled scores of one optimizer step.
* :func:`sign_bias_update` -- the loss-free sign rule (DeepSeek-V3): ``b_j += u · sign(mean_load - load_j)``.
* :func:`aux_loss` -- the Switch/GShard auxiliary loss ``n · Σ_j f_j P_j`` (the caller applies its
  coefficient).

* :func:`required_bias_histogram` + :func:`quantile_bias_from_histogram` -- the distributed estimate of
  :func:`quantile_bias`: integer histogram counts that add up over micro-batches and ranks (one all-reduce).
* :func:`capacity_route` -- top-k routing with a per-expert capacity; overflow re-routed or dropped.

Metrics: :func:`expert_load`, :func:`max_violation` (``MaxVio``) and :func:`router_entropy`.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "expert_counts",
    "route",
    "capacity_route",
    "quantile_bias",
    "required_bias_histogram",
    "quantile_bias_from_histogram",
    "sign_bias_update",
    "aux_loss",
    "expert_load",
    "max_violation",
    "router_entropy",
]


def _check_scores_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, k_max: int) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [m, n], got shape {tuple(scores.shape)}")
    n = scores.shape[1]
    if bias.shape != (n,):
        raise ValueError(f"bias must be [n] = [{n}], got shape {tuple(bias.shape)}")
    if not 1 <= k <= k_max:
        raise ValueError(f"k must satisfy 1 <= k <= {k_max} for n = {n} experts, got k = {k}")


def route(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert selection with a selection-only bias, and normalised gate weights.

    ``T_i = top-k_j(s_ij + b_j)``,  ``p_ij = s_ij / Σ_{r ∈ T_i} s_ir`` for ``j ∈ T_i``.

    Args:
        scores: ``[m, n]`` router scores in ``(0, 1)`` (float32, or float64 in tests); may require grad.
        bias: ``[n]`` float32 expert bias; used for the selection only, never for the weights.
        k: experts per token, ``1 <= k <= n``.

    Returns:
        ``(expert_idx [m, k] int64, weights [m, k])``; weights have the dtype of ``scores``, sum to one
        per token and are differentiable with respect to ``scores`` (the selection is not).
    """
    _check_scores_bias(scores, bias, k, scores.shape[1])
    with torch.no_grad():
        expert_idx = (scores.detach() + bias.to(scores.dtype)).topk(k, dim=-1).indices
    chosen = scores.gather(1, expert_idx)
    return expert_idx, chosen / chosen.sum(dim=-1, keepdim=True)


def quantile_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, *, center: bool = True) -> torch.Tensor:
    """Quantile Balancing: the exact pooled-quantile bias for the next optimizer step (docs/MATH.md §2).

    1. ``alpha_i`` = the (k+1)-th largest value of ``s_i + b`` (the token's cut-off).
    2. ``b'_j = -quantile_{1-k/n}(s_{:,j} - alpha) = quantile_{k/n}(r_{:,j})`` with the *required bias*
       ``r_ij = alpha_i - s_ij`` (token i picks expert j iff ``s_ij + b'_j > alpha_i`` iff ``r_ij < b'_j``).
    3. ``b' <- b' - mean(b')`` (selection is invariant to a common shift).

    Quantile definition. ``quantile_p`` is the Hazen (Hyndman-Fan type 5) sample quantile: over the sorted
    column ``r_(0) <= ... <= r_(m-1)`` it interpolates linearly at the 0-based position ``m p - 1/2``,
    clamped to ``[0, m - 1]``. With ``p = k/n`` the position is ``q - 1/2``, so (for distinct values and with
    ``alpha`` held fixed) exactly ``round(q)`` tokens satisfy ``r_ij < b'_j``: every expert is given the
    integer load nearest to ``q = m k / n``, also when ``q`` is not an integer, and the bias sits halfway
    between two tokens' required biases instead of on one (no ties at the boundary). Hazen is symmetric,
    ``Q_{1-p}(-r) = -Q_p(r)``, so the two forms of step 2 agree exactly (``numpy.quantile(...,
    method="hazen")`` computes the same number).

    ``scores`` must hold *all* tokens of the optimizer step (all micro-batches, all ranks): this is the
    pooled quantile, not an average of per-batch quantiles. The new bias is meant for the next step.

    Args:
        scores: ``[m, n]`` router scores (float32; detached is fine, no gradient is taken).
        bias: ``[n]`` float32 bias that routed these tokens.
        k: experts per token, ``1 <= k < n`` (the (k+1)-th value must exist).
        center: subtract the mean (default, as in the reference); ``False`` returns the raw quantiles
            that hit ``round(q)`` against the current ``alpha`` (for tests).

    Returns:
        ``[n]`` float32 new bias.
    """
    _check_scores_bias(scores, bias, k, scores.shape[1] - 1)
    m, n = scores.shape
    if m == 0:
        return bias.detach().float().clone()
    with torch.no_grad():
        s = scores.detach().float()
        alpha = (s + bias.float()).topk(k + 1, dim=-1).values[:, -1]  # [m]
        required = alpha[:, None] - s  # [m, n]
        pos = min(max(m * k / n - 0.5, 0.0), m - 1.0)
        lo = math.floor(pos)
        hi = min(lo + 1, m - 1)
        frac = pos - lo
        # one segmented sort of the n contiguous columns: the same order statistics as kthvalue per column,
        # several times faster on GPUs (kthvalue along a strided dim 0 runs one selection per column)
        ordered = required.T.contiguous().sort(dim=-1).values  # [n, m]
        r_lo, r_hi = ordered[:, lo], ordered[:, hi]
        new_bias = r_lo + frac * (r_hi - r_lo)
        if center:
            new_bias = new_bias - new_bias.mean()
    return new_bias.float()


def sign_bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Loss-free balancing (DeepSeek-V3): ``b_j <- b_j + u · sign(mean_j(load) - load_j)``.

    Args:
        bias: ``[n]`` float32 current bias.
        load: ``[n]`` tokens routed to each expert over the optimizer step (any real dtype).
        rate: the step ``u`` (1e-3 in the paper).

    Returns:
        ``[n]`` float32 new bias.
    """
    if load.shape != bias.shape:
        raise ValueError(f"load must have the bias shape {tuple(bias.shape)}, got {tuple(load.shape)}")
    load = load.detach().float()
    return (bias.detach().float() + rate * torch.sign(load.mean() - load)).float()


def aux_loss(scores: torch.Tensor, expert_idx: torch.Tensor, n_experts: int, k: int) -> torch.Tensor:
    """Switch/GShard load-balancing loss ``n · Σ_j f_j P_j`` (unscaled: the caller multiplies by α).

    ``f_j = |{(i, r): idx_ir = j}| / (m k)`` is the fraction of routed slots that go to expert j (not
    differentiable), ``P_j = mean_i (s_ij / Σ_r s_ir)`` the mean normalised router probability
    (differentiable). Equals 1 for a perfectly uniform router; larger when load and probability
    concentrate on the same experts.

    Args:
        scores: ``[m, n]`` router scores (requires grad for the loss to train the router).
        expert_idx: ``[m, k]`` int64 selection from :func:`route`.
        n_experts: ``n``.
        k: experts per token.

    Returns:
        scalar in the dtype of ``scores``.
    """
    m = scores.shape[0]
    if m == 0:
        return scores.sum() * 0.0
    f = expert_load(expert_idx, n_experts).to(scores.dtype) / (m * k)
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
    return n_experts * (f * p).sum()


def expert_counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """How many entries of ``idx`` (any shape, int64 values in ``[0, n)``) equal each ``j``: ``[n]`` int64.

    ``scatter_add_`` rather than ``torch.bincount``: the output shape is static (``torch.compile`` traces it)
    and CUDA's bincount reads the largest index back to the host, a sync in every forward.
    """
    flat = idx.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def expert_load(expert_idx: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens routed to each expert: ``load_j = |{(i, r): idx_ir = j}|``.

    Args:
        expert_idx: ``[..., k]`` int64 expert indices.
        n: number of experts.

    Returns:
        ``[n]`` float32 counts (exact below 2^24 per expert). Negative indices (dropped slots of
        :func:`capacity_route`) are not counted.
    """
    return expert_counts(expert_idx + 1, n + 1)[1:].float()  # shift: -1 (dropped) -> bin 0


def max_violation(load: torch.Tensor, k: int, m: int | float) -> torch.Tensor:
    """``MaxVio = (max_j load_j - mean_load) / mean_load`` with ``mean_load = m k / n``.

    Args:
        load: ``[n]`` or ``[L, n]`` tokens per expert (per layer).
        k: experts per token.
        m: tokens the load was counted over.

    Returns:
        scalar (for ``[n]``) or ``[L]`` float32.
    """
    n = load.shape[-1]
    mean_load = m * k / n
    return ((load.float().amax(dim=-1) - mean_load) / mean_load).float()


def router_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of the normalised router scores ``p_ij = s_ij / Σ_j s_ij``: ``[m, n] -> []`` float32.

    ``log n`` for a router that scores every expert alike; lower when the scores concentrate.
    """
    if scores.shape[0] == 0:
        return scores.new_zeros((), dtype=torch.float32)
    s = scores.detach().float()
    p = s / s.sum(dim=-1, keepdim=True)
    return -(p * p.clamp_min(1e-30).log()).sum(dim=-1).mean()


def _rank_within_groups(groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Position of each element among the elements of its group, in input order: ``[M] int64 -> [M] int64``."""
    order = groups.argsort(stable=True)
    counts = expert_counts(groups, n_groups)
    starts = counts.cumsum(0) - counts
    pos = torch.empty_like(order)
    pos[order] = torch.arange(groups.numel(), device=groups.device) - starts[groups[order]]
    return pos


def capacity_route(
    scores: torch.Tensor, bias: torch.Tensor, k: int, capacity_factor: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with an expert capacity ``c = min(ceil(cf · m k / n), m)`` (docs/MATH.md §2, capacity mode).

    Slots are admitted in priority order: all first choices (token order), then all second choices, ...;
    an expert admits slots while it has room. A rejected slot moves to its token's next candidate (the
    ``(k+1)``-th, ``(k+2)``-th, ... expert of ``s_i + b``, each candidate used once per token) and competes
    for the room left, in token order, round after round; a slot that runs out of candidates is dropped.
    No expert ever takes more than ``c`` slots, and ``c >= 1`` so that ``m k / n < 1`` still routes.

    Args:
        scores: ``[m, n]`` router scores (may require grad; the weights are differentiable).
        bias: ``[n]`` float32 selection bias.
        k: experts per token, ``1 <= k <= n``.
        capacity_factor: cf > 0.

    Returns:
        ``(expert_idx [m, k] int64, weights [m, k], rerouted [] int64, dropped [] int64)``: ``expert_idx`` is
        -1 for a dropped slot, whose weight is 0; the weights of a token's kept slots are its scores
        normalised over them (all-zero if every slot was dropped); ``rerouted`` counts slots that ended on a
        later candidate, ``dropped`` slots with no expert.

    Raises:
        ValueError: bad shapes, k, or ``capacity_factor <= 0``.
    """
    _check_scores_bias(scores, bias, k, scores.shape[1])
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    m, n = scores.shape
    dev = scores.device
    cap = max(1, min(math.ceil(capacity_factor * m * k / n), m))
    with torch.no_grad():
        ranked = (scores.detach() + bias.to(scores.dtype)).argsort(dim=-1, descending=True)  # [m, n]
        final = torch.full((m, k), -1, dtype=torch.long, device=dev)
        room = torch.full((n,), cap, dtype=torch.long, device=dev)
        pointer = torch.full((m,), k, dtype=torch.long, device=dev)  # next unused candidate per token
        # proposals in priority order: slot-major, then token order
        tok = torch.arange(m, device=dev).repeat(k)  # [k m]
        slot = torch.arange(k, device=dev).repeat_interleave(m)
        exp = ranked[:, :k].T.reshape(-1)
        rerouted = torch.zeros((), dtype=torch.long, device=dev)
        first = True
        while tok.numel():
            pos = _rank_within_groups(exp, n)
            ok = pos < room[exp]
            final[tok[ok], slot[ok]] = exp[ok]
            room -= expert_counts(exp[ok], n)
            if not first:
                rerouted += ok.sum()
            first = False
            tok, slot = tok[~ok], slot[~ok]
            if tok.numel() == 0:
                break
            by_token = tok.argsort(stable=True)  # later rounds: token order
            tok, slot = tok[by_token], slot[by_token]
            cand = pointer[tok] + _rank_within_groups(tok, m)
            pointer.index_add_(0, tok, torch.ones_like(tok))
            alive = cand < n
            tok, slot, cand = tok[alive], slot[alive], cand[alive]
            exp = ranked[tok, cand]
        dropped = (final < 0).sum()
    chosen = scores.gather(1, final.clamp(min=0)) * (final >= 0)
    weights = chosen / chosen.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    return final, weights, rerouted, dropped


def required_bias_histogram(
    scores: torch.Tensor, bias: torch.Tensor, k: int, lo: float | torch.Tensor, hi: float | torch.Tensor, bins: int
) -> torch.Tensor:
    """Histogram of the required biases ``r_ij = alpha_i - s_ij`` of one micro-batch, per expert.

    ``alpha_i`` is the (k+1)-th largest ``s_i + b``. Bins are ``bins`` uniform cells over ``[lo, hi)``; values
    outside are clamped into the first / last bin. With ``lo = min(b) - 1`` and ``hi = max(b) + 1`` no value is
    outside (``s ∈ (0, 1)``). Counts add up over micro-batches and ranks, so one integer all-reduce of the
    sum yields the histogram of the pooled global batch.

    Args:
        scores: ``[m, n]`` router scores (detached is fine).
        bias: ``[n]`` float32 bias that routed these tokens.
        k: experts per token, ``1 <= k < n``.
        lo, hi: bin range (floats or 0-d tensors), ``lo < hi``.
        bins: bins per expert B.

    Returns:
        ``[n, bins]`` int64 counts; every row sums to m.
    """
    _check_scores_bias(scores, bias, k, scores.shape[1] - 1)
    m, n = scores.shape
    with torch.no_grad():
        s = scores.detach().float()
        alpha = (s + bias.float()).topk(k + 1, dim=-1).values[:, -1]  # [m]
        r = alpha[:, None] - s  # [m, n]
        cell = ((r - lo) * (bins / (hi - lo))).floor().clamp_(0, bins - 1).long()
        cell += torch.arange(n, device=s.device) * bins
        cell = cell.reshape(-1)
        # scatter_add, not bincount: CUDA bincount reads the max index back to the host (a sync per forward)
        counts = torch.zeros(n * bins, dtype=torch.int64, device=s.device)
        return counts.scatter_add_(0, cell, torch.ones_like(cell)).view(n, bins)


def quantile_bias_from_histogram(
    counts: torch.Tensor, lo: float | torch.Tensor, hi: float | torch.Tensor, k: int, *, center: bool = True
) -> torch.Tensor:
    """Quantile Balancing from pooled histogram counts (the distributed estimate of :func:`quantile_bias`).

    With ``m = Σ_b counts[j, b]`` tokens and target load ``q = m k / n``: for each expert take the first
    bin whose cumulative count reaches ``q`` and interpolate linearly inside it (mass spread uniformly over
    the bin), i.e. the value where the piecewise-linear empirical CDF equals ``q`` -- the continuous
    counterpart of the Hazen position ``q - 1/2`` of :func:`quantile_bias`. Error below one bin width
    ``(hi - lo) / bins`` when the bins around the quantile are populated. Then mean-centre.

    Args:
        counts: ``[n, bins]`` int64 pooled counts from :func:`required_bias_histogram`.
        lo, hi: the bin range the counts were taken with.
        k: experts per token.
        center: subtract the mean (default).

    Returns:
        ``[n]`` float32 new bias.
    """
    n, bins = counts.shape
    c = counts.double()
    m = c[0].sum()
    q = m * k / n
    cum = c.cumsum(dim=1)  # [n, B]
    b = (cum < q).sum(dim=1).clamp(max=bins - 1)  # first bin with cum >= q
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(q))
    inside = c.gather(1, b[:, None])[:, 0]
    frac = ((q - before) / inside.clamp(min=1)).clamp(0, 1)
    lo_t = torch.as_tensor(lo, dtype=torch.float64, device=counts.device)
    width = (torch.as_tensor(hi, dtype=torch.float64, device=counts.device) - lo_t) / bins
    new_bias = lo_t + (b.double() + frac) * width
    if center:
        new_bias = new_bias - new_bias.mean()
    return new_bias.float()
