"""A process killed while it saves a checkpoint leaves the previous `last.ckpt` whole and `--ckpt_path last`
resuming from it: a single file, and a sharded folder written by 2 gloo processes; and the steps of a save in between
(`.partial`, `.replaced`) always leave a whole checkpoint where fit finds it."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from k3lit.cli import main
from k3lit.train.checkpoint import CheckpointError, check_checkpoint
from k3lit.train.checkpoint_save import commit, settle, settle_folder, staged_paths
from tests.parallel._dist import free_port, one_process_env
from tests.test_cli import fit_args

ROOT = Path(__file__).parents[2]
NARROW = ["--model.n_layers=2", "--model.layer_pattern=KA", "--data.seq_len=32", "--trainer.limit_val_batches=0",
          "--trainer.val_check_interval=2"]
SHARDED = ["--trainer.accelerator=cpu", "--trainer.strategy=ModelParallelStrategy",
           "--trainer.strategy.tensor_parallel_size=1"]
PADDING_MB = 128  # makes the killed save take a few tenths of a second
HERE = "tests.train.test_checkpoint_save"


class SlowSave(Callback):
    """Adds ``PADDING_MB`` of zeros to the checkpoint of step ``at``, so that writing it takes a while, and touches
    ``marker`` as that save begins (rank zero)."""

    def __init__(self, at: int, marker: str) -> None:
        self.at, self.marker = at, marker

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.at:
            checkpoint["padding"] = torch.zeros(PADDING_MB * 2**18)
            if trainer.is_global_zero:
                Path(self.marker).touch()


class StartStep(Callback):
    """Writes the step training starts from to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(str(trainer.global_step))


def _files(folder: Path) -> dict[Path, tuple[int, int, int]]:
    """(inode, mtime, size) of every file under ``folder``; files that vanish while it looks are left out."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            out[Path(root, name)] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def _kill_mid_save(cmd: list[str], folder: Path, marker: Path, log: Path, tmpdir: Path) -> Path:
    """Run ``cmd`` with ``tmpdir`` as its temporary folder; once ``marker`` appears, SIGKILL its whole process group
    as soon as a file under ``folder`` that is new or rewritten since holds 16 MB (the padded save is under way).
    Returns that file."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), "TMPDIR": str(tmpdir)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.01)
        before = _files(folder)
        while True:
            for path, (ino, mtime, size) in _files(folder).items():
                if before.get(path, (0, 0, 0))[:2] != (ino, mtime) and size >= 16 * 2**20:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return path
            assert proc.poll() is None, "the save ended before it was seen: " + log.read_text()[-4000:]
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _step(ckpt: Path) -> int:
    check_checkpoint(ckpt)
    return torch.load(ckpt / "meta.pt" if ckpt.is_dir() else ckpt, weights_only=False)["global_step"]


def _resume(root: Path, cache: str, *extra: str) -> int:
    """`k3lit fit --ckpt_path last` to step 4 in this process; returns the step it started from."""
    main(fit_args(root, cache, 4, *NARROW, *extra, "--ckpt_path", "last", f"--trainer.callbacks+={HERE}.StartStep",
                  f"--trainer.callbacks.path={root / 'start'}"))
    return int((root / "start").read_text())


def _slow_fit(root: Path, cache: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "k3lit.cli", *fit_args(root, cache, 4, *NARROW, *extra),
            f"--trainer.callbacks+={HERE}.SlowSave", "--trainer.callbacks.at=4",
            f"--trainer.callbacks.marker={root / 'saving'}"]


@pytest.fixture
def tmpdir_elsewhere(tmp_path) -> Path:
    """A temporary folder on another filesystem than ``tmp_path`` where there is one (/dev/shm), as a node-local /tmp
    beside checkpoints on a shared filesystem."""
    if not os.path.isdir("/dev/shm"):
        (tmp_path / "tmp").mkdir()
        yield tmp_path / "tmp"
        return
    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder)


def test_killed_during_a_save_the_previous_file_stays_and_resumes(tmp_path, stdlib_cache, monkeypatch,
                                                                  tmpdir_elsewhere):
    monkeypatch.chdir(ROOT)
    root, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    seen = _kill_mid_save(_slow_fit(root, stdlib_cache), ckpts, root / "saving", tmp_path / "log", tmpdir_elsewhere)
    assert _step(ckpts / "last.ckpt") == 2, f"killed while {seen} was written"
    # the checkpoint is written straight beside its place: no copy of it is left in the temporary folder
    assert not [f for f in tmpdir_elsewhere.rglob("*") if f.is_file() and f.stat().st_size >= 2**20]
    assert _resume(root, stdlib_cache) == 2
    assert _step(ckpts / "last.ckpt") == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]


@pytest.mark.slow
def test_killed_during_a_sharded_save_the_previous_folder_stays_and_resumes(tmp_path, stdlib_cache, monkeypatch,
                                                                           tmpdir_elsewhere):
    """2 gloo processes write the folder (one shard each), killed together while rank zero writes its part; the
    previous folder resumes on one process."""
    monkeypatch.chdir(ROOT)
    root, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    cmd = _slow_fit(root, stdlib_cache, *SHARDED, "--trainer.devices=2", "--trainer.strategy.data_parallel_size=2")
    seen = _kill_mid_save(cmd, ckpts, root / "saving", tmp_path / "log", tmpdir_elsewhere)
    last = ckpts / "last.ckpt"
    assert _step(last) == 2 and sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], \
        f"killed while {seen} was written"
    one_process_env(monkeypatch)
    try:
        start = _resume(root, stdlib_cache, *SHARDED, "--trainer.devices=1", "--trainer.strategy.data_parallel_size=1")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert start == 2 and _step(last) == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]


def _tree(p: Path) -> dict[str, str]:
    return {str(f.relative_to(p)): f.read_text() for f in p.rglob("*") if f.is_file()} if p.is_dir() else {
        "": p.read_text()}


def _write(p: Path, content: dict[str, str]) -> None:
    """A stand-in checkpoint: a file (key "") or a folder of files."""
    if "" in content:
        p.write_text(content[""])
        return
    p.mkdir()
    for name, text in content.items():
        (p / name).write_text(text)


FILE_OLD, FILE_NEW = {"": "old"}, {"": "new"}
FOLDER_OLD, FOLDER_NEW = {"__0_0.distcp": "old 0", "meta.pt": "old"}, {"__0_0.distcp": "new 0", "__1_0.distcp": "new 1"}


@pytest.mark.parametrize("old,new", [(FILE_OLD, FILE_NEW), (FOLDER_OLD, FOLDER_NEW), (FILE_OLD, FOLDER_NEW),
                                     (FOLDER_OLD, FILE_NEW), (None, FOLDER_NEW)],
                         ids=["file", "folder", "file_to_folder", "folder_to_file", "first"])
def test_commit_puts_the_partial_checkpoint_in_place(tmp_path, old, new):
    path = tmp_path / "last.ckpt"
    partial, replaced = staged_paths(path)
    if old is not None:
        _write(path, old)
    _write(partial, new)
    commit(path)
    assert _tree(path) == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_settle_finishes_a_swap_killed_between_its_renames_and_drops_a_killed_write(tmp_path):
    path = tmp_path / "last.ckpt"
    partial, replaced = staged_paths(path)
    _write(replaced, FOLDER_OLD)  # the old folder moved aside, the new one not yet moved in
    _write(partial, FOLDER_NEW)
    with pytest.raises(CheckpointError, match=rf"its last save stopped between two renames.*pass {partial}"):
        check_checkpoint(path)  # read-only commands say where the checkpoint is
    settle(path)
    assert _tree(path) == FOLDER_NEW and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    _write(partial, {"__0_0.distcp": "half"})  # a save killed while writing
    settle(path)
    assert _tree(path) == FOLDER_NEW and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    path.rename(replaced)  # the old folder aside and no new one: the old one comes back
    settle(path)
    assert _tree(path) == FOLDER_NEW and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    _write(partial, FOLDER_NEW)
    _write(tmp_path / "notes.partial", {"": "not a checkpoint"})
    settle_folder(tmp_path)  # what fit runs on its checkpoint folders: checkpoints only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "notes.partial"]
