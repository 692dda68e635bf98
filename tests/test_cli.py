"""End to end through the `k3lit` command: recipes parse, fit on the built-in corpus, resume, generate, errors."""

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from k3lit.cli import K3CLI, main
from k3lit.model import K3LM, ModelConfig
from k3lit.parallel import mesh_shape
from k3lit.train.flops import active_matmul_params

RECIPES = sorted(Path(__file__).parents[1].joinpath("recipes").glob("*.yaml"))
SMALL = [
    "--model.dim=64", "--model.n_layers=3", "--model.layer_pattern=KKA", "--model.n_heads=2", "--model.head_dim=32",
    "--model.mlp_hidden=128", "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=64",
    "--model.attnres_block_size=2", "--data.tokenizer=byte", "--data.seq_len=64", "--data.batch_size=4",
    "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
    "--optim.warmup_steps=2", "--optim.lr=3e-3",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One prepared copy of the built-in corpus (byte tokenizer) shared by the tests of this module."""
    return str(tmp_path_factory.mktemp("cache"))


def fit_args(root: Path, cache: str, steps: int, *extra: str) -> list[str]:
    return ["fit", "--config", "recipes/tiny.yaml", *SMALL, f"--data.cache_dir={cache}",
            f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={steps}", *extra]


def read_metric(root: Path, name: str) -> dict[int, float]:
    with open(root / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


# (data_parallel_replicate, data_parallel, expert_parallel) of the recipes that train with ExpertParallelStrategy
MESHES = {"medium": (1, 1, 8), "multinode": (4, 1, 8)}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_parses_against_the_cli_schema(recipe):
    out = subprocess.run([sys.executable, "-m", "k3lit.cli", "fit", "--config", str(recipe), "--print_config"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "model:" in out.stdout and "layer_pattern" in out.stdout
    cfg = yaml.safe_load(out.stdout)
    strategy, trainer = cfg["trainer"]["strategy"], cfg["trainer"]
    expert_parallel = (isinstance(strategy, dict)
                       and strategy.get("class_path") == "k3lit.parallel.ExpertParallelStrategy")
    assert expert_parallel == (recipe.stem in MESHES), "list every ExpertParallelStrategy recipe's mesh in MESHES"
    if expert_parallel:  # the resolved strategy's mesh fits the recipe's world size and expert count
        init = strategy["init_args"]
        world = trainer["devices"] * trainer["num_nodes"]
        shape = mesh_shape(world, init["data_parallel_replicate_size"], init["data_parallel_size"],
                           init["expert_parallel_size"], n_experts=cfg["model"]["n_experts"])
        assert shape == MESHES[recipe.stem]


@pytest.mark.parametrize("recipe", sorted(MESHES))
def test_cluster_recipe_header_counts_the_model(recipe):
    """The sizes in the recipe's comment header are the model's (counted on the meta device)."""
    text = (Path(__file__).parents[1] / "recipes" / f"{recipe}.yaml").read_text()
    vocab, total, experts, dense, active = re.search(
        r"counted from the model, vocab (\d+)\): ([\d.]+)B parameters \(([\d.]+)B in experts, ([\d.]+)B dense\), "
        r"([\d.]+)B active", text.replace("\n# ", " ")).groups()
    cfg = ModelConfig(**{**yaml.safe_load(text)["model"], "vocab_size": int(vocab)})
    with torch.device("meta"):
        assert torch.empty(0).is_meta, "torch.device('meta') is ignored in this process: see tests/conftest.py"
        model = K3LM(cfg)
    n_experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    n_total = sum(p.numel() for p in model.parameters())
    for printed, counted in ((total, n_total), (experts, n_experts), (dense, n_total - n_experts),
                             (active, active_matmul_params(cfg))):
        assert abs(float(printed) - counted / 1e9) <= 0.5 * 10 ** -len(printed.split(".")[1]), (printed, counted)


def test_fit_on_builtin_corpus_loss_falls_and_writes_outputs(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 40))
    loss = read_metric(tmp_path, "train/loss")
    first, last = sum(loss[s] for s in range(5)) / 5, sum(loss[s] for s in range(35, 40)) / 5
    assert last < first - 1.0, (first, last)
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert list(tmp_path.glob("events.out.tfevents.*"))
    assert read_metric(tmp_path, "val/bpb") and read_metric(tmp_path, "val/max_vio/layer0")
    vio = read_metric(tmp_path, "train/max_vio/layer1")
    assert len(vio) == 40


class CrashAt(Callback):
    """Simulates a killed job: raises when training reaches ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt  # what Ctrl-C does; Lightning tears down and exits


@pytest.mark.parametrize("balancer", [[], ["--model.quantile_rate=0.5", "--model.capacity_factor=1.0",
                                             "--model.capacity_mode=quantile"]], ids=["one_step", "sliding_capacity"])
def test_resume_continues_same_stream_optimizer_and_balancer(tmp_path, cache, monkeypatch, balancer):
    monkeypatch.chdir(Path(__file__).parents[1])
    ckpt = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=6",
            "--trainer.callbacks.save_last=true", "--trainer.callbacks.save_top_k=0", *balancer]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    main(fit_args(whole, cache, 12, *ckpt, f"--trainer.callbacks.dirpath={whole / 'checkpoints'}"))
    interrupted = fit_args(parts, cache, 12, *ckpt, f"--trainer.callbacks.dirpath={parts / 'checkpoints'}")
    cli = K3CLI(args=interrupted[1:], run=False)
    cli.trainer.callbacks.append(CrashAt(8))
    with pytest.raises(SystemExit):
        cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 8
    first_loss = read_metric(parts, "train/loss")
    main(interrupted + ["--ckpt_path", "last"])  # resumes from step 6
    a = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(parts / "checkpoints" / "last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 12
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name  # weights and the quantile bias buffers
    assert any("expert_bias" in n and tensor.abs().sum() > 0 for n, tensor in a["state_dict"].items())
    assert all(int(t) == 12 for n, t in a["state_dict"].items() if n.endswith("balancer_step"))
    if balancer:  # the running capacity thresholds, like the running bias, continue from the checkpoint
        assert any("capacity_threshold" in n and t.abs().sum() > 0 for n, t in a["state_dict"].items())
    opt_a, opt_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert opt_a.keys() == opt_b.keys() and all(  # every moment and momentum buffer of the optimizer
        torch.equal(t, opt_b[i][k]) for i in opt_a for k, t in opt_a[i].items() if torch.is_tensor(t))
    assert a["lr_schedulers"][0]["last_epoch"] == b["lr_schedulers"][0]["last_epoch"] == 12
    whole_loss, resumed_loss = read_metric(whole, "train/loss"), read_metric(parts, "train/loss")
    assert [first_loss[s] for s in range(6)] == [whole_loss[s] for s in range(6)]
    assert [resumed_loss[s] for s in range(6, 12)] == [whole_loss[s] for s in range(6, 12)]


def test_generate_from_checkpoint(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 3))
    capsys.readouterr()
    main(["generate", "--ckpt", str(tmp_path / "checkpoints" / "last.ckpt"), "--prompt", "def ",
          "--max_new_tokens", "20", "--temperature", "0"])
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > 4
    # an empty prompt starts a new document: the end-of-document token alone
    main(["generate", "--ckpt", str(tmp_path / "checkpoints" / "last.ckpt"), "--prompt", "", "--max_new_tokens", "4",
          "--stats", "true"])
    assert "prompt 1 tokens" in capsys.readouterr().err
    # a long prompt from a file, cut to an exact length (byte tokens: one a byte), with the speed figures
    (tmp_path / "prompt.py").write_text("import os\n" * 10)
    gen = ["generate", "--ckpt", str(tmp_path / "checkpoints" / "last.ckpt"), "--prompt_file",
           str(tmp_path / "prompt.py"), "--max_new_tokens", "5", "--temperature", "0"]
    main([*gen, "--prompt_tokens", "40", "--stats", "true"])
    out = capsys.readouterr()
    assert out.out.startswith("import os\n" * 4) and "import os\n" * 5 not in out.out[:45]
    assert re.search(r"prompt 40 tokens, prefill [0-9.]+ s \([0-9,]+ tokens/s\); 5 new tokens in [0-9.]+ s", out.err)
    assert "32-true, after an untimed pass over the same prompt" in out.err
    # the untimed pass draws from its own generator: sampled text is the same with and without --stats
    sampled = [*gen[:-2], "--temperature", "1.0", "--seed", "3", "--prompt_tokens", "40", "--max_new_tokens", "12"]
    main(sampled)
    plain = capsys.readouterr().out
    main([*sampled, "--stats", "true"])
    assert capsys.readouterr().out == plain
    greedy = [*gen, "--prompt_tokens", "40"]
    main(greedy)
    eager = capsys.readouterr().out
    main([*greedy, "--attn_window", "64", "--attn_logn_base", "64"])  # beyond the 45 positions: the same tokens
    assert capsys.readouterr().out == eager
    main([*greedy, "--attn_window", "8", "--attn_logn_base", "16"])  # an 8-token window: a cache of 7 positions
    assert capsys.readouterr().out.startswith("import os\n" * 4)
    main([*greedy, "--compile", "true", "--stats", "true"])  # the decoding step through inductor: the same tokens
    out = capsys.readouterr()
    assert out.out == eager and "32-true, decoding step compiled, after an untimed pass" in out.err
    main([*sampled, "--precision", "bf16-mixed", "--stats", "true"])  # bf16 autocast runs on CPU too
    out = capsys.readouterr()
    assert out.out.startswith("import os\n" * 4) and "bf16-mixed, after an untimed pass" in out.err
    with pytest.raises(SystemExit) as e:
        main([*gen, "--prompt_tokens", "101"])
    assert e.value.code == 2 and "--prompt_tokens=101: the prompt has 100 tokens" in capsys.readouterr().err
    # validate takes the architecture from the checkpoint, not from the recipe (which is larger)
    main(["validate", "--config", "recipes/tiny.yaml", "--data.tokenizer=byte", f"--data.cache_dir={cache}",
          "--data.seq_len=64", "--trainer.limit_val_batches=2", f"--trainer.default_root_dir={tmp_path / 'val'}",
          "--trainer.enable_progress_bar=false", "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt")])
    assert read_metric(tmp_path / "val", "val/bpb")


@pytest.mark.parametrize(
    "override,message",
    [
        ("--model.layer_pattern=KX", "ModelConfig.layer_pattern"),
        ("--model.top_k=9", "ModelConfig.top_k"),
        ("--data.corpus=/no/such/corpus", "does not exist"),
        ("--data.val_fraction=1.5", "val_fraction"),
        ("--ckpt_path=/no/such.ckpt", "checkpoint /no/such.ckpt not found"),
        ("--compile_mode=reduce_overhead", "Literal['default', 'reduce-overhead'"),
    ],
)
def test_bad_input_gives_clear_error(tmp_path, cache, override, message, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).parents[1])
    with pytest.raises(SystemExit) as e:
        main(fit_args(tmp_path, cache, 2, override))
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_mistyped_option_gets_a_short_error_with_suggestions(tmp_path, cache, capsys, monkeypatch):
    """No 90-line usage before the error: one usage line, the error, and the closest known options."""
    monkeypatch.chdir(Path(__file__).parents[1])
    with pytest.raises(SystemExit) as e:
        main(fit_args(tmp_path, cache, 2, "--model.dimm=8", "--trainer.max_stpes=3"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) < 10
    assert "--model.dimm: did you mean --model.dim" in err
    assert "--trainer.max_stpes: did you mean --trainer.max_steps" in err


def test_a_prefix_of_an_option_is_not_taken_for_it(tmp_path, cache, capsys, monkeypatch):
    """``--model.n_layer`` is a typo, not ``--model.n_layers``: argparse's abbreviations are off."""
    monkeypatch.chdir(Path(__file__).parents[1])
    with pytest.raises(SystemExit) as e:
        main(fit_args(tmp_path, cache, 2, "--model.n_layer=1", "--trainer.max_step=3"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments: --model.n_layer=1 --trainer.max_step=3" in err
    assert "--model.n_layer: did you mean --model.n_layers" in err


def test_fit_help_lists_the_model_optim_and_data_options_before_the_trainers(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    firsts = [out.index(f"--{group}.") for group in ("model", "optim", "data", "trainer")]
    assert firsts == sorted(firsts), firsts


def test_empty_corpus_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).parents[1])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(fit_args(tmp_path, str(tmp_path / "c"), 2, f"--data.corpus={tmp_path / 'empty'}"))
    assert "empty" in capsys.readouterr().err.lower()


def test_missing_checkpoint_for_generate(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--ckpt", str(tmp_path / "nope.ckpt")])
    assert "not found" in capsys.readouterr().err


def test_checkpoint_carries_its_tokenizer(tmp_path, monkeypatch, capsys):
    """A BPE run's checkpoint decodes text after its data cache is gone."""
    import shutil

    monkeypatch.chdir(Path(__file__).parents[1])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n\n" for j in range(60)))
    cache = tmp_path / "cache"
    main(fit_args(tmp_path / "run", str(cache), 2, f"--data.corpus={corpus}", "--data.tokenizer=bpe:300",
                  "--data.val_fraction=0.2"))
    shutil.rmtree(cache)
    capsys.readouterr()
    main(["generate", "--ckpt", str(tmp_path / "run" / "checkpoints" / "last.ckpt"), "--prompt", "def f",
          "--max_new_tokens", "5"])
    assert capsys.readouterr().out.startswith("def f")
    assert not cache.exists()


def test_prepare_subcommand_reads_a_recipe(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).parents[1])
    main(["prepare", "--config", "recipes/tiny.yaml", "--data.tokenizer=byte", f"--data.cache_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "train:" in out and "val:" in out and str(tmp_path) in out


class CheckpointSeen(Callback):
    """Records the step stored in last.ckpt while training is still running."""

    def __init__(self, path: Path, at: int) -> None:
        self.path, self.at, self.seen = path, at, None

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            self.seen = torch.load(self.path, weights_only=False)["global_step"]


def test_default_checkpoint_is_written_during_training(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(Path(__file__).parents[1])
    cli = K3CLI(args=fit_args(tmp_path, cache, 8)[1:] + ["--trainer.val_check_interval=3"], run=False)
    seen = CheckpointSeen(tmp_path / "checkpoints" / "last.ckpt", at=5)
    cli.trainer.callbacks.append(seen)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert seen.seen == 3  # written at step 3, not only at the end
    assert torch.load(seen.path, weights_only=False)["global_step"] == 8  # and at the end (8: no multiple of 3)


def test_progress_is_printed_as_lines_when_stdout_is_not_a_terminal(tmp_path, cache, monkeypatch, caplog):
    """Under pytest stdout is not a terminal (as in a SLURM job's log): K3CLI swaps the live bar for lines."""
    monkeypatch.chdir(Path(__file__).parents[1])
    args = [a for a in fit_args(tmp_path, cache, 4) if a != "--trainer.enable_progress_bar=false"]
    caplog.set_level("INFO")
    cli = K3CLI(args=args[1:] + ["--trainer.log_every_n_steps=2", "--trainer.accumulate_grad_batches=2"], run=False)
    assert not any(type(c).__name__ in ("RichProgressBar", "TQDMProgressBar") for c in cli.trainer.callbacks)
    kinds = [type(c).__name__ for c in cli.trainer.callbacks]
    assert kinds.index("K3ThroughputMonitor") < kinds.index("ProgressLines")  # so a line shows its own step's tok/s
    cli.trainer.fit(cli.model, cli.datamodule)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    train = [ln for ln in lines if "train/loss" in ln]
    assert [ln.split(" · ")[0] for ln in train] == ["step 2/4", "step 4/4"]  # once per optimizer step, not micro-batch
    val = [i for i, ln in enumerate(lines) if "val/bpb" in ln]
    assert val and lines[val[-1] - 1] == "step 4 · validating 2 batches"  # the pass announced before it runs


def test_resume_appends_to_metrics_csv_and_a_fresh_run_moves_it_aside(tmp_path, cache, monkeypatch, recwarn):
    """`--ckpt_path last` continues metrics.csv (the steps before the resume stay), last.ckpt, the TensorBoard events
    and the heatmaps; a fresh run keeps the old files aside (metrics.1.csv, previous.1.ckpt, tensorboard.1/,
    expert_load.1/) and writes its own last.ckpt (not last-v1.ckpt beside a stale one)."""
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 3))
    before = read_metric(tmp_path, "train/loss")
    assert sorted(before) == [0, 1, 2]
    main(fit_args(tmp_path, cache, 6, "--ckpt_path", "last"))
    assert sorted(read_metric(tmp_path, "train/loss")) == list(range(6))
    assert {s: read_metric(tmp_path, "train/loss")[s] for s in range(3)} == before
    assert not any("will be deleted" in str(w.message) for w in recwarn)
    events = sorted(p.name for p in tmp_path.glob("events.out.tfevents.*"))  # the first launch's and the resume's
    plots = sorted(p.name for p in (tmp_path / "expert_load").iterdir())
    assert len(events) == 2 and plots == ["step0000003.png", "step0000006.png"]
    main(fit_args(tmp_path, cache, 2))  # from scratch in the same directory: the earlier files are moved, not lost
    assert sorted(read_metric(tmp_path, "train/loss")) == [0, 1]
    assert sorted(p.name for p in (tmp_path / "tensorboard.1").iterdir()) == events
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # the fresh run's own
    assert sorted(p.name for p in (tmp_path / "expert_load.1").iterdir()) == plots
    assert sorted(p.name for p in (tmp_path / "expert_load").iterdir()) == ["step0000002.png"]
    with open(tmp_path / "metrics.1.csv") as f:
        assert sorted({int(r["step"]) for r in csv.DictReader(f) if r["train/loss"]}) == list(range(6))
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "previous.1.ckpt"]
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 2
    assert torch.load(ckpts / "previous.1.ckpt", weights_only=False)["global_step"] == 6
    main(fit_args(tmp_path, cache, 4, "--ckpt_path", "last"))  # resumes the fresh run, not the one moved aside
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "previous.1.ckpt"]


@pytest.mark.parametrize("form", ["last", "path"])
def test_resume_takes_the_architecture_from_the_checkpoint_and_the_rest_from_the_command_line(
        tmp_path, cache, monkeypatch, form):
    """`--ckpt_path last` and a file path behave alike: fields that shape the weights come from the checkpoint
    (with a warning naming each replaced value), activation checkpointing and optim.* from the command line."""
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 3))
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    if form == "path":
        ckpt = ckpt.rename(tmp_path / "step3.ckpt")
    with pytest.warns(UserWarning, match=r"replaces model\.dim=32 \(checkpoint: 64\), model\.n_heads=1 "):
        main(fit_args(tmp_path, cache, 5, "--model.dim=32", "--model.n_heads=1", "--optim.lr=1e-4",
                      "--model.activation_checkpointing=block", "--trainer.val_check_interval=3",  # same last.ckpt
                      "--ckpt_path", "last" if form == "last" else str(ckpt)))
    out = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert out["global_step"] == 5
    model, optim = out["hyper_parameters"]["model"], out["hyper_parameters"]["optim"]
    assert (model.dim, model.n_heads, model.activation_checkpointing, optim.lr) == (64, 2, "block", 1e-4)
    assert set(out["lr_schedulers"][0]["base_lrs"]) == {1e-4}  # the restored schedule follows the new lr
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]
    assert (saved["dim"], saved["activation_checkpointing"]) == (64, "block")


def test_max_time_counts_the_whole_run_and_null_lifts_it_on_resume(tmp_path, cache, monkeypatch):
    """README: resuming a run whose `max_time` (tiny.yaml: 9 minutes) is spent trains no step until the limit is
    raised or lifted."""
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 2))
    last = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    ckpt["callbacks"]["Timer"]["time_elapsed"]["train"] = 9 * 60.0  # as if the run had trained for its 9 minutes
    torch.save(ckpt, last)
    with pytest.warns(UserWarning, match=r"has trained for 0:09:00 and trainer\.max_time=00:00:09:00 counts the whole "
                                         r"run: nothing is left to train; raise --trainer\.max_time \(DD:HH:MM:SS\) or "
                                         r"set --trainer\.max_time=null to continue"):
        main(fit_args(tmp_path, cache, 4, "--trainer.val_check_interval=2", "--ckpt_path", "last"))
    assert torch.load(last, weights_only=False)["global_step"] == 2
    main(fit_args(tmp_path, cache, 4, "--trainer.val_check_interval=2", "--trainer.max_time=null", "--ckpt_path",
                  "last"))
    assert torch.load(last, weights_only=False)["global_step"] == 4


def test_validate_scores_a_checkpoint_and_leaves_its_run_as_training_left_it(tmp_path, cache, monkeypatch, capsys):
    """validate without --ckpt_path (or with `last` where there is none) has no trained weights to score: an error.
    Of the run's own checkpoint (`last`, or a path inside default_root_dir) it logs to <root>/validate, so the
    run's config.yaml and metrics.csv stay as training wrote them."""
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 2))
    kept = {name: (tmp_path / name).read_bytes() for name in ("config.yaml", "metrics.csv")}
    val = ["validate", "--config", "recipes/tiny.yaml", *SMALL, f"--data.cache_dir={cache}"]
    for extra, message in (([f"--trainer.default_root_dir={tmp_path}"], "k3lit validate scores trained weights: add "
                                                                          "--ckpt_path (a checkpoint file"),
                           ([f"--trainer.default_root_dir={tmp_path / 'new'}", "--ckpt_path", "last"],
                            f"--ckpt_path last: no last.ckpt in {tmp_path / 'new' / 'checkpoints'} to validate")):
        with pytest.raises(SystemExit) as e:
            main([*val, *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err
    for ckpt in ("last", str(tmp_path / "checkpoints" / "last.ckpt")):
        main([*val, f"--trainer.default_root_dir={tmp_path}", "--ckpt_path", ckpt])
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    with open(tmp_path / "validate" / "metrics.csv") as f:
        assert sum(bool(r.get("val/bpb")) for r in csv.DictReader(f)) == 2  # one row of each validation
    saved = yaml.safe_load((tmp_path / "validate" / "config.yaml").read_text())
    assert saved["ckpt_path"] == str(tmp_path / "checkpoints" / "last.ckpt")


def test_a_gpu_recipe_on_a_machine_without_cuda_says_what_to_train_instead(monkeypatch, capsys):
    monkeypatch.chdir(Path(__file__).parents[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", "recipes/small.yaml", "--trainer.max_steps=1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and ("trainer.accelerator=gpu, and torch finds no CUDA device on this machine: train "
                                  "recipes/tiny.yaml here (make train), or pass --trainer.accelerator=cpu") in err, err


def test_a_checkpoint_at_max_steps_and_one_of_another_length_are_named(tmp_path, cache, monkeypatch, caplog):
    """Resuming a run already at its `max_steps` trains nothing and says so; validating at another sequence length
    than the checkpoint trained on says which it trained on, and its progress lines name no step (validate does not
    restore the training step)."""
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 2))
    last = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.warns(UserWarning, match=r"is at step 2 and trainer\.max_steps=2: nothing is left to train"):
        main(fit_args(tmp_path, cache, 2, "--ckpt_path", "last"))
    assert torch.load(last, weights_only=False)["global_step"] == 2
    args = ["validate", "--config", "recipes/tiny.yaml", *SMALL, f"--data.cache_dir={cache}", "--ckpt_path",
            str(last), f"--trainer.default_root_dir={tmp_path / 'val'}"]
    with pytest.warns(UserWarning, match=r"trained on sequences of 64 tokens; this validation reads 128 "
                                         r"\(--data\.seq_len=64 reads what it trained on\)"), caplog.at_level("INFO"):
        main([*args, "--data.seq_len=128", "--trainer.enable_progress_bar=true"])
    lines = [r.getMessage() for r in caplog.records]
    assert "validating 2 batches" in lines and any(m.startswith("validation · val/bpb ") for m in lines), lines


def test_a_run_prepared_in_path_order_resumes_in_that_order(tmp_path, cache, monkeypatch, caplog):
    """A checkpoint of a run whose corpus was tokenized sorted by path (written before the order was a setting, so
    its data settings do not record it) resumes in that order: its saved position points into those chunks."""
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 2, "--data.shuffle_documents=false"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    del ckpt["datamodule_hyper_parameters"]["shuffle_documents"]
    torch.save(ckpt, last)
    with caplog.at_level("INFO"):
        cli = K3CLI(args=fit_args(tmp_path, cache, 4, "--ckpt_path", "last"))
    assert "prepared with shuffle_documents=False; this run continues in that order" in caplog.text
    assert cli.datamodule.shuffle_documents is False and cli.trainer.global_step == 4
    assert torch.load(last, weights_only=False)["datamodule_hyper_parameters"]["shuffle_documents"] is False


def test_progress_lines_show_the_throughput_just_logged(tmp_path, cache, monkeypatch, caplog):
    """The tok/s of a progress line is the `train/device/items_per_sec` logged at the same step."""
    monkeypatch.chdir(Path(__file__).parents[1])
    args = [a for a in fit_args(tmp_path, cache, 6) if a != "--trainer.enable_progress_bar=false"]
    caplog.set_level("INFO")
    main(args + ["--trainer.log_every_n_steps=2", "--trainer.callbacks+=k3lit.train.callbacks.K3ThroughputMonitor",
                 "--trainer.callbacks.window_size=2"])
    lines = {int(m.group(1)): m.group(2) for r in caplog.records
             if (m := re.match(r"step (\d+)/6 · train/loss .* · ([\d,]+) tok/s per device · \d+:\d\d:\d\d left$",
                               r.getMessage()))}
    logged = read_metric(tmp_path, "train/device/items_per_sec")
    assert set(lines) == {4, 6}  # the rolling window (2 logging steps) is full from the second one, step 4, on
    assert all(lines[s] == f"{logged[s - 1]:,.0f}" for s in lines)  # logged at step s - 1 (0-based) = line s


@pytest.mark.parametrize("flag", [["--top_k", "0"], ["--temperature", "-1"]])
def test_generate_checks_sampling_flags_before_loading(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--ckpt", str(tmp_path / "not_read.ckpt"), *flag])
    assert e.value.code == 2 and f"({flag[0]}): must be" in capsys.readouterr().err


def test_generate_refuses_a_prompt_and_a_prompt_file_together(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--ckpt", str(tmp_path / "not_read.ckpt"), "--prompt", "x", "--prompt_file", "f.txt"])
    assert e.value.code == 2 and "give --prompt or --prompt_file, not both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--ckpt", str(tmp_path / "not_read.ckpt"), "--prompt_file", str(tmp_path / "nope.txt")])
    assert e.value.code == 2 and f"--prompt_file {tmp_path / 'nope.txt'}: no such file" in capsys.readouterr().err


def test_resume_from_an_empty_folder_starts_from_scratch_and_says_where_it_looked(tmp_path, cache, monkeypatch,
                                                                                  recwarn):
    """`--ckpt_path last` before any checkpoint exists (the first job of a chain) is not an error: the warning
    names the folder k3lit looked in, instead of Lightning's hint to set ``save_last`` (k3lit does)."""
    monkeypatch.chdir(Path(__file__).parents[1])
    main(fit_args(tmp_path, cache, 2, "--ckpt_path", "last"))
    assert sorted(read_metric(tmp_path, "train/loss")) == [0, 1]
    messages = [str(w.message) for w in recwarn]
    assert any("no last.ckpt in" in m and str(tmp_path / "checkpoints") in m for m in messages)
    assert not any("save_last=True" in m for m in messages)


def test_document_masking_takes_the_eos_id_from_the_data(tmp_path, cache, monkeypatch):
    """``--model.document_masking=true`` trains with the tokenizer's end-of-document id (byte: 256), recorded in the
    saved config; the model's documents split there."""
    monkeypatch.chdir(Path(__file__).parents[1])
    cli = K3CLI(args=fit_args(tmp_path, cache, 3)[1:] + ["--model.document_masking=true"], run=False)
    assert cli.model.model.config.eos_id == 256
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 3
    assert "eos_id: 256" in (tmp_path / "config.yaml").read_text()


def test_garbage_collection_is_a_default_callback_and_a_users_setting_replaces_it(tmp_path, cache, monkeypatch):
    from k3lit.train.garbage import GarbageCollection

    monkeypatch.chdir(Path(__file__).parents[1])
    default = K3CLI(args=fit_args(tmp_path / "a", cache, 3)[1:], run=False)
    assert [c.every_n_steps for c in default.trainer.callbacks if isinstance(c, GarbageCollection)] == [100]
    off = K3CLI(args=fit_args(tmp_path / "b", cache, 3)[1:] + [
        "--trainer.callbacks+=k3lit.train.garbage.GarbageCollection", "--trainer.callbacks.every_n_steps=0"],
        run=False)
    assert [c.every_n_steps for c in off.trainer.callbacks if isinstance(c, GarbageCollection)] == [0]
