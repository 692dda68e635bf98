"""The whole K3 model compiles as one graph (``torch.compile(fullgraph=True)``: a graph break raises), trains, and
its MoE balancers keep recording and updating inside the compiled region; AOT autograd's cache keeps the graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from k3lit.model import K3LM, ModelConfig
from k3lit.nn.moe import update_balancers
from k3lit.train.module import K3LitModule


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from nothing: dynamo keeps per-code-object state between tests of one worker, and a
    shape another test compiled earlier would turn this test's sizes symbolic (automatic dynamic shapes)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _steps(model: K3LM, x: torch.Tensor, n: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(n):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            logits = model(x[:, :-1])[0]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        update_balancers(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("policy,backend", [("none", "inductor"), ("block", "aot_eager")])
def test_whole_model_compiles_without_graph_breaks_and_balances(policy, backend):
    """Also with block checkpointing (``K3LM.compile`` keeps the recording out of the recomputation): one
    forward and backward leaves each MoE with exactly its own tokens pending. Checkpointing is decided by dynamo
    and AOT autograd, so the block case stops before inductor's code generation (``aot_eager``), which the case
    without it runs: on the CPU it compiles about 130 C++ kernels a case, minutes on two cores."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, dim=32, n_layers=4 if policy == "none" else 3, layer_pattern="KKKA", n_heads=2,
                      head_dim=16, n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1, kda_backend="torch",
                      attnres_block_size=2, activation_checkpointing=policy)  # block: 2 of 3 segments recomputed
    eager = K3LM(cfg)
    compiled = copy.deepcopy(eager)
    counters.clear()
    compiled.compile(fullgraph=True, backend=backend)
    x = torch.randint(0, cfg.vocab_size, (2, 49), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(x[:, :-1])[0].float().logsumexp(-1).mean().backward()
    assert all(moe.pending_tokens == x.shape[0] * (x.shape[1] - 1) for moe in compiled.moe_layers())
    if backend == "inductor":  # the step is kept in AOT autograd's cache (a later process reuses it), custom
        # autograd.Function and all; the cache serves inductor's graphs only
        assert counters["aot_autograd"]["autograd_cache_bypass"] == 0, dict(counters["aot_autograd"])
    compiled.zero_grad()
    update_balancers(compiled)
    compiled.load_state_dict(eager.state_dict())  # the balancers' biases as well
    ref, out = _steps(eager, x, 2), _steps(compiled, x, 2)
    assert abs(out[0] - ref[0]) < 1e-2 * ref[0] and abs(out[1] - ref[1]) < 1e-2 * ref[1], (ref, out)
    for moe in compiled.moe_layers():  # the quantile balancer recorded the compiled forwards and moved its bias
        assert moe.expert_bias.abs().sum() > 0
        assert moe.last_load.sum().item() == x.shape[0] * (x.shape[1] - 1) * cfg.top_k
        assert moe.pending_tokens == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")])])
@pytest.mark.parametrize("asked", [None, True, False])
def test_compile_default_is_on_for_one_cuda_device_only(device, asked):
    module = K3LitModule(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, head_dim=16), compile=asked)
    module.to(device)
    expected = {None: device == "cuda", True: True, False: False}[asked]
    assert module.compiles() is expected
    module.configure_model()  # compiles in place: every parameter keeps its state-dict name
    assert all(not n.startswith("_orig_mod") for n in module.state_dict())
    assert [sub._compiled_call_impl is not None for sub in module.model.sublayers] == [expected] * 4
    assert module.model._compiled_call_impl is None  # regional by default: the sublayers, not the model


def test_compile_scope_model_compiles_the_whole_model_and_an_unknown_scope_is_refused():
    module = K3LitModule(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, head_dim=16), compile=True,
                         compile_scope="model")
    module.configure_model()
    assert module.model._compiled_call_impl is not None
    assert all(sub._compiled_call_impl is None for sub in module.model.sublayers)
    with pytest.raises(ValueError, match="compile_scope='layers': choose 'sublayers' or 'model'"):
        K3LitModule(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, head_dim=16), compile_scope="layers")
    with pytest.raises(ValueError, match="compile_mode='reduce_overhead': choose one of default, reduce-overhead"):
        K3LitModule(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, head_dim=16),
                    compile_mode="reduce_overhead")


@pytest.mark.parametrize("scope", ["sublayers", "model"])
def test_cuda_graph_mode_compiles_a_kda_model_at_either_scope(scope, monkeypatch):
    """``reduce-overhead`` reaches torch.compile for every region of a KDA model at both scopes (the GPU test above
    checks that the graphs then train as the model does without them)."""
    modes = []
    compile_ = torch.compile

    def recording(fn, **kwargs):  # noqa: ANN001, ANN202
        modes.append(kwargs.get("mode"))
        return compile_(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    module = K3LitModule(ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16),
                         compile=True, compile_mode="reduce-overhead", compile_scope=scope)
    module.configure_model()
    whole = module.model._compiled_call_impl
    regions = [whole] if scope == "model" else [sub._compiled_call_impl for sub in module.model.sublayers]
    assert all(r is not None for r in regions)
    assert (whole is None) == (scope == "sublayers")
    assert modes.count("reduce-overhead") == len(regions), modes  # the model's regions; the loss has its own


def test_validation_runs_the_compiled_model_eagerly():
    """A no-grad validation batch would compile a second graph; ``validation_step`` runs the model as written."""
    from torch._dynamo.testing import CompileCounter

    module = K3LitModule(ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16,
                                     kda_backend="torch"))
    frames = CompileCounter()
    module.model.compile(backend=frames)
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        module.validation_step(batch, 0)
    assert frames.frame_count == 0 and module.val_loss.compute().isfinite()
    module.training_step(batch, 0)
    assert frames.frame_count > 0  # the same compiled model: training traces it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("scope", ["sublayers", "model"])
def test_gpu_kda_model_trains_under_cuda_graphs(scope):
    """A K3 model (KDA on the Triton kernels, softmax attention, MoE with quantile balancing, block AttnRes)
    replayed as CUDA graphs (``mode="reduce-overhead"``), sublayer by sublayer or as one region, takes the same
    training steps as compiled without them: the same inductor kernels and Triton launches, so the same losses and
    weights to float32 rounding. As one region the KDA and AttnRes launches run inside the graph: their side
    tables must not stay in the graph's memory pool (:func:`k3lit.kernels.streams.cacheable`)."""
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=4, layer_pattern="KKKA", n_heads=2, head_dim=32,
                      mlp_hidden=96, n_experts=4, top_k=2, expert_dim=32, n_shared_experts=1, attnres_block_size=2)
    torch.manual_seed(0)
    base = K3LM(cfg).cuda()
    x = torch.randint(0, 64, (2, 129), generator=torch.Generator().manual_seed(1)).cuda()
    runs = {}
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if scope == "model":
            model.compile(mode=mode)
        else:
            model.compile_sublayers(mode=mode)
        losses = _steps(model, x, 4)
        runs[mode] = losses, [p.detach().clone() for p in model.parameters()]
    assert runs[None][0][-1] < runs[None][0][0]
    torch.testing.assert_close(runs["reduce-overhead"][0], runs[None][0], rtol=1e-5, atol=0)
    for got, want in zip(runs["reduce-overhead"][1], runs[None][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_accumulated_micro_batches_compile_each_sublayer_once_and_all_reach_the_balancer():
    """A compiled MoE forward leaves its statistics in one slot that ``training_step`` collects: six micro-batches
    of one optimizer step compile no sublayer anew (appending to the step's list inside the compiled region
    made dynamo guard on its length: a recompilation per micro-batch, and from the 9th on the layer ran eagerly),
    and the balancer's update sees every micro-batch, as the eager module's does."""
    from torch._dynamo.testing import CompileCounter

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, n_experts=4,
                      top_k=2, expert_dim=16, first_dense_layers=0, kda_backend="torch")
    torch.manual_seed(0)
    eager = K3LitModule(cfg)
    compiled = copy.deepcopy(eager)
    frames = CompileCounter()
    compiled.model.compile_sublayers(backend=frames)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (2, 17), generator=gen) for _ in range(7)]
    for module in (eager, compiled):
        module.training_step(batches[0], 0)  # a step of one micro-batch: every sublayer compiles
        update_balancers(module.model)
    one = frames.frame_count
    assert one > 0
    for module in (eager, compiled):
        for i, batch in enumerate(batches[1:]):
            module.training_step(batch, i)
        assert [m.pending_tokens for m in module.model.moe_layers()] == [6 * 2 * 16] * cfg.n_layers
        update_balancers(module.model)
    assert frames.frame_count == one
    for e, c in zip(eager.model.moe_layers(), compiled.model.moe_layers(), strict=True):
        assert c.expert_bias.abs().sum() > 0
        torch.testing.assert_close(c.expert_bias, e.expert_bias, rtol=0, atol=1e-5)


def test_a_compiled_forward_that_finds_the_last_ones_statistics_uncollected_is_warned_about():
    from k3lit.nn.moe import MoE

    moe = MoE(dim=16, n_experts=4, top_k=2, expert_dim=8)
    moe.compile(backend="eager")
    x = torch.randn(1, 8, 16)
    moe(x)
    moe(x)  # the first forward's statistics not collected
    with pytest.warns(UserWarning, match="missing from this optimizer step's update"):
        moe.update_balancer()
    assert moe.balancer_step.item() == 1 and moe.pending_tokens == 0
