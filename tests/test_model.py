"""K3LM: config validation, the AttnRes residual rules against a literal loop, and decoding equivalence."""

import dataclasses

import pytest
import torch

import k3lit.ops.attn_res as attn_res_ops
from k3lit.model import K3LM, ModelConfig
from k3lit.ops.attn_res import attn_res_reference
from k3lit.testing import rel_rms

TINY = ModelConfig(vocab_size=50, dim=32, n_layers=4, layer_pattern="KKA", n_heads=2, head_dim=16, mlp_hidden=48,
                   n_experts=4, top_k=2, expert_dim=16, first_dense_layers=1, kda_backend="torch")


def build(**kw) -> K3LM:
    model = K3LM(dataclasses.replace(TINY, **kw)).double()
    with torch.no_grad():  # random pseudo-queries, so the depth softmax is far from uniform
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0, 1.0)
    return model


def literal_forward(model: K3LM, idx: torch.Tensor) -> torch.Tensor:
    """docs/MATH.md §3 written out: sources, block sums and per-sublayer RMSNorm + pseudo-query reads."""
    x = model.embed(idx)
    S = model.block_size
    blocks, partial = [x], None
    for j, sub in enumerate(model.sublayers):
        srcs = blocks + ([partial] if partial is not None else [])
        h = attn_res_reference(srcs, sub.res_mixer.query, sub.res_mixer.norm_weight, model.config.norm_eps)
        out, _ = sub(h)
        partial = out if partial is None else partial + out
        if (j + 1) % S == 0:
            blocks.append(partial)
            partial = None
    srcs = blocks + ([partial] if partial is not None else [])
    fm = model.final_res_mixer
    return model.lm_head(model.norm(attn_res_reference(srcs, fm.query, fm.norm_weight, model.config.norm_eps)))


@pytest.mark.parametrize("residual,block", [("block_attnres", 2), ("block_attnres", 3), ("full_attnres", 4)])
def test_attnres_matches_literal_definition(seed, residual, block):
    model = build(residual=residual, attnres_block_size=block).eval()
    idx = torch.randint(0, 50, (2, 11))
    assert rel_rms(model(idx)[0], literal_forward(model, idx)) < 1e-12


def test_zero_init_pseudo_queries_give_uniform_mean(seed):
    model = K3LM(dataclasses.replace(TINY, residual="full_attnres")).double().eval()
    assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if n.endswith("query"))
    idx = torch.randint(0, 50, (1, 7))
    x = model.embed(idx)
    first = model.sublayers[0]
    h_seen = {}
    first.register_forward_pre_hook(lambda m, args: h_seen.setdefault("h", args[0]))
    model(idx)
    assert rel_rms(h_seen["h"], x) < 1e-14  # one source: the embedding itself
    second = model.sublayers[1]
    second.register_forward_pre_hook(lambda m, args: h_seen.setdefault("h2", args[0]))
    out0, _ = first(x)
    model(idx)
    assert rel_rms(h_seen["h2"], (x + out0) / 2) < 1e-12  # uniform mean of [embedding, f_1]


def test_plain_residual_runs_and_differs(seed):
    model = build(residual="plain").eval()
    logits, _ = model(torch.randint(0, 50, (2, 9)))
    assert logits.shape == (2, 9, 50) and torch.isfinite(logits).all()


@pytest.mark.parametrize("residual,rope_theta,reach", [
    ("plain", None, {}), ("block_attnres", None, {}), ("full_attnres", None, {}), ("block_attnres", 100.0, {}),
    ("block_attnres", None, dict(attn_window=6)), ("block_attnres", None, dict(attn_logn_base=8)),
    ("block_attnres", 100.0, dict(attn_window=6, attn_logn_base=8))])
def test_incremental_decoding_equals_full_forward(seed, residual, rope_theta, reach):
    """Prefill, then one token at a time, against one forward; with a window and log-n scaling too (40 tokens
    reach beyond both, and the cached keys count in a new token's position)."""
    model = build(residual=residual, rope_theta=rope_theta, **reach).eval()
    idx = torch.randint(0, 50, (2, 40))
    full, _ = model(idx)
    logits, states = model(idx[:, :13], return_state=True)
    pieces = [logits]
    for t in range(13, 40):
        logits, states = model(idx[:, t : t + 1], states)
        pieces.append(logits)
    assert rel_rms(torch.cat(pieces, 1), full) < 1e-10


def test_greedy_generation_equals_recompute(seed):
    model = build().eval()
    prompt = torch.randint(0, 50, (1, 5))
    out = model.generate(prompt, max_new_tokens=12, temperature=0)
    seq = prompt
    for _ in range(12):
        nxt = model(seq)[0][:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("reach", [{}, dict(attn_window=6, attn_logn_base=6)])
def test_compiled_decoding_samples_what_eager_decoding_does(seed, reach):
    """``compile_decode``: the same greedy tokens as the eager loop; the growing key/value caches (symbolic
    length) compile no new graph after the first steps, and a second call reuses the compiled module. No MoE
    layer: on the CPU the experts' fallback loop reads each group's size on the host (a graph break); on CUDA
    ``grouped_mm`` takes the whole batch. Under a window of 6 the caches stop growing at 5 positions and their
    start moves instead; the first 3 new tokens already pass the window and the log-n base."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = build(n_experts=0, **reach).eval()
    prompt = torch.randint(0, 50, (2, 5))
    want = model.generate(prompt, max_new_tokens=12, temperature=0)
    counters.clear()
    got = model.generate(prompt, max_new_tokens=3, temperature=0, compile_decode="aot_eager")
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    got = model.generate(prompt, max_new_tokens=12, temperature=0, compile_decode="aot_eager")
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == graphs  # caches of 6 to 17 positions: the same graphs


@pytest.mark.parametrize("kwargs,message", [
    ({"top_k": 0}, r"top_k=0 \(--top_k\): must be >= 1, or None"),
    ({"temperature": -1.0}, r"temperature=-1.0 \(--temperature\): must be a finite number >= 0"),
    ({"temperature": float("nan")}, r"temperature=nan"),
    ({"max_new_tokens": -1}, r"max_new_tokens=-1 \(--max_new_tokens\): must be >= 0"),
])
def test_generate_rejects_bad_sampling_settings(kwargs, message):
    model = build().eval()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 3, dtype=torch.long), **{"max_new_tokens": 2, **kwargs})


@pytest.mark.parametrize("residual,block", [("block_attnres", 2), ("full_attnres", 1)])
def test_reads_take_the_autocast_dtype(seed, residual, block):
    """Under bf16 autocast every sublayer reads a bf16 mix (the embedding stays float32, the summaries are bf16
    sublayer outputs); without autocast the float32 model reads float32."""
    model = K3LM(dataclasses.replace(TINY, residual=residual, attnres_block_size=block))
    idx = torch.randint(0, 50, (2, 9))
    for autocast, want in ((True, torch.bfloat16), (False, torch.float32)):
        seen = []
        hooks = [sub.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0].dtype))
                 for sub in model.sublayers]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(idx)[0].float().sum().backward()
        for h in hooks:
            h.remove()
        assert seen == [want] * len(model.sublayers)


def test_reads_of_float64_and_meta_models_ignore_autocast(seed):
    """Autocast leaves a float64 model alone, so its reads stay float64 (a bf16 mix would meet float64 weights);
    a model on the meta device (no autocast there) still runs its forward. Dense models: the MoE router's
    autocast guard takes neither case (not k3lit's reads)."""
    model = K3LM(dataclasses.replace(TINY, residual="block_attnres", attnres_block_size=2, n_experts=0)).double()
    idx = torch.randint(0, 50, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(idx)[0].dtype == torch.float64
    with torch.device("meta"):
        meta = K3LM(dataclasses.replace(TINY, residual="block_attnres", attnres_block_size=2, n_experts=0))
    assert meta(idx.to("meta"))[0].shape == (2, 9, 50)


def test_router_bias_stays_float32_under_bf16():
    model = K3LM(TINY).to(torch.bfloat16)
    for moe in model.moe_layers():
        assert moe.expert_bias.dtype == torch.float32


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("layer_pattern", "KKX", "layer_pattern"),
        ("residual", "dense", "residual"),
        ("balancer", "sinkhorn", "balancer"),
        ("top_k", 5, "top_k"),
        ("top_k", 4, "top_k"),
        ("kda_g_min", -20.0, "kda_g_min"),
        ("kda_g_min", 1.0, "kda_g_min"),
        ("dim", 0, "dim"),
        ("first_dense_layers", 9, "first_dense_layers"),
        ("attnres_block_size", 0, "attnres_block_size"),
        ("rope_theta", 0.0, "rope_theta"),
    ],
)
def test_bad_config_names_field(field, value, match):
    with pytest.raises(ValueError, match=f"ModelConfig.{match}"):
        dataclasses.replace(TINY, **{field: value})


@pytest.mark.parametrize("policy,n,match", [("layer", 1, "only applies"), ("block", -1, "must lie in"),
                                            ("block", 99, r"must lie in \[0, \d+\]")])
def test_bad_checkpoint_blocks(policy, n, match):
    with pytest.raises(ValueError, match=f"ModelConfig.checkpoint_blocks={n}: {match}"):
        dataclasses.replace(TINY, activation_checkpointing=policy, checkpoint_blocks=n)


def test_missing_vocab_raises():
    with pytest.raises(ValueError, match="vocab_size is None"):
        K3LM(dataclasses.replace(TINY, vocab_size=None))


def twins(policy: str, checkpoint_blocks: int | None = None, **kw) -> tuple[K3LM, K3LM]:
    """``build(**kw)`` and a model with the same weights under checkpoint ``policy`` (and ``checkpoint_blocks``)."""
    ref = build(**kw)
    ckpt = build(**kw, activation_checkpointing=policy, checkpoint_blocks=checkpoint_blocks)
    ckpt.load_state_dict(ref.state_dict())
    return ref, ckpt


def lm_loss(model: K3LM, idx: torch.Tensor) -> torch.Tensor:
    logits, _ = model(idx)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())


def assert_equal_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, g in a.items():
        assert g is not None and b[name] is not None and torch.equal(g, b[name]), name


@pytest.mark.parametrize("policy", ["layer", "block", "selective"])
@pytest.mark.parametrize(
    "residual,block", [("plain", 3), ("block_attnres", 3), ("block_attnres", 2), ("full_attnres", 3)]
)
def test_checkpointing_is_bit_identical(seed, policy, residual, block):
    """Every recomputation policy gives the same loss and gradients, bit for bit, in float64 on CPU."""
    idx = torch.randint(0, 50, (2, 37))
    results = []
    for model in twins(policy, residual=residual, attnres_block_size=block):
        loss = lm_loss(model, idx)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        counts = [m._pending_scores for m in model.moe_layers()]
        assert all(sum(s.shape[0] for s in c) == idx.numel() for c in counts), "tokens counted twice"
    assert torch.equal(results[0][0], results[1][0])
    assert_equal_grads(results[0][1], results[1][1])


@pytest.mark.parametrize("residual", ["plain", "block_attnres"])
@pytest.mark.parametrize("checkpoint_blocks", [None, 0, 1])
def test_block_policy_recomputes_the_first_blocks(seed, residual, checkpoint_blocks):
    """``block``: the recomputed segments run their forward twice (once more inside backward, through the
    reentrant checkpoint, whose forward builds no graph), the others once. By default every segment but the
    last, whose activations backward needs first; ``checkpoint_blocks=N`` the first N."""
    model = build(residual=residual, attnres_block_size=3, activation_checkpointing="block",
                  checkpoint_blocks=checkpoint_blocks)
    calls = [0] * len(model.sublayers)
    for i, sub in enumerate(model.sublayers):
        sub.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    logits, _ = model(torch.randint(0, 50, (2, 9)))
    assert calls == [1] * len(calls)
    logits.square().sum().backward()
    last = len(calls) - (len(calls) - 1) % 3 - 1  # first sublayer of the last segment of 3
    recomputed = last if checkpoint_blocks is None else 3 * checkpoint_blocks
    assert calls == [2] * recomputed + [1] * (len(calls) - recomputed), calls


@pytest.mark.parametrize("residual", ["plain", "block_attnres"])
def test_block_policy_with_kept_blocks_is_bit_identical(seed, residual):
    """Recomputing only the first segment gives the loss and gradients of ``none``, bit for bit (float64)."""
    idx = torch.randint(0, 50, (2, 11))
    results = []
    for model in twins("block", checkpoint_blocks=1, residual=residual, attnres_block_size=2):
        loss = lm_loss(model, idx)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    assert_equal_grads(results[0][1], results[1][1])


@pytest.mark.parametrize("residual", ["plain", "block_attnres"])
def test_block_policy_with_a_frozen_embedding(seed, residual):
    """A frozen embedding gives the first segment no input that needs a gradient; a reentrant checkpoint would
    then drop the gradients of every parameter inside it (torch only warns). ``block`` must match ``none``."""
    idx = torch.randint(0, 50, (2, 9))
    grads = []
    for model in twins("block", residual=residual, attnres_block_size=2, tie_embeddings=False):
        model.embed.weight.requires_grad_(False)
        logits, _ = model(idx)
        logits.square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert_equal_grads(grads[0], grads[1])


def test_block_policy_keeps_the_aux_loss_graph(seed):
    """With the ``aux_loss`` balancer the loss is a side output of the forward, so ``block`` recomputes with the
    non-reentrant checkpoint: the router gets the aux-loss gradient, bit for bit as without recomputation."""
    idx = torch.randint(0, 50, (2, 13))
    grads = []
    for model in twins("block", balancer="aux_loss", attnres_block_size=2):
        (lm_loss(model, idx) + model.aux_loss()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert_equal_grads(grads[0], grads[1])


@pytest.mark.parametrize("kw", [{}, {"residual": "plain", "tie_embeddings": False, "n_shared_experts": 1}],
                         ids=["tied-attnres", "untied-plain-shared"])
def test_meta_init_weights_equal_construction(kw):
    """A meta-built model, materialised with ``to_empty`` (NaN-filled) and ``init_weights()`` from the same seed,
    holds bit for bit the weights of a normal construction, tied head included: every parameter and buffer is
    covered, with the same random draws in the same order."""
    cfg = dataclasses.replace(TINY, **kw)
    torch.manual_seed(0)
    want = K3LM(cfg).state_dict()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = K3LM(cfg)
    model.to_empty(device="cpu")
    for t in [*model.parameters(), *model.buffers()]:
        t.data.fill_(float("nan") if t.is_floating_point() else -1)  # counters (the MoE's balancer_step) are ints
    torch.manual_seed(0)
    model.init_weights()
    assert (model.lm_head.weight is model.embed.weight) == cfg.tie_embeddings
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def nudged(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """float32 copies of ``state`` with every value moved one float32 ulp up or down at random: a neighbouring
    model, for sampling float32's error on models like ``state``'s (each against its own float64 reference)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, v in state.items():
        v = v.float()
        up = torch.rand(v.shape, generator=gen) < 0.5
        out[name] = torch.nextafter(v, torch.where(up, float("inf"), float("-inf")))
    return out


def test_nudged_moves_every_weight_one_float32_ulp_either_way():
    """The float32 model test's neighbouring models: every value exactly one float32 ulp from its float32 rounding,
    up or down about equally often, and the same moves for the same seed."""
    state = {"w": torch.randn(64, 48, dtype=torch.float64), "b": torch.randn(1000)}
    out = nudged(state, 7)
    assert all(torch.equal(out[k], v) for k, v in nudged(state, 7).items())
    for name, v in state.items():
        v, n = v.float(), out[name]
        up = n > v
        assert n.dtype == torch.float32
        assert torch.equal(n[up], torch.nextafter(v, torch.tensor(float("inf")))[up])
        assert torch.equal(n[~up], torch.nextafter(v, torch.tensor(float("-inf")))[~up])
        assert 0.35 < up.float().mean() < 0.65, name


def next_token_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` ``[B, T - 1, vocab]`` against ``idx[:, 1:]``, in float64."""
    return torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), idx[:, 1:].flatten().to(logits.device))


def float64_reference(cfg: dict, state: dict[str, torch.Tensor], idx: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Loss and flat gradient of all parameters of the model with weights ``state``, by the literal float64 loop."""
    model = K3LM(dataclasses.replace(TINY, **cfg)).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    value = next_token_loss(literal_forward(model, idx[:, :-1]), idx)
    value.backward()
    return value.item(), torch.cat([p.grad.double().flatten() for p in model.parameters()])


def float32_run(cfg: dict, state: dict[str, torch.Tensor], idx: torch.Tensor, device: str, kda: str = "torch",
                attn_res_kernels: bool = False) -> tuple[float, torch.Tensor]:
    """Loss and flat float64 gradient of the model with weights ``state`` run in float32 on ``device``, KDA on
    ``kda``'s backend and the AttnRes reads on their kernels or (``attn_res_kernels=False``) in PyTorch."""
    m = K3LM(dataclasses.replace(TINY, kda_backend=kda, **cfg)).to(device)
    m.load_state_dict({k: v.float() for k, v in state.items()})
    saved = attn_res_ops._kernels
    if not attn_res_kernels:  # "auto" then takes the PyTorch forms of the reads on CUDA too
        attn_res_ops._kernels = lambda: None
    try:
        value = next_token_loss(m(idx[:, :-1].to(device))[0], idx)
        value.backward()
    finally:
        attn_res_ops._kernels = saved
    return value.item(), torch.cat([p.grad.double().cpu().flatten() for p in m.parameters()])


def float32_pytorch_errors(cfg: dict, state: dict[str, torch.Tensor], idx: torch.Tensor,
                           ref: tuple[float, torch.Tensor], seed: int) -> dict[str, tuple[float, float]]:
    """float32 PyTorch's (loss error, gradient error) in five runs that round differently: the model ``state``
    on the GPU and on the CPU against ``ref`` (its float64 loss and gradient), and three neighbouring models
    (:func:`nudged`, from seeds ``3 seed``, ``3 seed + 1``, ``3 seed + 2``) on the GPU, each against its own float64
    reference."""
    settings = [("GPU", "cuda", state, ref), ("CPU", "cpu", state, ref)]
    for i in range(3):
        neighbour = nudged(state, 3 * seed + i)
        settings.append((f"GPU, weights 1 ulp ({i + 1})", "cuda", neighbour, float64_reference(cfg, neighbour, idx)))
    runs = {}
    for name, device, weights, (ref_loss, ref_grad) in settings:
        loss, grad = float32_run(cfg, weights, idx, device)
        runs[name] = (abs(loss - ref_loss), rel_rms(grad, ref_grad))
    return runs


def float32_yardstick(runs: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """The median loss error and the median gradient error of :func:`float32_pytorch_errors`' five runs."""
    return sorted(v[0] for v in runs.values())[2], sorted(v[1] for v in runs.values())[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("residual,block", [("block_attnres", 4), ("block_attnres", 3), ("full_attnres", 1)])
def test_gpu_attnres_model_as_accurate_as_float32_pytorch(seed, residual, block):
    """On CUDA the AttnRes reads run on the Triton kernels (two-phase, and the one-pass final read), KDA on its
    kernels. Against the literal float64 loop, the float32 model's loss and gradients (all parameters as one
    vector) are as accurate as float32 PyTorch's on the same model. With random pseudo-queries the depth softmax
    is sharp and float32 itself errs by up to ~2e-3 on single parameters, so the yardstick is float32 PyTorch, not
    a fixed tolerance; and since on such draws the summation order alone moves float32's error ~10x (the same
    model on the H200 and on the CPU: 1.7e-5 and 1.6e-4 at K3LIT_SEED=1414577424, block 3), the yardstick is the
    median of five float32 runs (:func:`float32_pytorch_errors`: GPU, CPU and three neighbouring models, each
    against its own reference), not one run (docs/DECISIONS.md). The kernels' error may be up to 3x that on at
    least three of five draws (models and batches from ``seed``, ``seed + 1``, ...), which a kernel that is less
    accurate on most inputs still fails."""
    cfg = dict(residual=residual, attnres_block_size=block, n_layers=6, dim=96, n_experts=0)
    errors = []  # per draw: (kernels' loss error, float32's, kernels' gradient error, float32's)
    for draw in range(5):
        torch.manual_seed(seed + draw)
        model = build(**cfg)
        idx = torch.randint(0, TINY.vocab_size, (2, 37))
        state = model.state_dict()
        ref_loss, ref = float64_reference(cfg, state, idx)
        loss, grads = float32_run(cfg, state, idx, "cuda", kda="triton", attn_res_kernels=True)
        loss_yardstick, grad_yardstick = float32_yardstick(
            float32_pytorch_errors(cfg, state, idx, (ref_loss, ref), seed + draw))
        errors.append((abs(loss - ref_loss), loss_yardstick, rel_rms(grads, ref), grad_yardstick))
    print("loss and gradient errors (kernels, float32 PyTorch median) per draw:", errors)
    # as accurate as float32 PyTorch within 3x (and 1e-6: float32's rounding of a loss near 7) on most draws
    assert sum(lk <= 3 * lt + 1e-6 for lk, lt, _, _ in errors) >= 3, errors
    assert sum(gk <= 3 * gt + 1e-6 for _, _, gk, gt in errors) >= 3, errors


def _later_tokens_changed(idx: torch.Tensor, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    other = idx.clone()
    other[:, t:] = (idx[:, t:] + torch.randint(1, TINY.vocab_size, idx[:, t:].shape, generator=g)) % TINY.vocab_size
    return other


@pytest.mark.parametrize("residual,block,rope_theta,capacity", [
    ("plain", 1, None, None), ("block_attnres", 2, None, None), ("full_attnres", 1, None, None),
    ("plain", 1, 100.0, None), ("block_attnres", 2, None, "causal")])
@pytest.mark.parametrize("t", [1, 16, 23])
def test_logits_before_a_position_ignore_every_later_token(seed, residual, block, rope_theta, capacity, t):
    """Causality of the whole model (KDA with its short convolutions, softmax attention, MoE with shared expert,
    the residual rule, the causal capacity limit at cf = 1), in training mode, float64: new tokens from position
    t on leave the logits of positions < t unchanged (chunk-size 16 boundaries at t = 16 and inside a chunk at
    t = 23) and change those after."""
    torch.manual_seed(seed)
    limit = {} if capacity is None else {"capacity_factor": 1.0, "capacity_mode": capacity}
    model = build(residual=residual, attnres_block_size=block, n_shared_experts=1, rope_theta=rope_theta, **limit)
    idx = torch.randint(0, TINY.vocab_size, (2, 40))
    a, b = model(idx)[0], model(_later_tokens_changed(idx, t, seed))[0]
    torch.testing.assert_close(b[:, :t], a[:, :t], rtol=1e-12, atol=1e-12)
    assert (b[:, t:] - a[:, t:]).abs().amax() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_logits_before_a_position_ignore_every_later_token(seed, compiled):
    """The same on the CUDA path training uses: Triton KDA, short-convolution and AttnRes kernels, bf16 autocast,
    optionally the whole model compiled. Earlier positions move by less than bf16 rounding of their values; later
    ones by far more."""
    torch.manual_seed(seed)
    model = K3LM(dataclasses.replace(TINY, kda_backend="auto", dim=128, n_heads=2, head_dim=64, n_layers=6,
                                     layer_pattern="KKKA", n_shared_experts=1, residual="block_attnres",
                                     attnres_block_size=4)).cuda()
    if compiled:
        model.compile()
    idx = torch.randint(0, TINY.vocab_size, (2, 300))
    for t in (64, 100):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a = model(idx.cuda())[0].float()
            b = model(_later_tokens_changed(idx, t, seed).cuda())[0].float()
        scale = a[:, :t].abs().amax()
        assert (b[:, :t] - a[:, :t]).abs().amax() <= 2**-7 * scale
        assert (b[:, t:] - a[:, t:]).abs().amax() > 2**-4 * scale
