"""K3LM: a hybrid KDA / softmax-attention language model with MoE and attention residuals.

Reads top-down: ``ModelConfig`` → ``K3LM`` (embedding, sublayers joined by the residual rule, norm, head)
→ ``Sublayer`` (pre-norm + one token mixer or channel mixer). Single device; parallelism lives in
``k3lit.parallel``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from k3lit.nn.attention import SoftmaxAttention
from k3lit.nn.attn_res import AttnResMixer, BlockResidualStream, block_read
from k3lit.nn.documents import Documents
from k3lit.nn.kda import KimiDeltaAttention
from k3lit.nn.mlp import SwiGLU
from k3lit.nn.moe import CAPACITY_MODES, MoE
from k3lit.nn.norm import RMSNorm
from k3lit.ops.kda import check_gate_bound, largest_safe_chunk
from k3lit.ops.routing import capacity_tokens

LAYER_TYPES = {"K": "KDA", "A": "softmax attention"}
RESIDUALS = ("plain", "block_attnres", "full_attnres")
CHECKPOINTING = ("none", "layer", "block", "selective")
# Ops whose outputs the selective policy keeps: the matrix products; everything elementwise is recomputed.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}
BALANCERS = ("quantile", "quantile_hist", "aux_free", "aux_loss", "none")
# ModelConfig fields a run may change when it loads a checkpoint (``--ckpt_path``): how the same function is
# computed (recomputation, KDA implementation), the balancers' training knobs, and how the softmax-attention layers
# read beyond the training length (window, log-n scaling: no change below it). Every other field shapes the
# parameters and buffers or what the trained weights compute, so it is taken from the checkpoint.
RUNTIME_FIELDS = ("activation_checkpointing", "checkpoint_blocks", "kda_backend", "bias_update_rate", "aux_loss_coef",
                  "capacity_factor", "capacity_mode", "quantile_rate", "balancer_sync_every", "document_masking",
                  "eos_id", "attn_window", "attn_logn_base")


@dataclass
class ModelConfig:
    """Architecture of a K3LM. Every field is a recipe key (``--model.<field>=...`` on the CLI).

    Attributes:
        vocab_size: tokenizer vocabulary; None takes it from the data module.
        dim: model width D.
        n_layers: number of layers; each has a token-mixer and a channel-mixer sublayer.
        layer_pattern: token mixer per layer, repeated cyclically: ``K`` = KDA, ``A`` = softmax attention,
            e.g. ``KKKA`` = three KDA layers then one attention layer.
        n_heads, head_dim: heads and per-head width of both token mixers (KDA uses K = V = head_dim).
        rope_theta: positional encoding of the softmax-attention layers: None = none (NoPE, as in Kimi Linear's
            hybrid, where KDA and its short convolutions carry position); a base > 0 = rotary embeddings
            (10000 as in Llama 2), for transformers without KDA layers.
        attn_window: None, or W >= 1: each softmax-attention layer attends to the last W tokens only (a sliding
            window, the token itself included); KDA layers still read the whole sequence. With W the training
            length, a model reads longer sequences through attention spans it trained on, and decoding keeps a
            key/value cache of W - 1 positions.
        attn_logn_base: None, or n0 >= 2: log-n scaling of the softmax-attention queries, ``max(1, ln(p + 1) /
            ln(n0))`` at position p (0-based), so that the attention logits grow with the log of the number of
            keys beyond n0 and the softmax does not flatten over more keys than it saw in training (n0: the
            training length; 1 at every shorter position, so training at n0 is unchanged).
        kda_g_min: lower bound of KDA's log-decay, ``g = g_min * sigmoid(.)``.
        kda_backend: ``auto`` | ``torch`` | ``triton`` | ``reference``.
        mlp_hidden: hidden width of the dense SwiGLU channel mixer.
        n_experts: experts per MoE layer; 0 makes every channel mixer dense.
        first_dense_layers: the first layers keep a dense SwiGLU even when n_experts > 0.
        top_k, expert_dim, n_shared_experts: routed experts per token, expert hidden width, shared experts.
        balancer: ``quantile`` (K3 quantile balancing, exact pooled quantile), ``quantile_hist`` (the same by
            the 1000-bin histogram estimator: one all-reduce per layer per step, for large runs),
            ``aux_free`` (sign bias), ``aux_loss``, ``none``.
        bias_update_rate: step size u of the ``aux_free`` sign-bias update.
        aux_loss_coef: α of the ``aux_loss`` balancer.
        capacity_factor: None (no limit) or cf > 0: an expert's capacity is ``cf · m k / n`` of m tokens;
            overflow is re-routed to the next candidate with room, else dropped.
        capacity_mode: ``forward``: each expert takes at most ``ceil(cf · m k / n)`` tokens of a micro-batch
            (per rank), so a token's routing depends on the later tokens of its sequence; ``causal``: the same
            count with tokens admitted in position order, so it depends on earlier positions only; ``quantile``:
            each expert admits only tokens whose score reaches its running threshold, the score above which
            ``cf · m k / n`` of a step's tokens chose it (estimated from earlier steps: routing stays causal).
        quantile_rate: ρ ∈ (0, 1], rate of the sliding-average quantile: every optimizer step moves the bias
            of ``quantile`` / ``quantile_hist`` (and the ``quantile`` capacity threshold) by ρ towards that
            step's estimate, an average over about 1/ρ steps; 1 = the one-step estimate.
        balancer_sync_every: None (every step pools the balancer statistics of all ranks) or N >= 1 (each rank
            estimates from its own tokens; the ranks' running estimates are averaged every N steps).
        residual: ``plain`` (x + f(x)), ``block_attnres`` or ``full_attnres``.
        attnres_block_size: sublayers per block for ``block_attnres`` (2 sublayers = 1 transformer layer).
        activation_checkpointing: ``none``; ``layer`` (recompute each sublayer); ``block`` (keep only the
            residual state at block boundaries, i.e. the AttnRes block summaries, and recompute every sublayer
            of a block of ``attnres_block_size`` sublayers; for Full AttnRes and the plain residual the same
            grouping of sublayers is used; the last block is not recomputed: backward consumes its activations
            first, so they are kept from the forward, which adds one block's activations to the memory held
            at the loss); ``selective`` (per sublayer, keep matrix-product outputs and recompute the
            elementwise work). ``block`` recomputes with the reentrant checkpoint (its forward runs without
            autograd bookkeeping: much less host time than the non-reentrant one) unless an MoE uses the
            ``aux_loss`` balancer, whose loss needs the forward's graph.
        checkpoint_blocks: with ``block``, recompute only the first N segments and keep the activations of the
            rest (as Megatron-LM's ``recompute_num_layers``): each kept segment adds one segment's activations to
            the memory and saves its recomputation (about F / (F + B) of its share of the step). None: every
            segment but the last. Must lie in ``[0, segments - 1]``, segments = ceil(2 n_layers /
            attnres_block_size).
        document_masking: in the training forward (training, validation, ``k3lit positions``) a token sees only
            its own document of the packed sequence: softmax attention masks the others, KDA's state and short
            convolution restart at each document (:mod:`k3lit.nn.documents`). Off (default): they run across
            document boundaries. Prefill and decoding take one document and are unaffected.
        eos_id: the end-of-document token that ``document_masking`` splits at; None takes it from the data module.
        tie_embeddings: share the embedding and LM-head weights.
        norm_eps: RMSNorm epsilon.
        init_std: standard deviation of the normal weight init.
    """

    vocab_size: int | None = None
    dim: int = 256
    n_layers: int = 4
    layer_pattern: str = "KKKA"
    n_heads: int = 4
    head_dim: int = 64
    rope_theta: float | None = None
    attn_window: int | None = None
    attn_logn_base: int | None = None
    kda_g_min: float = -5.0
    kda_backend: str = "auto"
    mlp_hidden: int = 768
    n_experts: int = 0
    first_dense_layers: int = 1
    top_k: int = 2
    expert_dim: int = 256
    n_shared_experts: int = 0
    balancer: str = "quantile"
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 1e-2
    capacity_factor: float | None = None
    capacity_mode: str = "forward"
    quantile_rate: float = 1.0
    balancer_sync_every: int | None = None
    residual: str = "block_attnres"
    attnres_block_size: int = 4
    activation_checkpointing: str = "none"
    checkpoint_blocks: int | None = None
    document_masking: bool = False
    eos_id: int | None = None
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def __post_init__(self) -> None:
        def bad(field: str, fix: str) -> ValueError:
            return ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {fix}")

        if self.vocab_size is not None and self.vocab_size < 2:
            raise bad("vocab_size", "needs at least 2 tokens (or None to take it from the data module)")
        for field in ("dim", "n_layers", "n_heads", "head_dim", "mlp_hidden"):
            if getattr(self, field) < 1:
                raise bad(field, "must be a positive integer")
        if self.eos_id is not None and not 0 <= self.eos_id < (self.vocab_size or self.eos_id + 1):
            raise bad("eos_id", f"must be a token id in [0, vocab_size={self.vocab_size})")
        if self.rope_theta is not None and not (self.rope_theta > 0 and self.head_dim % 2 == 0):
            raise bad("rope_theta", f"rotary embeddings need a base > 0 and an even head_dim (got {self.head_dim}); "
                                    "None turns them off")
        if self.attn_window is not None and self.attn_window < 1:
            raise bad("attn_window", "must be >= 1 token (e.g. the training seq_len), or null for full attention")
        if self.attn_logn_base is not None and self.attn_logn_base < 2:
            raise bad("attn_logn_base", "must be >= 2 positions (e.g. the training seq_len), or null for no scaling")
        if not self.layer_pattern or set(self.layer_pattern) - set(LAYER_TYPES):
            raise bad("layer_pattern", f"use only the letters {sorted(LAYER_TYPES)} (K = KDA, A = softmax attention)")
        try:
            check_gate_bound(self.kda_g_min, largest_safe_chunk(self.kda_g_min))
        except ValueError as e:
            raise bad("kda_g_min", str(e)) from None
        if self.kda_backend not in ("auto", "torch", "triton", "reference"):
            raise bad("kda_backend", "choose auto, torch, triton or reference")
        if self.n_experts < 0:
            raise bad("n_experts", "must be >= 0 (0 = dense channel mixers everywhere)")
        if self.n_experts:
            if not 1 <= self.top_k <= self.n_experts:
                raise bad("top_k", f"must lie in [1, n_experts={self.n_experts}]")
            if self.top_k == self.n_experts and self.balancer in ("quantile", "quantile_hist"):
                raise bad("top_k", "quantile balancing needs top_k < n_experts (it reads the (k+1)-th score)")
            if self.expert_dim < 1:
                raise bad("expert_dim", "must be a positive integer")
            if self.n_shared_experts < 0:
                raise bad("n_shared_experts", "must be >= 0")
        if not 0 <= self.first_dense_layers <= self.n_layers:
            raise bad("first_dense_layers", f"must lie in [0, n_layers={self.n_layers}]")
        if self.balancer not in BALANCERS:
            raise bad("balancer", f"choose one of {BALANCERS}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise bad("capacity_factor", "must be > 0 (e.g. 1.25), or null for no capacity limit")
        if self.capacity_mode not in CAPACITY_MODES:
            raise bad("capacity_mode", f"choose one of {CAPACITY_MODES}")
        if not 0 < self.quantile_rate <= 1:
            raise bad("quantile_rate", "must lie in (0, 1] (1 = the one-step quantile, 0.1 = a ~10-step average)")
        if self.balancer_sync_every is not None and self.balancer_sync_every < 1:
            raise bad("balancer_sync_every", "must be >= 1, or null to pool every rank's statistics every step")
        if self.residual not in RESIDUALS:
            raise bad("residual", f"choose one of {RESIDUALS}")
        if self.attnres_block_size < 1:
            raise bad("attnres_block_size", "must count at least 1 sublayer")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise bad("activation_checkpointing", f"choose one of {CHECKPOINTING}")
        if self.checkpoint_blocks is not None:
            if self.activation_checkpointing != "block":
                raise bad("checkpoint_blocks", "only applies to activation_checkpointing=block (or set it to null)")
            segments = -(-2 * self.n_layers // self.attnres_block_size)
            if not 0 <= self.checkpoint_blocks <= segments - 1:
                raise bad("checkpoint_blocks", f"must lie in [0, {segments - 1}]: {segments} segments of "
                          f"attnres_block_size={self.attnres_block_size} sublayers, the last is never recomputed")

    def mixer_type(self, layer: int) -> str:
        """``K`` or ``A`` for layer ``layer`` (the pattern repeats)."""
        return self.layer_pattern[layer % len(self.layer_pattern)]

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s channel mixer is an MoE."""
        return self.n_experts > 0 and layer >= self.first_dense_layers

    def causal_capacity(self, tokens: int) -> int | None:
        """Tokens each expert of an MoE layer takes from a forward of ``tokens`` tokens under causal capacity
        routing (:func:`k3lit.ops.routing.capacity_tokens`); None when the model routes otherwise or has no MoE."""
        if self.capacity_factor is None or self.capacity_mode != "causal" or not self.n_experts:
            return None
        return capacity_tokens(self.capacity_factor, tokens, self.top_k, self.n_experts)


class Sublayer(nn.Module):
    """Pre-norm wrapper of one token or channel mixer, plus its AttnRes read when the residual uses one."""

    def __init__(self, op: nn.Module, dim: int, eps: float, attn_res: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps=eps)
        self.op = op
        self.res_mixer = AttnResMixer(dim, eps) if attn_res else None

    @property
    def is_token_mixer(self) -> bool:
        return isinstance(self.op, KimiDeltaAttention | SoftmaxAttention)

    def forward(
        self, h: torch.Tensor, state: Any = None, return_state: bool = False, docs: Documents | None = None
    ) -> tuple[torch.Tensor, Any]:
        if self.is_token_mixer:
            return self.op(self.norm(h), state, return_state, docs)
        return self.op(self.norm(h)), None


class K3LM(nn.Module):
    """The language model: ``forward(idx [B, T] int64) -> (logits [B, T, vocab] , states | None)``.

    ``states`` is a list (one entry per sublayer, None for channel mixers) of KDA states and key/value
    caches; pass it back with the next tokens to continue a sequence (prefill, then decoding).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size is None: set it, or let the data module provide it")
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        attn_res = c.residual != "plain"
        sublayers = []
        for layer in range(c.n_layers):
            if c.mixer_type(layer) == "K":
                mixer = KimiDeltaAttention(c.dim, c.n_heads, c.head_dim, c.kda_g_min, backend=c.kda_backend,
                                           norm_eps=c.norm_eps)
            else:
                mixer = SoftmaxAttention(c.dim, c.n_heads, c.head_dim, norm_eps=c.norm_eps, rope_theta=c.rope_theta,
                                         window=c.attn_window, logn_base=c.attn_logn_base)
            if c.is_moe(layer):
                channel = MoE(c.dim, c.n_experts, c.top_k, c.expert_dim, c.n_shared_experts, c.balancer,
                              c.bias_update_rate, c.aux_loss_coef, c.capacity_factor, c.quantile_rate,
                              c.balancer_sync_every, c.capacity_mode)
            else:
                channel = SwiGLU(c.dim, c.mlp_hidden)
            sublayers += [Sublayer(mixer, c.dim, c.norm_eps, attn_res), Sublayer(channel, c.dim, c.norm_eps, attn_res)]
        self.sublayers = nn.ModuleList(sublayers)
        self._moe_layers: list[MoE] | None = None
        self.final_res_mixer = AttnResMixer(c.dim, c.norm_eps) if attn_res else None
        self.norm = RMSNorm(c.dim, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def block_size(self) -> int:
        """Sublayers per AttnRes block (1 for Full AttnRes)."""
        return 1 if self.config.residual == "full_attnres" else self.config.attnres_block_size

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for linear and embedding weights (a tied LM head keeps the embedding's draw),
        output projections and the experts' ``w_down`` scaled by 1/sqrt(2 L), zero linear biases and
        ``expert_bias``. Other parameters keep what their own modules' ``reset_parameters`` gave them (see
        :meth:`init_weights`)."""
        std = self.config.init_std
        out_std = std / (2 * self.config.n_layers) ** 0.5
        for name, m in self.named_modules():
            if m is self.lm_head and self.lm_head.weight is self.embed.weight:
                continue
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=out_std if name.endswith(("o_proj", "w_down")) else std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, MoE):  # stacked expert weights are plain parameters, not nn.Linear
                m.reset_parameters(std=std, down_std=out_std)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place, e.g. after ``to_empty`` of a model built on the meta
        device (and sharded): re-tie the LM head to the embedding if configured, run each module's own
        ``reset_parameters`` in the order construction runs them (children before their parent: depth-first
        post-order), then :meth:`reset_parameters`.

        Replaying construction's random draws in construction's order gives, from the same generator state,
        bit for bit the weights of ``K3LM(config)`` (on one device, plain tensors). On FSDP2 / expert-parallel
        DTensor shards each rank initialises only its local shards (``nn.init`` runs on DTensors); use
        :func:`k3lit.parallel.init_sharded`, which also gives each shard its own random numbers on CPU meshes.

        Zeros: AttnRes pseudo-queries, KDA gate biases, linear biases, ``expert_bias``; ones: norm weights;
        U(±1/sqrt(W)): short-conv kernels; normal: linear, embedding and expert weights (see
        :meth:`reset_parameters`).
        """
        if self.config.tie_embeddings:  # to_empty of plain meta tensors unties them (one new Parameter each)
            self.lm_head.weight = self.embed.weight
        for m in _post_order(self):
            if m is not self and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        self.reset_parameters()

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile`` (arguments as ``torch.compile``'s), the whole model as one graph, activation
        checkpointing included: dynamo is set (a process-wide setting) to keep the side effects of a checkpointed
        forward (the MoE layers' balancer statistics) out of its recomputation, as eager mode does (the MoE skips
        recording while autograd recomputes), instead of breaking the graph at every checkpointed segment; and AOT
        autograd's cache (a process-wide setting) is allowed to keep the graph although it holds a custom
        ``autograd.Function``."""
        _compile_settings()
        super().compile(*args, **kwargs)

    def compile_sublayers(self, **kwargs: Any) -> None:
        """``compile(**kwargs)`` on every sublayer in place (regional compilation: sublayers of one kind share their
        compiled code, so a model compiles a handful of graphs whatever its depth), with :meth:`compile`'s
        process-wide settings. The embedding, the residual (the AttnRes depth mixes between sublayers) and the head
        run eagerly."""
        _compile_settings()
        for sub in self.sublayers:
            sub.compile(**kwargs)

    def moe_layers(self) -> list[MoE]:
        """The MoE modules in depth order (found once: the training step asks several times)."""
        if self._moe_layers is None:
            self._moe_layers = [m for m in self.modules() if isinstance(m, MoE)]
        return self._moe_layers

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the auxiliary balancing losses of the latest forward (``aux_loss`` balancer), else None."""
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    def forward(
        self, idx: torch.Tensor, states: list[Any] | None = None, return_state: bool = False
    ) -> tuple[torch.Tensor, list[Any] | None]:
        x = self.embed(idx)  # [B, T, D]
        if return_state or states is not None:  # prefill / decoding: no recomputation, states threaded through
            h, new_states = self._forward_with_states(x, states or [None] * len(self.sublayers))
        else:
            h, new_states = self._forward_train(x, self.documents(idx)), None
        return self.lm_head(self.norm(h)), new_states  # [B, T, vocab]

    def documents(self, idx: torch.Tensor) -> Documents | None:
        """The documents of ``idx [B, T]`` under ``document_masking`` (None without it).

        Raises:
            ValueError: ``document_masking`` without an ``eos_id``.
        """
        if not self.config.document_masking:
            return None
        if self.config.eos_id is None:
            raise ValueError("ModelConfig.document_masking needs eos_id: set model.eos_id, or let the data module "
                             "provide it (k3lit fit does)")
        return Documents.from_tokens(idx, self.config.eos_id)

    def final_hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The LM head's input for ``idx`` (int64 ``[B, T]``): the final normalised hidden states ``[B, T, dim]`` of
        the training forward (no states), so that ``forward(idx)[0] == lm_head(final_hidden(idx))``. For callers
        that apply the head to a few positions at a time (a long sequence's ``[T, vocab]`` logits at once may not
        fit in memory)."""
        return self.norm(self._forward_train(self.embed(idx), self.documents(idx)))

    def _forward_with_states(self, x: torch.Tensor, states: list[Any]) -> tuple[torch.Tensor, list[Any]]:
        new_states = []
        if self.config.residual == "plain":
            h = x
            for sub, st in zip(self.sublayers, states):
                out, st = sub(h, st, True)
                h = h + out
                new_states.append(st)
            return h, new_states
        # Two-phase AttnRes: at each block start, one read of the completed summaries for all of the block's
        # sublayers (phase 1); each sublayer then merges in the running partial sum (phase 2).
        stream = BlockResidualStream([x], self.block_size, self.config.norm_eps)
        subs = list(self.sublayers)
        for sub, st, read in zip(subs, states, stream.reads([s.res_mixer for s in subs])):
            out, st = sub(block_read(stream.eps, *read), st, True)
            stream.add(out)
            new_states.append(st)
        return self.final_res_mixer.mix(stream.sources()), new_states

    def _forward_train(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """Training forward in segments of ``attnres_block_size`` sublayers (one residual block for
        block_attnres). The segmentation is the same under every checkpoint policy, and so is the autograd
        graph's grouping of gradient sums: a segment's inputs receive the sum of the segment's own
        contributions as one term (a reentrant checkpoint's node makes that sum; elsewhere :class:`_Group`
        does), so every floating-point sum is the same; only what is saved for backward differs."""
        policy = self.config.activation_checkpointing
        mode = _checkpoint_mode(policy, self.moe_layers())
        per_sublayer = partial(_checkpointed, mode) if policy in ("layer", "selective") else None
        step = self.config.attnres_block_size
        segments = [list(self.sublayers)[i : i + step] for i in range(0, len(self.sublayers), step)]
        # the last segment is never recomputed: its activations are the first that backward needs
        n_ckpt = len(segments) - 1 if self.config.checkpoint_blocks is None else self.config.checkpoint_blocks
        runs = [partial(_checkpointed_segment, mode) if policy == "block" and j < n_ckpt else _grouped
                for j in range(len(segments))]
        if self.config.residual == "plain":
            h = x
            for seg, run in zip(segments, runs):
                (h,) = run(partial(_plain_segment, seg, per_sublayer, docs), h)
            return h
        # Only the residual state crosses a segment boundary: the block summaries and the partial sum; for
        # block_attnres a segment is exactly one block, so that is the summaries alone.
        eps, size = self.config.norm_eps, self.block_size
        blocks, part, n_in = [x], None, 0
        for seg, run in zip(segments, runs):
            fn = partial(_attnres_segment, seg, size, eps, n_in, part is not None, per_sublayer, docs)
            out = run(fn, *blocks, *([part] if part is not None else []))
            closed = (n_in + len(seg)) // size
            blocks += list(out[:closed])
            part = out[closed] if len(out) > closed else None
            n_in = (n_in + len(seg)) % size
        return self.final_res_mixer.mix(BlockResidualStream(blocks, size, eps, part, n_in).sources())

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        timings: dict[str, float] | None = None,
        compile_decode: bool | str = False,
    ) -> torch.Tensor:
        """Sample continuations: prefill the prompt once, then decode one token at a time from the recurrent
        KDA states and the attention key/value caches.

        Args:
            idx: ``[B, T0]`` int64 prompt tokens (T0 >= 1).
            max_new_tokens: tokens to append.
            temperature: softmax temperature; 0 means greedy (argmax).
            top_k: keep only the k most likely tokens before sampling.
            generator: RNG for reproducible sampling.
            timings: if given, filled with ``prefill_s`` and ``decode_s``, wall seconds of the prompt's forward and
                of the decoding loop (the device synchronised at each end: for measurements, not for serving).
            compile_decode: run each decoding step through ``torch.compile(self, dynamic=True)`` (True: inductor;
                a string: that backend): one graph whose key/value cache length is symbolic, so the growing caches
                do not recompile it, and whose elementwise work (residual mixing, norms, routing) fuses into far
                fewer kernels than the eager step launches. The first steps compile; the prefill stays eager. The
                compiled module is kept for later calls.

        Returns:
            ``[B, T0 + max_new_tokens]`` int64.
        """
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"prompt must be [B, T0] with T0 >= 1, got {tuple(idx.shape)}")
        check_sampling(max_new_tokens, temperature, top_k)
        clock = _SyncedClock(idx.device) if timings is not None else None
        logits, states = self(idx, return_state=True)
        if clock:
            timings["prefill_s"] = clock.lap()
        out = [idx]
        step = self._decode_step(compile_decode)
        for _ in range(max_new_tokens):
            nxt = sample_next(logits[:, -1].float(), temperature, top_k, generator)  # [B, 1]
            out.append(nxt)
            logits, states = step(nxt, states)
        if clock:
            timings["decode_s"] = clock.lap()
        return torch.cat(out, dim=1)

    def _decode_step(self, compile_decode: bool | str) -> Callable[..., tuple[torch.Tensor, list[Any] | None]]:
        """The module itself, or (``compile_decode``) its compiled form for that backend, built once and kept."""
        if not compile_decode:
            return self
        backend = "inductor" if compile_decode is True else compile_decode
        cached = self.__dict__.get("_compiled_decode")  # not a submodule: kept out of state_dict and modules()
        if cached is None or cached[0] != backend:
            cached = (backend, torch.compile(self, dynamic=True, backend=backend))
            self.__dict__["_compiled_decode"] = cached
        return cached[1]


class _SyncedClock:
    """Wall seconds between laps, the device's queued work finished at each lap."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sync()
        self.t = time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def lap(self) -> float:
        self._sync()
        now = time.perf_counter()
        elapsed, self.t = now - self.t, now
        return elapsed


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """``module``'s submodules, each after its children (depth-first post-order), ``module`` last."""
    for child in module.children():
        yield from _post_order(child)
    yield module


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _compile_settings() -> None:
    """What compiling a K3LM needs from dynamo and AOT autograd (process-wide; :meth:`K3LM.compile`)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    # AOT autograd's cache passes over graphs that hold a custom autograd.Function (the segments' _Group) unless
    # told otherwise; the graph it keys on holds the function's traced forward and backward, so a run with
    # filled caches reuses the compiled step instead of tracing its backward again
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True


def _checkpoint_mode(policy: str, moes: list[MoE]) -> str:
    """How :func:`_checkpointed` recomputes under ``policy``: ``selective``; for ``block`` ``reentrant`` (the
    forward runs under ``no_grad``: no autograd nodes and no saved-tensor hooks, the cheapest on the host)
    unless an MoE adds the ``aux_loss`` balancer's loss, a side output that needs the forward's graph;
    ``non_reentrant`` otherwise. ``layer`` stays non-reentrant: a reentrant node per sublayer would sum the
    gradient terms of the sublayer's input (its norm reads it twice) apart from the residual's, other bits
    than ``none``."""
    if policy == "selective":
        return "selective"
    aux = any(m.balancer == "aux_loss" for m in moes)
    return "reentrant" if policy == "block" and not aux else "non_reentrant"


class _Group(torch.autograd.Function):
    """Identity on a segment's input tensors; its backward hands each input the sum of the gradients from
    inside the segment as one term, as a reentrant checkpoint of the segment does. Without it the outer
    graph would add those terms one by one to the ones from other segments: the same sum, other bits."""

    @staticmethod
    def forward(ctx, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        return grads


def _grouped(fn: Any, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn(*args)`` on :class:`_Group`'d inputs (no recomputation)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return fn(*_Group.apply(*args))


def _checkpointed(mode: str, fn: Any, *args: torch.Tensor) -> Any:
    """``fn(*args)`` with activation checkpointing (``mode`` from :func:`_checkpoint_mode`): recompute everything
    in backward, or (``selective``) keep the matrix-product outputs and recompute the rest. Off when no
    gradient is being recorded."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if mode == "selective":
        ctx = partial(create_selective_checkpoint_contexts, _selective_policy)
        return checkpoint(fn, *args, use_reentrant=False, context_fn=ctx)
    return checkpoint(fn, *args, use_reentrant=mode == "reentrant")


def _checkpointed_segment(mode: str, fn: Any, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A whole segment under :func:`_checkpointed`; a non-reentrant checkpoint gets :class:`_Group`'d inputs
    (a reentrant one groups them itself). A segment none of whose inputs needs a gradient (the first one, after
    a frozen embedding) is recomputed non-reentrantly: a reentrant checkpoint's output would not require a
    gradient, and the segment's parameters would silently get none."""
    if mode == "reentrant" and not any(a.requires_grad for a in args):
        mode = "non_reentrant"
    if mode == "reentrant" or not torch.is_grad_enabled():
        return _checkpointed(mode, fn, *args)
    return _checkpointed(mode, fn, *_Group.apply(*args))


def _plain_segment(subs: list[Sublayer], per_sublayer: Any, docs: Documents | None, h: torch.Tensor
                   ) -> tuple[torch.Tensor]:
    for sub in subs:
        out = per_sublayer(lambda t, sub=sub: sub(t, docs=docs)[0], h) if per_sublayer else sub(h, docs=docs)[0]
        h = h + out
    return (h,)


def _read_and_apply(sub: Sublayer, eps: float, docs: Documents | None, *read: torch.Tensor) -> torch.Tensor:
    """``sub``'s output from its two-phase read (:meth:`BlockResidualStream.reads`)."""
    return sub(block_read(eps, *read), docs=docs)[0]


def _attnres_segment(
    subs: list[Sublayer],
    block_size: int,
    eps: float,
    n_in_block: int,
    has_partial: bool,
    per_sublayer: Any,
    docs: Documents | None,
    *state: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Run consecutive sublayers from a residual state ``(*blocks, partial?)``; return the blocks they closed
    and the new partial sum (if the last block is still open)."""
    blocks = list(state[:-1] if has_partial else state)
    stream = BlockResidualStream(blocks, block_size, eps, state[-1] if has_partial else None, n_in_block)
    for sub, read in zip(subs, stream.reads([s.res_mixer for s in subs])):
        if per_sublayer:
            stream.add(per_sublayer(partial(_read_and_apply, sub, eps, docs), *read))
        else:
            stream.add(_read_and_apply(sub, eps, docs, *read))
    return tuple(stream.blocks[len(blocks) :]) + ((stream.partial,) if stream.partial is not None else ())


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """Raise ValueError naming the setting (``k3lit generate``'s flag of the same name) and its valid range."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} (--max_new_tokens): must be >= 0")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature} (--temperature): must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} (--top_k): must be >= 1, or None (null on the command line) for all tokens")


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """``[B, vocab]`` logits -> ``[B, 1]`` next tokens (greedy when temperature == 0)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
