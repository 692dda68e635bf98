"""A checkpoint that cannot be read (truncated, random bytes, empty, a sharded folder with a missing or garbage shard
or garbage .metadata) ends `k3lit fit`, `validate`, `generate` and `export` with one line naming it, no traceback."""

import random
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from k3lit.cli import main
from k3lit.train.checkpoint import CheckpointError, check_checkpoint
from tests.parallel._dist import one_process_env
from tests.test_cli import SMALL, fit_args

ROOT = Path(__file__).parents[2]
SHARDED = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=ModelParallelStrategy",
           "--trainer.strategy.data_parallel_size=1", "--trainer.strategy.tensor_parallel_size=1"]
NARROW = ["--model.n_layers=2", "--model.layer_pattern=KA", "--data.seq_len=32", "--trainer.limit_val_batches=0"]


@pytest.fixture(scope="module")
def written(tmp_path_factory, stdlib_cache) -> dict[str, Path]:
    """Real checkpoints of two training steps: ``file`` (one device) and ``sharded`` (ModelParallelStrategy, torch
    distributed checkpoint, one process)."""
    tmp = tmp_path_factory.mktemp("written")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        main(fit_args(tmp / "file", stdlib_cache, 2, *NARROW))
        one_process_env(mp)
        try:
            main(fit_args(tmp / "sharded", stdlib_cache, 2, *NARROW, *SHARDED))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    out = {"file": tmp / "file" / "checkpoints" / "last.ckpt", "sharded": tmp / "sharded" / "checkpoints" / "last.ckpt"}
    assert out["file"].is_file() and out["sharded"].is_dir()
    return out


def _garbage(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def _spoil(kind: str, written: dict[str, Path], tmp: Path) -> Path:
    """A copy of a real checkpoint spoilt the way ``kind`` says."""
    if kind in ("truncated", "random", "empty"):
        f = tmp / "bad.ckpt"
        whole = written["file"].read_bytes()
        f.write_bytes({"truncated": whole[: len(whole) // 2], "random": _garbage(len(whole)), "empty": b""}[kind])
        return f
    folder = shutil.copytree(written["sharded"], tmp / "bad.ckpt")
    shard = folder / "__0_0.distcp"
    if kind == "missing_shard":
        shard.unlink()
    elif kind == "garbage_shard":
        shard.write_bytes(_garbage(shard.stat().st_size))
    else:
        (folder / ".metadata").write_bytes(_garbage((folder / ".metadata").stat().st_size))
    return folder


FAULTS = {
    "truncated": "truncated or not a torch checkpoint",
    "random": "truncated or not a torch checkpoint",
    "empty": "empty file (0 bytes)",
    "missing_shard": "shard __0_0.distcp is missing",
    "garbage_shard": "shard __0_0.distcp is garbage",
    "garbage_metadata": ".metadata is garbage",
}


def _command(name: str, ckpt: Path, cache: str, tmp: Path) -> list[str]:
    if name == "fit":
        return fit_args(tmp / "run", cache, 2, "--ckpt_path", str(ckpt))
    if name == "validate":
        return ["validate", "--config", "recipes/tiny.yaml", *SMALL, f"--data.cache_dir={cache}",
                f"--trainer.default_root_dir={tmp / 'run'}", "--ckpt_path", str(ckpt)]
    if name == "generate":
        return ["generate", "--ckpt", str(ckpt), "--max_new_tokens", "4"]
    return ["export", "--ckpt", str(ckpt), "--out", str(tmp / "hf")]


def test_the_real_checkpoints_pass_the_check(written):
    assert check_checkpoint(written["file"]) == written["file"]
    assert check_checkpoint(written["sharded"]) == written["sharded"]


@pytest.mark.parametrize("kind", list(FAULTS))
@pytest.mark.parametrize("command", ["fit", "validate", "generate", "export"])
def test_a_bad_checkpoint_ends_the_command_with_one_line_naming_it(command, kind, written, stdlib_cache, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    bad = _spoil(kind, written, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(_command(command, bad, stdlib_cache, tmp_path))
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "Traceback" not in err, err
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"k3lit: checkpoint {bad} cannot be read: "), err
    assert FAULTS[kind] in last and last.endswith("pass a checkpoint written by k3lit fit"), last
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_sharded_checkpoint_under_one_device_strategy_names_the_strategy_that_loads_it(command, written,
                                                                                        stdlib_cache, tmp_path,
                                                                                        monkeypatch, capsys):
    """Lightning's single-device loader would open the folder as a file (IsADirectoryError, a traceback)."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(_command(command, written["sharded"], stdlib_cache, tmp_path))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert (f"--ckpt_path {written['sharded']} is a sharded checkpoint (torch distributed checkpoint shards), which "
            "loads under ModelParallelStrategy on any number of processes; on one: " + " ".join(SHARDED[2:])) in err


def test_a_run_folder_given_for_a_checkpoint_names_the_file_to_pass(written):
    for folder in (written["file"].parent, written["file"].parents[1]):  # the checkpoints folder, the run folder
        with pytest.raises(CheckpointError, match=rf"a folder without \.metadata .*; pass one of its checkpoint "
                                                  rf"files, e\.g\. {written['file']}$"):
            check_checkpoint(folder)
