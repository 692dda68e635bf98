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
* :func:`sliding_average` -- the running average across optimizer steps that turns the one-step quantile
  bias (or the capacity threshold) into the sliding-average estimate.
* :func:`capacity_route` -- top-k routing with a per-expert capacity (a count per forward, or a causal score
  threshold); overflow re-routed or dropped.
* :func:`causal_capacity_route` -- a count per forward with tokens admitted in position order, so that no token's
  routing depends on a later position.
* :func:`chooser_score_histogram` + :func:`capacity_threshold_from_histogram` -- the per-expert score threshold
  of the quantile capacity mode, from integer counts that add up over micro-batches and ranks.

Metrics: :func:`expert_load`, :func:`max_violation` (``MaxVio``) and :func:`router_entropy`.
"""

from __future__ import annotations

import math

import torch

from k3lit.kernels import use_triton

__all__ = [
    "expert_counts",
    "route",
    "capacity_route",
    "capacity_tokens",
    "causal_capacity_route",
    "chooser_score_histogram",
    "capacity_threshold_from_histogram",
    "sliding_average",
    "quantile_bias",
    "required_bias_histogram",
    "quantile_bias_from_histogram",
    "sign_bias_update",
    "aux_loss",
    "expert_load",
    "max_violation",
    "router_entropy",
]


def capacity_tokens(capacity_factor: float, m: int, k: int, n: int) -> int:
    """Tokens an expert takes under a count limit: ``ceil(cf · m k / n)`` for ``m`` tokens routed to ``k`` of ``n``
    experts, clamped to ``[1, m]`` (the capacity of :func:`capacity_route` and :func:`causal_capacity_route`)."""
    return max(1, min(math.ceil(capacity_factor * m * k / n), m))


def _check_scores_bias(scores: torch.Tensor, bias: torch.Tensor, k: int, k_max: int) -> None:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a floating [m, n] tensor, got {scores.dtype} of shape {tuple(scores.shape)}")
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

    Leading dimensions batch independent problems (e.g. every MoE layer of a model at once): each ``[m, n]`` slice
    of ``scores`` with its ``[n]`` slice of ``bias`` gives what it gives alone, in one top-k and one sort for all.

    Args:
        scores: ``[..., m, n]`` router scores (float32; detached is fine, no gradient is taken).
        bias: ``[..., n]`` float32 bias that routed these tokens.
        k: experts per token, ``1 <= k < n`` (the (k+1)-th value must exist).
        center: subtract the mean (default, as in the reference); ``False`` returns the raw quantiles
            that hit ``round(q)`` against the current ``alpha`` (for tests).

    Returns:
        ``[..., n]`` float32 new bias.

    Raises:
        ValueError: scores not ``[..., m, n]`` with a bias of ``[..., n]``, or k outside ``[1, n - 1]``.
    """
    if scores.dim() < 2:
        raise ValueError(f"scores must be [..., m, n], got shape {tuple(scores.shape)}")
    if bias.shape != scores.shape[:-2] + scores.shape[-1:]:
        raise ValueError(f"bias must be [..., n] = {list(scores.shape[:-2] + scores.shape[-1:])} for scores of shape "
                         f"{tuple(scores.shape)}, got shape {tuple(bias.shape)}")
    m, n = scores.shape[-2:]
    if not 1 <= k <= n - 1:
        raise ValueError(f"k must satisfy 1 <= k <= {n - 1} for n = {n} experts, got k = {k}")
    if m == 0:
        return bias.detach().float().clone()
    with torch.no_grad():
        s = scores.detach().float()
        alpha = (s + bias.float().unsqueeze(-2)).topk(k + 1, dim=-1).values[..., -1]  # [..., m]
        required = alpha.unsqueeze(-1) - s  # [..., m, n]
        pos = min(max(m * k / n - 0.5, 0.0), m - 1.0)
        lo = math.floor(pos)
        hi = min(lo + 1, m - 1)
        frac = pos - lo
        # one segmented sort of the n contiguous columns: the same order statistics as kthvalue per column,
        # several times faster on GPUs (kthvalue along a strided dim 0 runs one selection per column)
        ordered = required.transpose(-1, -2).contiguous().sort(dim=-1).values  # [..., n, m]
        r_lo, r_hi = ordered[..., lo], ordered[..., hi]
        new_bias = r_lo + frac * (r_hi - r_lo)
        if center:
            new_bias = new_bias - new_bias.mean(dim=-1, keepdim=True)
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


def _kept_slot_weights(scores: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """Gate weights of capacity routing: a token's scores normalised over its kept slots (``final >= 0``), 0 for a
    dropped slot, all-zero for a token whose every slot was dropped. ``[m, n], [m, k] -> [m, k]``."""
    kept = final >= 0
    chosen = scores.gather(1, final.clamp(min=0)) * kept
    return chosen / chosen.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


def capacity_route(
    scores: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    capacity_factor: float | None = None,
    *,
    min_score: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with an expert capacity (docs/MATH.md §2, capacity modes); overflow re-routed or dropped.

    A token's candidates are its experts in the order of ``s_i + b``. Two limits, either or both:

    * ``capacity_factor`` (count per call): expert j takes at most ``c = min(ceil(cf · m k / n), m)`` of the
      ``m`` tokens passed in (``c >= 1``, so that ``m k / n < 1`` still routes). Slots are admitted in priority
      order: all first choices (token order), then all second choices, ...; a rejected slot moves to its token's
      next unused candidate and competes for the room left, in token order, round after round. A token's
      routing then depends on every other token of the call, later positions of its own sequence included.
    * ``min_score`` (per token, causal): expert j admits token i only if ``s_ij >= min_score_j``; a token's
      slots go to its first k admitting candidates. The routing of a token is a function of its own scores,
      ``b`` and ``min_score`` alone, so no other token (earlier or later, in its sequence or another) changes it.

    A slot that runs out of candidates is dropped. A slot counts as re-routed when its expert is not among the
    token's first k candidates of ``s_i + b``.

    Args:
        scores: ``[m, n]`` router scores (may require grad; the weights are differentiable).
        bias: ``[n]`` float32 selection bias.
        k: experts per token, ``1 <= k <= n``.
        capacity_factor: None (no count limit) or cf > 0.
        min_score: None (no threshold) or ``[n]`` float32 per-expert score threshold (0 admits every token).

    Returns:
        ``(expert_idx [m, k] int64, weights [m, k], rerouted [] int64, dropped [] int64)``: ``expert_idx`` is
        -1 for a dropped slot, whose weight is 0; the weights of a token's kept slots are its scores
        normalised over them (all-zero if every slot was dropped); ``rerouted`` counts slots that ended on a
        later candidate, ``dropped`` slots with no expert.

    Raises:
        ValueError: bad shapes or k, ``capacity_factor <= 0``, or neither limit given.
    """
    _check_scores_bias(scores, bias, k, scores.shape[1])
    if capacity_factor is None and min_score is None:
        raise ValueError("capacity_route needs a capacity_factor, a min_score or both")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    m, n = scores.shape
    if min_score is not None and min_score.shape != (n,):
        raise ValueError(f"min_score must be [n] = [{n}], got shape {tuple(min_score.shape)}")
    dev = scores.device
    with torch.no_grad():
        key = scores.detach() + bias.to(scores.dtype)  # [m, n]
        top = None
        n_valid = torch.full((m,), n, dtype=torch.long, device=dev)  # admitting candidates per token
        if min_score is not None:
            top = key.topk(k, dim=-1).indices
            admitted = scores.detach() >= min_score.to(scores.dtype)
            key = key.masked_fill(~admitted, -math.inf)
            n_valid = admitted.sum(dim=-1)
        ranked = key.argsort(dim=-1, descending=True)  # [m, n], admitting candidates first
        if top is None:
            top = ranked[:, :k]
        if capacity_factor is None:  # no count: every slot takes its next admitting candidate, in one pass
            final = torch.where(torch.arange(k, device=dev) < n_valid[:, None], ranked[:, :k], -1)
        else:
            final = _admit_in_rounds(ranked, n_valid, k, capacity_tokens(capacity_factor, m, k, n))
        rerouted, dropped = _rerouted_dropped(final, top)
    return final, _kept_slot_weights(scores, final), rerouted, dropped


def _admit_in_rounds(ranked: torch.Tensor, n_valid: torch.Tensor, k: int, cap: int) -> torch.Tensor:
    """:func:`capacity_route`'s count limit: ``[m, k]`` experts (-1: dropped) from the candidates ``ranked [m, n]``
    (the first ``n_valid [m]`` of each row admitting), every expert taking at most ``cap`` slots, proposals in
    priority order round after round (rounds loop on the host: not for ``torch.compile``)."""
    m, n = ranked.shape
    dev = ranked.device
    final = torch.full((m, k), -1, dtype=torch.long, device=dev)
    room = torch.full((n,), cap, dtype=torch.long, device=dev)
    pointer = torch.full((m,), k, dtype=torch.long, device=dev)  # next unused candidate per token
    # proposals in priority order: slot-major, then token order
    tok = torch.arange(m, device=dev).repeat(k)  # [k m]
    slot = torch.arange(k, device=dev).repeat_interleave(m)
    valid = slot < n_valid[tok]
    tok, slot = tok[valid], slot[valid]
    exp = ranked[tok, slot]
    while tok.numel():
        pos = _rank_within_groups(exp, n)
        ok = pos < room[exp]
        final[tok[ok], slot[ok]] = exp[ok]
        room -= expert_counts(exp[ok], n)
        tok, slot = tok[~ok], slot[~ok]
        if tok.numel() == 0:
            break
        by_token = tok.argsort(stable=True)  # later rounds: token order
        tok, slot = tok[by_token], slot[by_token]
        cand = pointer[tok] + _rank_within_groups(tok, m)
        pointer.index_add_(0, tok, torch.ones_like(tok))
        alive = cand < n_valid[tok]
        tok, slot, cand = tok[alive], slot[alive], cand[alive]
        exp = ranked[tok, cand]
    return final


def _rerouted_dropped(final: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rerouted, dropped)`` int64 scalars: kept slots whose expert is not among the token's first k candidates
    ``top [m, k]``, and slots with no expert (-1 in ``final [m, k]``)."""
    kept = final >= 0
    return (kept & ~(final[:, :, None] == top[:, None, :]).any(dim=-1)).sum(), (~kept).sum()


@torch.library.custom_op("k3lit::first_overflow", mutates_args=())
def first_overflow(taken: torch.Tensor, cap: int) -> torch.Tensor:
    """Per column j of ``taken [m, n]`` (int32, entries 0 or 1), the first row r with ``sum(taken[:r + 1, j]) >
    cap``; m where the column never exceeds ``cap``. Returns ``[n]`` int64.

    The running counts never fall, so that row is the number of rows whose count is at most ``cap``. A custom
    op, opaque to ``torch.compile``: inductor (torch 2.11, CUDA) fused a running count down a long column (m =
    32,768, n = 16: a split scan) with the reduction after it and failed to generate the kernel ("NYI
    TritonSplitDimKernel reductions")."""
    return (taken.cumsum(0) <= cap).sum(0)


@first_overflow.register_fake
def _first_overflow_fake(taken: torch.Tensor, cap: int) -> torch.Tensor:
    return taken.new_empty(taken.shape[1], dtype=torch.int64)


def causal_capacity_route(
    scores: torch.Tensor, bias: torch.Tensor, k: int, capacity_factor: float, seq_len: int, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with a per-expert count limit, tokens admitted in position order (docs/MATH.md §2).

    The ``m = B T`` rows of ``scores`` are ``B`` sequences of ``T = seq_len`` tokens, sequence-major. Tokens are
    taken in *priority order*: position 0 of every sequence (sequence order), then position 1, and so on. Each
    takes its top k of ``s_i + b`` among the experts that are still open; expert j closes once
    ``c = min(ceil(cf · m k / n), m)`` tokens have taken it. A token's routing therefore depends only on the
    tokens before it in priority order: earlier positions of every sequence and the same position of earlier
    sequences, never a later position of any sequence. Every expert ends with at most c tokens.

    ``backend="triton"`` (the default on CUDA tensors) takes every token's plain top k in parallel up to
    the first block of tokens that would overflow an expert, then admits the rest a block at a time in one program
    (``k3lit.kernels.routing``). ``backend="torch"`` runs without a loop over tokens: with each expert's closing
    point fixed, every token's choice is one masked top-k; the earliest point at which some expert's running count
    exceeds c closes that expert there (the choices before it cannot change), and n + 1 such rounds settle all of
    them. Work ``O(n² m)``. Both give the same experts (up to ties in ``s + b``). Where ``c = m`` (a decoding step
    of one sequence) no expert can pass c, and the plain top k is returned without either.

    Args:
        scores: ``[m, n]`` router scores (may require grad; the weights are differentiable).
        bias: ``[n]`` float32 selection bias.
        k: experts per token, ``1 <= k <= n``.
        capacity_factor: cf > 0.
        seq_len: T, with ``m`` a multiple of it.
        backend: ``"auto"`` (Triton on CUDA tensors, torch elsewhere), ``"triton"`` (also CPU tensors under
            ``TRITON_INTERPRET=1``) or ``"torch"``.

    Returns:
        ``(expert_idx [m, k] int64, weights [m, k], rerouted [] int64, dropped [] int64)`` as
        :func:`capacity_route` returns them (-1 and weight 0 for a slot that found no open expert).

    Raises:
        ValueError: bad shapes or k, ``capacity_factor <= 0``, ``m`` not a multiple of ``seq_len``, an unknown
            backend, or ``backend="triton"`` for tensors no Triton kernel runs on.
    """
    _check_scores_bias(scores, bias, k, scores.shape[1])
    if not 0 < capacity_factor < math.inf:
        raise ValueError(f"capacity_factor must be > 0 and finite, got {capacity_factor}")
    m, n = scores.shape
    if seq_len < 1 or m % seq_len:
        raise ValueError(f"the {m} tokens are not whole sequences of seq_len={seq_len}")
    triton = use_triton(scores, backend)
    cap = capacity_tokens(capacity_factor, m, k, n)
    if cap == m:  # a token takes an expert at most once: the count cannot bind
        final = (scores.detach() + bias.to(scores.dtype)).topk(k, dim=-1).indices
        none = torch.zeros((), dtype=torch.long, device=scores.device)
        return final, _kept_slot_weights(scores, final), none, none.clone()
    if triton:
        from k3lit.kernels.routing import causal_capacity_triton

        final, rerouted, dropped = causal_capacity_triton(scores, bias, k, cap, seq_len)
        return final, _kept_slot_weights(scores, final), rerouted, dropped
    dev = scores.device
    with torch.no_grad():
        order = torch.arange(m, device=dev).view(m // seq_len, seq_len).T.reshape(-1)  # priority -> row
        key = (scores.detach() + bias.to(scores.dtype))[order]  # [m, n] in priority order
        top = key.topk(k, dim=-1).indices
        rank = torch.arange(m, device=dev)[:, None]
        closes_at = torch.full((n,), m, dtype=torch.long, device=dev)  # first priority rank that j refuses
        experts = torch.arange(n, device=dev)

        def choose() -> tuple[torch.Tensor, torch.Tensor]:  # each token's top k among the experts open to it
            vals, idx = key.masked_fill(rank >= closes_at, -math.inf).topk(k, dim=-1)
            return idx, vals > -math.inf

        for _ in range(n):  # each round closes at most one expert, at most once: n rounds settle all
            idx, kept = choose()
            taken = torch.zeros(m, n, dtype=torch.int32, device=dev).scatter_add_(1, idx, kept.int())
            first = first_overflow(taken, cap)  # [n]
            # close the expert that overflows first (a no-op once settled); a mask, not closes_at[j]: no host sync,
            # and no data-dependent index for torch.compile
            closes_at = torch.where(experts == first.argmin(), torch.minimum(closes_at, first), closes_at)
        idx, kept = choose()
        final = torch.where(kept, idx, -1)
        rerouted, dropped = _rerouted_dropped(final, top)
        final = torch.empty_like(final).index_copy_(0, order, final)  # back to row order
    return final, _kept_slot_weights(scores, final), rerouted, dropped


def chooser_score_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, bins: int) -> torch.Tensor:
    """Histogram, per expert, of the scores of the tokens that choose it: ``s_ij`` for ``j ∈ top-k(s_i + b)``.

    Bins are ``bins`` uniform cells over ``[0, 1)`` (``s ∈ (0, 1)``; a score of exactly 1 goes to the last bin).
    Counts add up over micro-batches and ranks (one integer all-reduce gives the pooled histogram). The input of
    :func:`capacity_threshold_from_histogram`.

    Args:
        scores: ``[m, n]`` router scores (detached is fine).
        bias: ``[n]`` float32 bias that routed these tokens.
        k: experts per token, ``1 <= k <= n``.
        bins: bins per expert B.

    Returns:
        ``[n, bins]`` int64 counts; row j sums to the number of tokens whose top-k holds j.
    """
    _check_scores_bias(scores, bias, k, scores.shape[1])
    n = scores.shape[1]
    with torch.no_grad():
        s = scores.detach().float()
        idx = (s + bias.float()).topk(k, dim=-1).indices  # [m, k]
        cell = (s.gather(1, idx) * bins).floor().clamp_(0, bins - 1).long() + idx * bins
        return expert_counts(cell, n * bins).view(n, bins)


def capacity_threshold_from_histogram(counts: torch.Tensor, capacity: float | torch.Tensor) -> torch.Tensor:
    """The per-expert score threshold above which at most ``capacity`` of an expert's choosers lie.

    With ``U_j(x)`` = the number of choosers of expert j with score ``>= x`` (from
    :func:`chooser_score_histogram`, mass spread uniformly inside each bin, so ``U_j`` is exact at the bin edges
    and linear between them), returns the ``x`` where ``U_j(x) = capacity``: the upper ``capacity / U_j(0)``
    quantile of the choosers' scores. 0 (no limit) when the expert has at most ``capacity`` choosers. Error
    below one bin width: ``U_j(x + 1/B) <= capacity < U_j(x - 1/B)`` in exact counts.

    Args:
        counts: ``[n, bins]`` int64 pooled counts over ``[0, 1)``.
        capacity: tokens per expert c >= 0 (float or 0-d tensor, e.g. ``cf · m k / n`` for m pooled tokens).

    Returns:
        ``[n]`` float32 thresholds in ``[0, 1]``.
    """
    n, bins = counts.shape
    c = counts.double()
    above = c.flip(1).cumsum(1).flip(1)  # [n, B]: S_b = choosers in bins >= b
    cap = torch.as_tensor(capacity, dtype=torch.float64, device=counts.device)
    b = ((above > cap).sum(dim=1) - 1).clamp(min=0)  # the last bin with S_b > c (S is non-increasing)
    s_b = above.gather(1, b[:, None])[:, 0]
    inside = c.gather(1, b[:, None])[:, 0]
    frac = ((s_b - cap) / inside.clamp(min=1)).clamp(0, 1)
    threshold = (b.double() + frac) / bins
    return torch.where(above[:, 0] > cap, threshold, torch.zeros_like(threshold)).float()


def sliding_average(running: torch.Tensor, estimate: torch.Tensor, rate: float) -> torch.Tensor:
    """One step of the running average across optimizer steps: ``running + rate · (estimate - running)``.

    With the quantile bias as ``estimate`` this is the sliding-average quantile: after t steps the bias weighs
    the estimate of step t - s by ``rate (1 - rate)^s``, an average over about ``1 / rate`` steps, so that it
    follows the router's drift but not one batch's sampling noise. ``rate = 1`` is the one-step estimate.
    Linear: the average of mean-centred biases stays mean-centred.

    Args:
        running: ``[..., n]`` float32 current running estimate (the bias that routed the step; leading dimensions
            batch layers).
        estimate: ``[..., n]`` this step's estimate (e.g. :func:`quantile_bias`).
        rate: ``0 < rate <= 1``.

    Returns:
        ``[..., n]`` float32.

    Raises:
        ValueError: ``rate`` outside ``(0, 1]`` or mismatched shapes.
    """
    if not 0 < rate <= 1:
        raise ValueError(f"rate must lie in (0, 1], got {rate}")
    if running.shape != estimate.shape:
        raise ValueError(f"estimate must have the shape {tuple(running.shape)}, got {tuple(estimate.shape)}")
    running = running.detach().float()
    return torch.lerp(running, estimate.detach().float(), rate)


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
