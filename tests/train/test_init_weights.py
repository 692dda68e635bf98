"""`k3lit fit --init_weights CKPT`: a new run that starts from a checkpoint's model weights (continued training at
another sequence length, fine-tuning), with its own optimizer, schedule, step count and data order; refused for
another tokenizer; not read when `--ckpt_path` resumes the run."""

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from k3lit.cli import K3CLI, main
from k3lit.model import K3LM, ModelConfig
from k3lit.train.checkpoint import load_initial_weights

ROOT = Path(__file__).parents[2]
MODEL = ["--model.dim=32", "--model.n_layers=4", "--model.n_heads=2", "--model.head_dim=16", "--model.mlp_hidden=64",
         "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=32"]


def _args(root: Path, cache: str, steps: int, *extra: str, tokenizer: str = "byte", seq_len: int = 32) -> list[str]:
    return ["--config", str(ROOT / "recipes" / "tiny.yaml"), f"--data.tokenizer={tokenizer}",
            f"--data.seq_len={seq_len}", "--data.batch_size=2", f"--data.cache_dir={cache}",
            "--trainer.limit_val_batches=0", f"--trainer.max_steps={steps}", "--trainer.max_time=null",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={root}", *extra]


class Start(Callback):
    """The step, the weights (copies) and the optimizer state as training starts, i.e. after any loading."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optim_state = dict(trainer.optimizers[0].state)


def _fit(args: list[str], ckpt_path: str | None = None) -> tuple[K3CLI, Start]:
    cli = K3CLI(args=args, run=False)
    start = Start()
    cli.trainer.callbacks.append(start)
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt_path)
    return cli, start


@pytest.fixture(scope="module")
def source(tmp_path_factory, stdlib_cache) -> Path:
    """A 3-step run of a narrowed tiny model (sequences of 32 tokens): its last.ckpt."""
    root = tmp_path_factory.mktemp("source")
    main(["fit", *_args(root, stdlib_cache, 3, *MODEL)])
    return root / "checkpoints" / "last.ckpt"


def _saved_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


def test_a_run_starts_from_the_checkpoints_weights_at_another_sequence_length(tmp_path, stdlib_cache, source):
    """The recipe's own architecture (tiny's: wider, deeper) is replaced by the checkpoint's, with a warning; the
    weights and the balancers' buffers are the checkpoint's exactly; step 0, no optimizer state; and the run trains
    at 4x the checkpoint's sequence length."""
    with pytest.warns(UserWarning, match=r"--init_weights .*the checkpoint's architecture replaces model\.dim=192"):
        cli, start = _fit(_args(tmp_path, stdlib_cache, 2, "--init_weights", str(source), seq_len=128))
    saved = _saved_weights(source)
    assert start.step == 0 and not start.optim_state
    assert start.weights.keys() == saved.keys() and any("expert_bias" in k for k in saved)
    for name, t in saved.items():
        assert torch.equal(start.weights[name], t), name
    assert cli.trainer.global_step == 2 and cli.datamodule.seq_len == 128
    assert cli.model.model_config.dim == 32 and "init_weights" not in cli.model.hparams


def test_a_resumed_run_reads_its_own_checkpoint_not_init_weights(tmp_path, stdlib_cache, source, caplog):
    """`--ckpt_path last` with `--init_weights` (a requeued job's command line): the first launch, with no last.ckpt
    yet, starts from the weights; the second resumes the run where it stopped, and says it does not read them."""
    args = ["fit", *_args(tmp_path, stdlib_cache, 2, "--init_weights", str(source), "--ckpt_path", "last", *MODEL,
                          "--trainer.log_every_n_steps=1")]
    with pytest.warns(UserWarning, match=f"no last.ckpt in .* yet; this run starts from the weights of {source}"):
        first = K3CLI(args=args)
    assert first.model.init_weights == str(source) and first.trainer.global_step == 2
    last = tmp_path / "checkpoints" / "last.ckpt"
    with caplog.at_level("INFO"):
        second = K3CLI(args=[*args, "--trainer.max_steps=4"])
    assert f"k3lit: resuming from {last}; --init_weights {source} is not read" in caplog.text
    assert second.model.init_weights is None and second.trainer.global_step == 4
    with open(tmp_path / "metrics.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert steps == [0, 1, 2, 3]  # one metrics.csv: the second launch continued the first


def test_another_tokenizer_is_refused_before_anything_runs(tmp_path, stdlib_cache, source):
    with pytest.raises(ValueError, match=r"--init_weights .*trained with tokenizer 'byte', this run reads 'bpe:300', "
                                         r"so .*; set --data\.tokenizer=byte --data\.corpus=stdlib"):
        K3CLI(args=_args(tmp_path, stdlib_cache, 2, "--init_weights", str(source), tokenizer="bpe:300"), run=False)


@pytest.mark.parametrize("subcommand", ["validate", "fit"])
def test_a_ckpt_path_of_another_tokenizer_names_the_tokenizer(tmp_path, stdlib_cache, source, subcommand):
    """`--ckpt_path` of a byte-tokenizer run under a `bpe:300` recipe: the error names the checkpoint's tokenizer and
    corpus, before the vocabulary check would blame a model.vocab_size that came from the checkpoint."""
    with pytest.raises(ValueError, match=r"--ckpt_path .*trained with tokenizer 'byte', this run reads 'bpe:300', "
                                         r"so .*; set --data\.tokenizer=byte --data\.corpus=stdlib"):
        K3CLI(args=[subcommand, *_args(tmp_path, stdlib_cache, 2, "--ckpt_path", str(source), tokenizer="bpe:300")])


def test_a_path_that_is_no_checkpoint_is_named_with_the_flag(tmp_path, stdlib_cache):
    with pytest.raises(ValueError, match=r"--init_weights takes a checkpoint file or sharded folder; 'last' is for "
                                         r"--ckpt_path"):
        K3CLI(args=_args(tmp_path, stdlib_cache, 2, "--init_weights", "last"), run=False)
    with pytest.raises(FileNotFoundError, match=r"^--init_weights: checkpoint .*nope\.ckpt not found"):
        K3CLI(args=_args(tmp_path, stdlib_cache, 2, "--init_weights", str(tmp_path / "nope.ckpt")), run=False)


def test_the_run_folders_own_last_checkpoint_is_refused_before_anything_moves(tmp_path, stdlib_cache, source):
    """A new run moves its folder's last.ckpt aside: starting from that file in the same folder is refused up front,
    and the file stays where it was."""
    root = source.parents[1]
    before = sorted(p.name for p in (root / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"--init_weights .*last\.ckpt is this run folder's own last\.ckpt, which a "
                                         r"new run moves aside; start the new run in another folder"):
        K3CLI(args=_args(root, stdlib_cache, 2, "--init_weights", str(source), seq_len=64), run=False)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == before and source.is_file()


def test_the_same_bpe_spec_trained_on_other_text_is_refused(tmp_path):
    """`bpe:N` is trained on each corpus: the same spec on another corpus has another vocabulary, found once the
    corpus is prepared."""
    corpora = {}
    for name, word in (("a", "alpha beta gamma"), ("b", "delta epsilon zeta")):
        corpora[name] = tmp_path / name
        corpora[name].mkdir()
        for i in range(12):
            (corpora[name] / f"doc{i}.txt").write_text(f"{word} {i}\n" * 60)
    common = ["--data.val_fraction=0.2", "--data.prepare_workers=1"]
    main(["fit", *_args(tmp_path / "src", str(tmp_path / "cache"), 1, *MODEL, f"--data.corpus={corpora['a']}", *common,
                        tokenizer="bpe:300")])
    with pytest.raises(ValueError, match=rf"its tokenizer 'bpe:300' was trained on other text than this run's, .*; "
                                         rf"set --data\.tokenizer=bpe:300 --data\.corpus={corpora['a']}"):
        _fit(_args(tmp_path / "new", str(tmp_path / "cache"), 1, f"--data.corpus={corpora['b']}", *common,
                   "--init_weights", str(tmp_path / "src" / "checkpoints" / "last.ckpt"), tokenizer="bpe:300"))


def test_only_fit_takes_init_weights(tmp_path, stdlib_cache, source):
    with pytest.raises(ValueError, match="--init_weights is for fit; validate takes the weights of --ckpt_path"):
        K3CLI(args=["validate", *_args(tmp_path, stdlib_cache, 1, "--init_weights", str(source))])


def test_another_architecture_names_the_entries_that_differ(source):
    """Through the API (the CLI takes the architecture from the checkpoint): another width is an error that names
    the parameters and both shapes."""
    cfg = ModelConfig(vocab_size=257, dim=48, n_layers=4, n_heads=2, head_dim=16, mlp_hidden=64, n_experts=4, top_k=2,
                      expert_dim=32)
    with pytest.raises(ValueError, match=r"another architecture: .*other shapes \['embed\.weight \(257, 32\) "
                                         r"\(model: \(257, 48\)\)"):
        load_initial_weights(K3LM(cfg), source)
