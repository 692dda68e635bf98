"""Mixture of Experts with a sigmoid router, a float32 selection bias and Quantile Balancing.

Reads top-down: :class:`MoE` (router -> route -> sorted dispatch -> stacked SwiGLU experts through one
grouped matmul -> float32 combine), then the balancer bookkeeping. The math of the balancers lives in
:mod:`k3lit.ops.routing` as pure functions; this module only collects their inputs over one optimizer
step and applies their output. Expert parallelism (experts sharded over ranks, tokens exchanged by
all-to-all) attaches from outside: :func:`k3lit.parallel.parallelize` sets :attr:`MoE.dispatcher`; with
``dispatcher=None`` the layer is the plain single-process one.

Balancer life cycle (docs/MATH.md §2):

* ``forward`` in training mode records the statistics of its micro-batch (detached float32 scores for
  ``quantile``, integer histogram counts of the required bias for ``quantile_hist``, expert loads for
  ``aux_free``) and routes with the *current* bias; a compiled forward leaves them in a slot that the
  training loop moves into the step's statistics after each forward (:meth:`MoE.collect_balancer_stats`), so
  a step of several micro-batches compiles each layer once;
* the training loop calls :meth:`MoE.update_balancer` (or :func:`update_balancers` on the whole model)
  once per optimizer step; it pools every micro-batch of the step (and every rank, when
  ``torch.distributed`` is initialised), computes the step's estimate, moves the running bias towards it
  by ``quantile_rate`` (the sliding-average quantile; 1 = the one-step estimate) and clears the statistics, so
  a batch is never routed by a bias derived from itself;
* with ``sync_every = N`` the ranks skip the pooling: each moves its own bias towards the estimate from its
  own tokens, and every N-th update the ranks' biases (and capacity thresholds) are averaged, one all-reduce
  of ``2 n`` floats;
* in the ``quantile`` capacity mode the same update keeps a running per-expert score threshold (the level
  above which an expert's choosers filled its capacity), which limits the next steps' routing token by token;
* nothing is recorded in eval mode (the bias is frozen at inference), nor in the second forward that
  activation checkpointing runs inside backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from k3lit.nn.mlp import SwiGLU
from k3lit.ops.grouped_mm import grouped_mm
from k3lit.ops.permute import dispatch_tokens, sort_slots, undo_sort
from k3lit.ops.routing import (
    aux_loss,
    capacity_route,
    capacity_threshold_from_histogram,
    causal_capacity_route,
    chooser_score_histogram,
    expert_load,
    quantile_bias,
    quantile_bias_from_histogram,
    required_bias_histogram,
    route,
    router_entropy,
    sign_bias_update,
    sliding_average,
)

__all__ = ["MoE", "GroupedExperts", "BALANCERS", "CAPACITY_MODES", "update_balancers"]

BALANCERS = ("quantile", "quantile_hist", "aux_free", "aux_loss", "none")
CAPACITY_MODES = ("forward", "causal", "quantile")
HIST_BINS = 1000  # bins per expert of the quantile_hist estimator and of the capacity threshold (docs/MATH.md §2)
_FLOAT32_BUFFERS = ("expert_bias", "capacity_threshold")
_PENDING_WARN = 4096  # micro-batches without an update_balancer() call before we warn once


def _in_backward() -> bool:
    """True while autograd executes a backward pass, e.g. when activation checkpointing (reentrant or not)
    re-runs a forward to recompute saved tensors. Never inside a ``torch.compile`` region: there a checkpointed
    forward is recomputed inside the compiled backward graph, without running this Python code again."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1



def _local(w: torch.Tensor) -> torch.Tensor:
    """The local shard of an expert-parallel DTensor weight (``[n / ep, ...]``); a plain tensor unchanged."""
    return w.to_local() if hasattr(w, "to_local") else w


class _Float32Linear(torch.autograd.Function):
    """``h W^T`` with autocast off in the forward *and* the backward, for inputs already in float32 (or float64).

    A plain ``F.linear`` inside ``torch.autocast(enabled=False)`` keeps its forward in float32, but under
    ``torch.compile`` AOT autograd traces its backward under the autocast state around the compiled region: the two
    gradient products of the router ran in bf16 there, in float32 eagerly. Here the backward disables autocast
    itself, so compiled and eager runs compute the same float32 products."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(h, w)
        with torch.autocast(h.device.type, enabled=False):
            return F.linear(h, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # noqa: D102
        h, w = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(h.dtype)
            dh = grad @ w if ctx.needs_input_grad[0] else None
            dw = grad.T @ h if ctx.needs_input_grad[1] else None
        return dh, dw


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: D102
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """``E`` stacked SwiGLU experts behind one grouped matmul: ``forward(xs [M, D], offsets [E]) -> [M, D]``.

    Rows of ``xs`` are sorted by expert; ``offsets[e]`` is the exclusive end row of expert e (int32/int64).
    Under expert parallelism the weights are DTensors sharded on dim 0 over the expert-parallel mesh and
    ``forward`` runs the local ``E = n / ep`` experts on the rows this rank received.

    Attributes:
        w_gate_up: ``[n, D, 2F]`` (gate | up).
        w_down: ``[n, F, D]``.
    """

    def __init__(self, n_experts: int, dim: int, expert_dim: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, dim, 2 * expert_dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, expert_dim, dim))
        self.grad_scale = 1.0  # set to 1/ep by k3lit.parallel.parallelize (see there)

    def forward(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        w_gate_up, w_down = _local(self.w_gate_up), _local(self.w_down)
        if self.grad_scale != 1.0:
            w_gate_up, w_down = _ScaleGrad.apply(w_gate_up, self.grad_scale), _ScaleGrad.apply(w_down, self.grad_scale)
        gate, up = grouped_mm(xs, w_gate_up, offsets).chunk(2, dim=-1)  # [M, F] each
        ys = grouped_mm(F.silu(gate) * up, w_down, offsets)  # [M, D]
        if xs.shape[0] == 0:  # keep the weights in the graph: FSDP must reduce a (zero) gradient on every rank
            ys = ys + 0.0 * (w_gate_up.sum() + w_down.sum())
        return ys


class MoE(nn.Module):
    """Top-k MoE channel mixer: ``forward(x [B, T, D]) -> [B, T, D]``.

    ``y_i = shared(x_i) + Σ_{j ∈ T_i} p_ij · SwiGLU_j(x_i)`` with ``s_i = sigmoid(W_r x_i)`` (float32),
    ``T_i = top-k(s_i + b)``, ``p_ij = s_ij / Σ_{r ∈ T_i} s_ir`` (:func:`k3lit.ops.route`).

    Args:
        dim: model width D.
        n_experts: routed experts n.
        top_k: experts per token k (``< n_experts`` for the quantile balancers, which need a (k+1)-th choice).
        expert_dim: hidden width of each SwiGLU expert.
        n_shared_experts: always-on experts, fused into one dense SwiGLU of width
            ``n_shared_experts * expert_dim``; 0 disables them.
        balancer: ``"quantile"`` (Quantile Balancing, exact pooled quantile: gathers every score of the
            step), ``"quantile_hist"`` (Quantile Balancing by the histogram estimator: ``HIST_BINS`` integer
            bins per expert, one all-reduce per step), ``"aux_free"`` (sign bias, rate ``bias_update_rate``),
            ``"aux_loss"`` (Switch/GShard loss, coefficient ``aux_loss_coef``) or ``"none"``.
        bias_update_rate: u of the ``aux_free`` sign rule.
        aux_loss_coef: α of the ``aux_loss`` balancer.
        capacity_factor: None (no limit) or cf > 0, the capacity ``cf · m k / n`` of an expert for m tokens;
            overflow goes to the token's next candidate expert with room, else is dropped
            (:func:`k3lit.ops.routing.capacity_route`). How the limit applies is ``capacity_mode``.
        quantile_rate: rate ρ ∈ (0, 1] of the sliding-average quantile: each optimizer step moves the bias
            of the ``quantile`` / ``quantile_hist`` balancers by ρ towards that step's estimate (and the
            capacity threshold towards its own), an average over about 1/ρ steps; 1 = the one-step estimate.
        sync_every: None (every update pools the statistics of every rank) or N >= 1: each rank estimates
            from its own tokens, and the ranks' running estimates are averaged every N-th update (one
            all-reduce of ``2 n`` floats instead of pooling every score or histogram each step).
        capacity_mode: ``"forward"``: each expert takes at most ``ceil(cf · m k / n)`` of the ``m`` tokens of a
            forward (per rank), so a token's routing depends on the other tokens of the forward, the later
            positions of its own sequence included. ``"causal"``: the same count, with tokens admitted in
            position order (every sequence's position 0, then position 1, ...;
            :func:`k3lit.ops.routing.causal_capacity_route`), so a token's routing depends on earlier positions
            only, of its own sequence and of the others in the forward. ``"quantile"``: expert j admits token i only if
            ``s_ij >= capacity_threshold_j``, a running estimate (rate ``quantile_rate``) of the score above
            which ``cf · m k / n`` of the step's tokens chose j; the threshold comes from earlier steps, so a
            token's routing depends on its own scores and the module's state alone (causal).

    Attributes:
        expert_bias: ``[n]`` float32 buffer; stays float32 under ``.to(dtype)``, ``.half()``, ``.bfloat16()``
            and Lightning precision plugins (see :meth:`_apply`). Saved in the state dict.
        capacity_threshold: ``[n]`` float32 buffer, the per-expert score threshold of the ``quantile``
            capacity mode (0 = no limit; stays 0 otherwise). Saved in the state dict, kept float32 like the bias.
        balancer_step: 0-d int64 buffer, balancer updates so far (the ``sync_every`` schedule). Saved in the
            state dict, so a resumed run keeps the schedule.
        experts: the stacked experts (:class:`GroupedExperts`).
        aux_loss: scalar tensor with the coefficient applied, set by a training forward of the ``aux_loss``
            balancer (None otherwise); add it to the task loss.
        last_load: ``[n]`` float32 detached token counts of the latest forward (this rank's tokens), for metrics.
        last_stats: ``{"tokens", "rerouted", "dropped", "entropy"}`` floats of the latest forward (not
            recomputation): token count, re-routed and dropped (token, expert) slots, mean router entropy
            (nats, of the normalised scores ``s_i / Σ_j s_ij``).
        process_group: group whose ranks pool their statistics in :meth:`update_balancer` (None: the
            default group when ``torch.distributed`` is initialised).
        dispatcher: None (every expert is local) or ``dispatcher(h [m, D], expert_idx [m, k], experts,
            n_experts) -> [m, k, D]``, which runs each slot wherever its expert lives. Expert parallelism
            (:func:`k3lit.parallel.parallelize`) sets it together with sharding :attr:`experts` on dim 0.
    """

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        expert_dim: int,
        n_shared_experts: int = 0,
        balancer: str = "quantile",
        bias_update_rate: float = 1e-3,
        aux_loss_coef: float = 1e-2,
        capacity_factor: float | None = None,
        quantile_rate: float = 1.0,
        sync_every: int | None = None,
        capacity_mode: str = "forward",
    ) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("n_experts", n_experts), ("top_k", top_k), ("expert_dim", expert_dim)):
            if value < 1:
                raise ValueError(f"MoE: {name} must be >= 1, got {value}")
        if n_shared_experts < 0:
            raise ValueError(f"MoE: n_shared_experts must be >= 0, got {n_shared_experts}")
        if balancer not in BALANCERS:
            raise ValueError(f"MoE: balancer must be one of {BALANCERS}, got {balancer!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be > 0 or None, got {capacity_factor}")
        if not 0 < quantile_rate <= 1:
            raise ValueError(f"MoE: quantile_rate must lie in (0, 1], got {quantile_rate}")
        if sync_every is not None and sync_every < 1:
            raise ValueError(f"MoE: sync_every must be >= 1 or None, got {sync_every}")
        if capacity_mode not in CAPACITY_MODES:
            raise ValueError(f"MoE: capacity_mode must be one of {CAPACITY_MODES}, got {capacity_mode!r}")
        quantile = balancer in ("quantile", "quantile_hist")
        k_max = n_experts - 1 if quantile else n_experts
        if top_k > k_max:
            raise ValueError(
                f"MoE: top_k must be <= {k_max} for n_experts={n_experts} and balancer={balancer!r}, got {top_k}"
                + (" (quantile balancing needs a (k+1)-th expert: raise n_experts or lower top_k)"
                   if quantile else "")
            )
        self.dim, self.n_experts, self.top_k, self.expert_dim = dim, n_experts, top_k, expert_dim
        self.n_shared_experts, self.balancer = n_shared_experts, balancer
        self.bias_update_rate, self.aux_loss_coef = bias_update_rate, aux_loss_coef
        self.capacity_factor, self.capacity_mode = capacity_factor, capacity_mode
        self.quantile_rate, self.sync_every = quantile_rate, sync_every

        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, expert_dim)
        self.shared = SwiGLU(dim, n_shared_experts * expert_dim) if n_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("capacity_threshold", torch.zeros(n_experts, dtype=torch.float32))
        self.register_buffer("balancer_step", torch.zeros((), dtype=torch.int64))
        self.process_group: dist.ProcessGroup | None = None
        self.dispatcher: Callable[..., torch.Tensor] | None = None

        self.aux_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None
        self.last_stats: dict[str, float] = {}
        self._pending_scores: list[torch.Tensor] = []  # quantile: detached float32 [m_b, n] per micro-batch
        self._pending_hist: torch.Tensor | None = None  # quantile_hist: [n, HIST_BINS] int64 summed counts
        self._hist_range: tuple[torch.Tensor, torch.Tensor] | None = None  # quantile_hist: bin range this step
        self._pending_load: torch.Tensor | None = None  # aux_free: [n] float32 summed over micro-batches
        self._pending_choosers: torch.Tensor | None = None  # quantile capacity: [n, HIST_BINS] int64 counts
        self._pending_m: torch.Tensor | None = None  # quantile capacity: 0-d int64 tokens recorded
        self._pending_batches = 0
        # a compiled forward's statistics, left for collect_balancer_stats(): appending to the lists above inside
        # the compiled region would make dynamo guard on their lengths and compile once per micro-batch
        self._fresh: dict[str, torch.Tensor] | None = None
        self._overwritten = False  # a compiled forward found the slot uncollected: the next collection warns
        self._warned = False
        self.reset_parameters()

    @property
    def w_gate_up(self) -> torch.Tensor:
        """``[n, D, 2F]`` stacked gate|up weights (``experts.w_gate_up``)."""
        return self.experts.w_gate_up

    @property
    def w_down(self) -> torch.Tensor:
        """``[n, F, D]`` stacked down weights (``experts.w_down``)."""
        return self.experts.w_down

    def reset_parameters(self, std: float | None = None, down_std: float | None = None) -> None:
        """Normal init of the stacked experts: ``w_gate_up ~ N(0, std)`` (default ``dim**-0.5``),
        ``w_down ~ N(0, down_std)`` (default ``expert_dim**-0.5``), and a zero ``expert_bias`` (float32); the
        router and shared experts are ``nn.Linear`` modules that reset themselves. Works on DTensor shards.
        The balancer state (``capacity_threshold``, ``balancer_step``) is zeroed too."""
        nn.init.normal_(self.experts.w_gate_up, std=self.dim**-0.5 if std is None else std)
        nn.init.normal_(self.experts.w_down, std=self.expert_dim**-0.5 if down_std is None else down_std)
        nn.init.zeros_(self.expert_bias)
        nn.init.zeros_(self.capacity_threshold)
        with torch.no_grad():
            self.balancer_step.zero_()

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D] -> [B, T, D]`` in ``x``'s dtype; routing and combination in float32 (or wider)."""
        B, T, D = x.shape
        h = x.reshape(-1, D)  # [m, D], m = B T
        acc = torch.promote_types(x.dtype, torch.float32)
        scores = self.router_scores(h)  # [m, n] acc
        rerouted = dropped = None
        if self.capacity_factor is None:
            expert_idx, weights = route(scores, self.expert_bias, self.top_k)  # [m, k] int64, [m, k] acc
        elif self.capacity_mode == "forward":  # dropped slots have index -1 and weight 0
            expert_idx, weights, rerouted, dropped = capacity_route(
                scores, self.expert_bias, self.top_k, self.capacity_factor
            )
        elif self.capacity_mode == "causal":  # a count per forward, admitted position by position
            expert_idx, weights, rerouted, dropped = causal_capacity_route(
                scores, self.expert_bias, self.top_k, self.capacity_factor, T
            )
        else:  # quantile: a per-expert score threshold from earlier steps, no count over this forward's tokens
            expert_idx, weights, rerouted, dropped = capacity_route(
                scores, self.expert_bias, self.top_k, min_score=self.capacity_threshold
            )
        self._record(scores, expert_idx, rerouted, dropped)

        y = self.run_experts(h, expert_idx)  # [m, k, D]
        out = (y.to(acc) * weights.to(acc)[..., None]).sum(dim=1)  # [m, D]
        if self.shared is not None:
            out = out + self.shared(h).to(acc)
        return out.to(x.dtype).view(B, T, D)

    def router_scores(self, h: torch.Tensor) -> torch.Tensor:
        """``s = sigmoid(h W_r^T)``: ``[m, D] -> [m, n]`` in float32 (float64 if ``h`` is), autocast off in the forward
        and the backward (:class:`_Float32Linear`)."""
        acc = torch.promote_types(h.dtype, torch.float32)
        with torch.autocast(h.device.type, enabled=False):
            return torch.sigmoid(_Float32Linear.apply(h.to(acc), self.router.weight.to(acc)))

    def run_experts(self, h: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """Apply the selected SwiGLU experts: ``h [m, D]``, ``expert_idx [m, k]`` (-1 = dropped) -> ``[m, k, D]``.

        The ``m k`` (token, expert) slots are sorted by expert and run through :attr:`experts` (two grouped
        matmuls over the stacked weights) -- on this rank (:mod:`k3lit.ops.permute`), or through
        :attr:`dispatcher` when one is set (expert parallelism: the ranks that own the experts); results come
        back in slot order, zero for dropped slots.
        """
        if self.dispatcher is not None:
            return self.dispatcher(h, expert_idx, self.experts, self.n_experts)
        m, k = expert_idx.shape
        order, inverse, ends = sort_slots(expert_idx, self.n_experts)  # dropped slots last, into no group
        xs = dispatch_tokens(h, order, inverse, k)  # [m k, D] by expert; the sort is undone by gathers
        if self.capacity_factor is None:  # every slot kept
            return undo_sort(self.experts(xs, ends), order, inverse).view(m, k, -1)
        # all m k slots keep their rows (no data-dependent shape, no host sync); the dropped ones, past the last
        # group, are zeroed on the way in and out, so neither they nor their gradients reach h or the output
        kept = (torch.arange(m * k, device=order.device) < ends[-1])[:, None]
        ys = torch.where(kept, self.experts(torch.where(kept, xs, 0), ends), 0)
        return undo_sort(ys, order, inverse).view(m, k, -1)

    # ----------------------------------------------------------------------------------------- balancer
    def _record(
        self,
        scores: torch.Tensor,
        expert_idx: torch.Tensor,
        rerouted: torch.Tensor | None = None,
        dropped: torch.Tensor | None = None,
    ) -> None:
        """Side outputs and balancer statistics of one forward (skipped when re-run inside backward)."""
        recompute = _in_backward()
        if self.training and self.balancer == "aux_loss":
            loss = self.aux_loss_coef * aux_loss(scores, expert_idx.clamp(min=0), self.n_experts, self.top_k)
            if not recompute:
                self.aux_loss = loss
        elif not recompute:
            self.aux_loss = None
        if recompute:
            return
        load = expert_load(expert_idx, self.n_experts).detach()
        self.last_load = load
        zero = load.new_zeros(())
        self.last_stats = {  # 0-d float32 tensors: no host sync in the forward
            "tokens": torch.full((), float(scores.shape[0]), device=load.device),
            "rerouted": zero if rerouted is None else rerouted.float(),
            "dropped": zero if dropped is None else dropped.float(),
            "entropy": router_entropy(scores),
        }
        if not self.training or not (self._balances or self._quantile_capacity):
            return
        fresh = {}
        if self._quantile_capacity:  # who would choose each expert without the limit, and with what score
            fresh["choosers"] = chooser_score_histogram(scores.detach(), self.expert_bias, self.top_k, HIST_BINS)
            fresh["m"] = torch.full((), scores.shape[0], dtype=torch.int64, device=scores.device)
        if self.balancer == "quantile":
            fresh["scores"] = scores.detach().float()
        elif self.balancer == "quantile_hist":
            if self._hist_range is None:  # fixed for the whole step: the bias does not change within it
                self._hist_range = _hist_range(self.expert_bias)
            fresh["hist"] = required_bias_histogram(scores.detach(), self.expert_bias, self.top_k,
                                                    *self._hist_range, HIST_BINS)
        elif self.balancer == "aux_free":
            fresh["load"] = load
        if torch.compiler.is_compiling():  # one slot, overwritten: no guard on how many micro-batches came before
            if self._fresh is not None:
                self._overwritten = True
            self._fresh = fresh
        else:
            self._add_pending(fresh)

    def collect_balancer_stats(self) -> None:
        """Add the statistics a compiled forward left behind to the optimizer step's pending statistics.

        A compiled training forward writes its micro-batch's statistics to one slot rather than appending to the
        step's (which would compile the layer anew for every micro-batch of a step); this moves them, copied,
        since under CUDA graphs the next replay of the forward reuses their memory. Call it after every training
        forward of a step with several micro-batches (:class:`k3lit.train.module.K3LitModule` does);
        :meth:`update_balancer` calls it for the last one. Eager forwards add their statistics themselves.
        """
        if self._overwritten:
            self._overwritten = False
            warnings.warn("MoE: a compiled training forward ran before the previous one's balancer statistics were "
                          "collected, so that micro-batch is missing from this optimizer step's update; call "
                          "collect_balancer_stats() after each forward (K3LitModule does)", stacklevel=2)
        fresh, self._fresh = self._fresh, None
        if fresh is not None:
            self._add_pending({key: value.clone() for key, value in fresh.items()})

    def _add_pending(self, fresh: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's statistics (``_record``'s ``fresh``) to the step's pending ones."""
        if "choosers" in fresh:
            first = self._pending_choosers is None
            self._pending_choosers = fresh["choosers"] if first else self._pending_choosers + fresh["choosers"]
            self._pending_m = fresh["m"] if first else self._pending_m + fresh["m"]
        if "scores" in fresh:
            self._pending_scores.append(fresh["scores"])
        if "hist" in fresh:
            self._pending_hist = fresh["hist"] if self._pending_hist is None else self._pending_hist + fresh["hist"]
        if "load" in fresh:
            self._pending_load = fresh["load"] if self._pending_load is None else self._pending_load + fresh["load"]
        self._pending_batches += 1
        if self._pending_batches > _PENDING_WARN and not self._warned:
            self._warned = True
            warnings.warn(
                f"MoE: {self._pending_batches} training forwards without update_balancer(); call it once per "
                "optimizer step (K3LitModule does) or use eval mode, else the balancer statistics keep growing",
                stacklevel=3,
            )

    @property
    def _balances(self) -> bool:
        """Whether the balancer moves the bias (quantile, quantile_hist, aux_free)."""
        return self.balancer in ("quantile", "quantile_hist", "aux_free")

    @property
    def _quantile_capacity(self) -> bool:
        """Whether routing is limited by the running score threshold (``capacity_mode="quantile"``)."""
        return self.capacity_factor is not None and self.capacity_mode == "quantile"

    @property
    def pending_tokens(self) -> int:
        """Tokens recorded since the last :meth:`update_balancer` (balancers that move the bias, and the
        quantile capacity mode); collects a compiled forward's statistics first (:meth:`collect_balancer_stats`)."""
        self.collect_balancer_stats()
        if self.balancer == "quantile":
            return sum(s.shape[0] for s in self._pending_scores)
        if self.balancer == "quantile_hist":
            return 0 if self._pending_hist is None else int(self._pending_hist[0].sum())
        if self.balancer == "aux_free":
            return 0 if self._pending_load is None else round(self._pending_load.sum().item() / self.top_k)
        return 0 if self._pending_m is None else int(self._pending_m)

    def reset_balancer_stats(self) -> None:
        """Drop the statistics recorded since the last update (e.g. after a skipped optimizer step)."""
        self._pending_scores, self._pending_load, self._pending_batches = [], None, 0
        self._pending_hist, self._hist_range = None, None
        self._pending_choosers, self._pending_m = None, None
        self._fresh, self._overwritten = None, False

    @torch.no_grad()
    def update_balancer(self) -> None:
        """Set the bias (and capacity threshold) for the next optimizer step from every micro-batch recorded in
        this one.

        Call exactly once per optimizer step, after the last micro-batch's forward, on every rank of
        :attr:`process_group`. A no-op for the ``aux_loss`` and ``none`` balancers without the quantile
        capacity mode, and when nothing was recorded (single process). The bias of ``quantile`` and
        ``quantile_hist`` moves by ``quantile_rate`` towards the step's estimate (:func:`sliding_average`).
        Communication per call with ``sync_every=None``: ``quantile`` gathers every score row;
        ``quantile_hist`` all-reduces ``n · HIST_BINS`` int64 counts (one call); ``aux_free`` all-reduces
        ``n`` loads; the quantile capacity mode all-reduces ``n · HIST_BINS + 1`` int64 counts. With
        ``sync_every=N``: nothing, except one all-reduce of ``2 n`` floats every N-th call.
        """
        if not (self._balances or self._quantile_capacity):
            return
        self.collect_balancer_stats()
        distributed = self._distributed()
        if not distributed and self._pending_batches == 0:
            return
        pooled = distributed and self.sync_every is None  # else: this rank's statistics alone
        new_bias = self._bias_estimate(pooled) if self._balances else None
        new_threshold = self._threshold_estimate(pooled) if self._quantile_capacity else None
        self.reset_balancer_stats()
        if new_bias is not None:
            self._set_bias(new_bias)
        if new_threshold is not None:
            self.capacity_threshold.copy_(sliding_average(self.capacity_threshold, new_threshold, self.quantile_rate))
        self.balancer_step += 1
        if distributed and self.sync_every is not None and int(self.balancer_step) % self.sync_every == 0:
            state = torch.cat([self.expert_bias, self.capacity_threshold])
            dist.all_reduce(state, group=self.process_group)
            state /= dist.get_world_size(self.process_group)
            self.expert_bias.copy_(state[: self.n_experts])
            self.capacity_threshold.copy_(state[self.n_experts:])

    def _distributed(self) -> bool:
        """Whether :attr:`process_group` (the default group when None) spans more than this process."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def _alone_quantile_key(self) -> tuple | None:
        """For an update that is the exact quantile of this process's own recorded scores (``quantile`` balancer, one
        process, no quantile capacity mode, a float32 bias): what must match for layers to share one batched
        quantile (:func:`update_balancers`); None for any other update."""
        if (self.balancer != "quantile" or self._quantile_capacity or not self._pending_scores
                or self.expert_bias.dtype != torch.float32 or self._distributed()):
            return None
        rows = sum(s.shape[0] for s in self._pending_scores)
        return self.n_experts, self.top_k, self.quantile_rate, rows, self.expert_bias.device

    def _bias_estimate(self, pooled: bool) -> torch.Tensor | None:
        """The next bias from the recorded statistics (this rank's, or every rank's when ``pooled``); None: keep."""
        device = self.expert_bias.device
        if self.balancer == "quantile":
            if not self._pending_scores and not pooled:
                return None
            scores = (torch.cat(self._pending_scores).to(device) if self._pending_scores
                      else torch.zeros(0, self.n_experts, device=device))
            if pooled:
                scores = _all_gather_rows(scores, self.process_group)
            if not scores.shape[0]:
                return None
            return sliding_average(self.expert_bias, quantile_bias(scores, self.expert_bias, self.top_k),
                                   self.quantile_rate)
        if self.balancer == "quantile_hist":
            if self._pending_hist is None and not pooled:
                return None
            counts = (torch.zeros(self.n_experts, HIST_BINS, dtype=torch.int64, device=device)
                      if self._pending_hist is None else self._pending_hist.to(device))
            if pooled:  # every rank must agree on the bin range: it derives from the shared bias
                dist.all_reduce(counts, group=self.process_group)
            lo, hi = _hist_range(self.expert_bias)
            estimate = quantile_bias_from_histogram(counts, lo, hi, self.top_k)
            # no tokens anywhere: keep the bias (and no host sync)
            return torch.where(counts[0].sum() > 0, sliding_average(self.expert_bias, estimate, self.quantile_rate),
                               self.expert_bias)
        if self._pending_load is None and not pooled:
            return None
        load = torch.zeros(self.n_experts, device=device) if self._pending_load is None else self._pending_load
        if pooled:
            load = load.clone()
            dist.all_reduce(load, group=self.process_group)
        return torch.where(load.sum() > 0, sign_bias_update(self.expert_bias, load, self.bias_update_rate),
                           self.expert_bias)

    def _threshold_estimate(self, pooled: bool) -> torch.Tensor | None:
        """The step's capacity threshold: the score above which ``cf · m k / n`` of the recorded tokens chose
        each expert (:func:`capacity_threshold_from_histogram`); None: nothing recorded, keep the running one."""
        if self._pending_choosers is None and not pooled:
            return None
        device = self.capacity_threshold.device
        counts = torch.zeros(self.n_experts * HIST_BINS + 1, dtype=torch.int64, device=device)
        if self._pending_choosers is not None:
            counts = torch.cat([self._pending_choosers.reshape(-1), self._pending_m.reshape(1)]).to(device)
        if pooled:
            dist.all_reduce(counts, group=self.process_group)
        m = counts[-1].double()
        estimate = capacity_threshold_from_histogram(counts[:-1].view(self.n_experts, HIST_BINS),
                                                     self.capacity_factor * m * self.top_k / self.n_experts)
        return torch.where(m > 0, estimate, self.capacity_threshold)

    def _set_bias(self, new_bias: torch.Tensor) -> None:
        if self.expert_bias.dtype == torch.float32:
            self.expert_bias.copy_(new_bias)
        else:  # something cast the buffer behind our back (e.g. an FSDP buffer_dtype): take it back to float32
            self._buffers["expert_bias"] = new_bias.float().to(self.expert_bias.device)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        """A state dict written before the running-quantile buffers existed loads with their start values (no
        threshold, step 0): the same state a fresh layer starts from."""
        for name in ("capacity_threshold", "balancer_step"):
            state_dict.setdefault(prefix + name, torch.zeros_like(getattr(self, name)))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001
        """Keep ``expert_bias`` and ``capacity_threshold`` float32 through ``.to(dtype)``, ``.half()`` etc.,
        following only the device.

        The original float32 tensors are re-placed (not cast back), so no precision is lost.
        """
        kept = {name: self._buffers[name] for name in _FLOAT32_BUFFERS}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            moved = self._buffers[name]
            if moved.dtype != torch.float32:
                self._buffers[name] = tensor.to(device=moved.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, n_experts={self.n_experts}, top_k={self.top_k}, expert_dim={self.expert_dim}, "
            f"n_shared_experts={self.n_shared_experts}, balancer={self.balancer!r}, "
            f"capacity_factor={self.capacity_factor}, capacity_mode={self.capacity_mode!r}, "
            f"quantile_rate={self.quantile_rate}, sync_every={self.sync_every}"
        )


def _hist_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bin range ``[min(b) - 1, max(b) + 1]`` of the required bias ``alpha_i - s_ij`` (``s ∈ (0, 1)``), as 0-d
    float32 tensors: identical on every rank, since the bias is."""
    b = bias.detach().float()
    return b.min() - 1.0, b.max() + 1.0


def _all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate ``[m_r, n]`` tensors of different lengths from every rank (rank order)."""
    world = dist.get_world_size(group)
    rows = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(sizes, rows, group=group)
    sizes = [int(s) for s in sizes]
    padded = t.new_zeros(max(sizes), t.shape[1])
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)])


def update_balancers(model: nn.Module | Iterable[MoE]) -> None:
    """:meth:`MoE.update_balancer` for every MoE inside ``model`` (a module, or the MoE layers themselves), once per
    optimizer step.

    Layers whose update is the exact quantile of this process's own scores (``quantile`` balancer, one process,
    the same experts, k, rate and recorded tokens) are updated together: :func:`k3lit.ops.routing.quantile_bias`
    over their stacked ``[L, m, n]`` scores, one top-k and one sort for all of them, and one multi-tensor copy of
    the biases. Each layer gets the bias its own update gives (``tests/nn/test_balancers_together.py``), and the
    host issues far fewer operators: 36 instead of 253 for 11 layers of two micro-batches each (``small`` has 11).
    Every other layer updates on its own, in order.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)] if isinstance(model, nn.Module) else list(model)
    for moe in layers:
        moe.collect_balancer_stats()
    together: dict[tuple, list[MoE]] = {}
    for moe in layers:
        key = moe._alone_quantile_key()
        if key is None:
            moe.update_balancer()
        else:
            together.setdefault(key, []).append(moe)
    for group in together.values():
        if len(group) == 1:
            group[0].update_balancer()
        else:
            _update_quantile_together(group)


@torch.no_grad()
def _update_quantile_together(layers: list[MoE]) -> None:
    """:meth:`MoE.update_balancer` of layers with equal :meth:`MoE._alone_quantile_key`, as one batched quantile."""
    bias = torch.stack([m.expert_bias for m in layers])  # [L, n]
    scores = torch.stack([torch.cat(m._pending_scores) for m in layers]).to(bias.device)  # [L, m, n]
    new_bias = sliding_average(bias, quantile_bias(scores, bias, layers[0].top_k), layers[0].quantile_rate)
    torch._foreach_copy_([m.expert_bias for m in layers], list(new_bias.unbind(0)))
    torch._foreach_add_([m.balancer_step for m in layers], 1)
    for m in layers:
        m.reset_balancer_stats()
