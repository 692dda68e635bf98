"""FLOPs formula tied to the real modules; tokens/s and MFU logged during training; bf16-mixed and compile on CPU."""

import csv
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from k3lit.cli import main
from k3lit.model import K3LM, ModelConfig
from k3lit.ops.kda import largest_safe_chunk
from k3lit.train.flops import active_matmul_params, flops_breakdown, training_flops, training_flops_per_token

ROOT = Path(__file__).parents[1]
CONFIGS = {
    "hybrid_moe": ModelConfig(vocab_size=300, dim=48, n_layers=5, layer_pattern="KKA", n_heads=3, head_dim=16,
                              mlp_hidden=80, n_experts=6, top_k=2, expert_dim=24, n_shared_experts=1,
                              first_dense_layers=1, tie_embeddings=False),
    "plain_dense": ModelConfig(vocab_size=300, dim=48, n_layers=3, layer_pattern="A", n_heads=3, head_dim=16,
                               mlp_hidden=80, residual="plain"),
    "kda_full_attnres": ModelConfig(vocab_size=300, dim=48, n_layers=2, layer_pattern="K", n_heads=3, head_dim=16,
                                    residual="full_attnres"),
}


def counted_from_modules(c: ModelConfig) -> float:
    """Matrix weights a token meets, read off the built model: every weight of rank >= 2 except the embedding
    lookup, the LM head once (tied or not), and routed expert stacks at top_k / n_experts of their size."""
    model = K3LM(c)
    n = c.dim * c.vocab_size
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith(("embed.", "lm_head.")):
            continue
        n += p.numel() * (c.top_k / c.n_experts if ".experts." in name else 1)
    return n


@pytest.mark.parametrize("name", CONFIGS)
def test_active_params_formula_matches_the_built_model(name):
    c = CONFIGS[name]
    assert active_matmul_params(c) == pytest.approx(counted_from_modules(c), rel=0, abs=0.5)


def test_flops_terms():
    c = CONFIGS["hybrid_moe"]
    parts = flops_breakdown(c, 1024)
    assert parts["matmul"] == 6 * active_matmul_params(c)
    n_attn = 1  # layers 2 of 0..4 under KKA... pattern KKA repeated: K K A K K -> one A
    assert parts["attention"] == 3 * n_attn * 4 * 3 * 16 * (1024 + 1) / 2
    chunk = largest_safe_chunk(c.kda_g_min)
    assert parts["kda"] == 3 * 4 * 3 * (8 * chunk * 16 + 6 * 16 * 16 + 2 * chunk**2 / 3)
    # Attention grows with the sequence, KDA and the matrix products do not.
    longer = flops_breakdown(c, 4096)
    assert longer["attention"] > 3.9 * parts["attention"] and longer["kda"] == parts["kda"]
    assert training_flops(c, 4, 1024) == 4 * 1024 * training_flops_per_token(c, 1024)
    # A plain residual has no depth reads; MoE only counts the routed top_k (+ shared) experts.
    assert flops_breakdown(CONFIGS["plain_dense"], 64)["attnres"] == 0
    wider = dataclasses.replace(c, n_experts=12)
    assert active_matmul_params(wider) - active_matmul_params(c) == 4 * c.dim * 6  # router rows only


def _metrics(root: Path) -> list[dict]:
    with open(root / "metrics.csv") as f:
        return list(csv.DictReader(f))


ARGS = [
    "--config", str(ROOT / "recipes" / "tiny.yaml"), "--model.dim=64", "--model.n_layers=3",
    "--model.layer_pattern=KKA", "--model.n_heads=2", "--model.head_dim=32", "--model.mlp_hidden=128",
    "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=64", "--model.attnres_block_size=2",
    "--data.tokenizer=byte", "--data.seq_len=64", "--data.batch_size=4", "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--optim.warmup_steps=2",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def test_tokens_per_second_and_mfu_are_logged_with_bf16_mixed(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    steps = 12
    main(["fit", *ARGS, f"--data.cache_dir={cache}", f"--trainer.default_root_dir={tmp_path}",
          f"--trainer.max_steps={steps}", "--trainer.precision=bf16-mixed",
          "--trainer.callbacks+=k3lit.train.callbacks.K3ThroughputMonitor",
          "--trainer.callbacks.window_size=4", "--trainer.callbacks.available_flops=1e12"])
    rows = _metrics(tmp_path)
    rates = [r for r in rows if r.get("train/device/items_per_sec")]
    assert len(rates) >= steps - 4
    cfg = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["hyper_parameters"]["model"]
    per_token = training_flops_per_token(cfg, 64)
    for r in rates:
        tokens, flops, mfu = (float(r[k]) for k in ("train/device/items_per_sec", "train/device/flops_per_sec",
                                                     "train/device/mfu"))
        assert tokens > 0 and flops == pytest.approx(tokens * per_token, rel=1e-6)
        assert mfu == pytest.approx(flops / 1e12, rel=1e-6)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_default_callbacks_log_throughput_without_mfu_on_cpu(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    main(["fit", *ARGS, f"--data.cache_dir={cache}", f"--trainer.default_root_dir={tmp_path}",
          "--trainer.max_steps=22"])
    rows = _metrics(tmp_path)
    assert any(r.get("train/device/items_per_sec") for r in rows)  # the default window is 20 steps
    assert not any(r.get("train/device/mfu") for r in rows)  # no known peak for a CPU


@pytest.mark.slow
def test_compile_option_trains_on_cpu(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    main(["fit", *ARGS, f"--data.cache_dir={cache}", f"--trainer.default_root_dir={tmp_path}", "--compile=true",
          "--model.n_layers=1", "--model.layer_pattern=A", "--model.n_experts=0", "--trainer.max_steps=4"])
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["hyper_parameters"]["compile"] is True and ckpt["global_step"] == 4
    assert not any("_orig_mod" in k for k in ckpt["state_dict"])  # in-place compile keeps the names
    losses = [float(r["train/loss"]) for r in _metrics(tmp_path) if r.get("train/loss")]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
def test_gpu_fit_under_cuda_graphs_per_sublayer_follows_the_fit_without(tmp_path, cache, monkeypatch):
    """``k3lit fit --compile_mode=reduce-overhead`` of a K3 model (Triton KDA, MoE, block AttnRes, Muon) through
    Lightning, validation and checkpoint included, takes the same steps as the compiled fit without CUDA graphs."""
    monkeypatch.chdir(ROOT)
    runs = {}
    for mode in ("none", "reduce-overhead"):
        root = tmp_path / mode
        main(["fit", *ARGS, f"--data.cache_dir={cache}", f"--trainer.default_root_dir={root}",
              "--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.precision=bf16-mixed", "--compile=true",
              *([f"--compile_mode={mode}"] if mode != "none" else []), "--trainer.max_steps=8",
              "--trainer.val_check_interval=4", "--trainer.limit_val_batches=2"])
        rows = _metrics(root)
        runs[mode] = ([float(r["train/loss"]) for r in rows if r.get("train/loss")],
                      [float(r["val/bpb"]) for r in rows if r.get("val/bpb")])
        assert torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 8
    (losses, bpb), (graph_losses, graph_bpb) = runs["none"], runs["reduce-overhead"]
    assert len(losses) == 8 and len(bpb) == 2 and all(math.isfinite(v) for v in losses + bpb)
    assert graph_losses == pytest.approx(losses, rel=1e-5) and graph_bpb == pytest.approx(bpb, rel=1e-5)
