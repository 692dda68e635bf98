"""Background checkpoint writes: the file holds the state of the step that saved it, whatever training does after
the save returns (CUDA: stream order), shared tensors stay shared, a failed write raises, removal and teardown wait;
``k3lit fit`` uses it on one device, and a time-based validation interval paces the checkpoint and the heatmap."""

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from k3lit.cli import K3CLI
from k3lit.train.callbacks import LastCheckpoint
from k3lit.train.checkpoint_background import BackgroundCheckpointIO, finish_writes
from k3lit.train.expert_plots import ExpertLoadPlots
from tests.test_cli import fit_args

ROOT = Path(__file__).parents[2]


class GatedIO(BackgroundCheckpointIO):
    """Its writer thread waits for ``gate`` before writing, so the test acts while a write is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def _write(self, *args) -> None:
        assert self.gate.wait(30)
        super()._write(*args)


def _state(device: str) -> dict:
    w = torch.arange(6.0, device=device).reshape(2, 3)
    return {"state_dict": {"embed.weight": w, "head.weight": w.detach(), "step": torch.tensor(7, device=device)},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.full((3,), 2.0, device=device)}}}],
            "loops": {"epoch": 1, "names": ["a", "b"]}, "hparams": (1, "x")}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_file_holds_the_saved_step_whatever_training_writes_next(tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    io, path = GatedIO(), tmp_path / "last.ckpt"
    state = _state(device)
    io.save_checkpoint(state, path)
    assert not path.exists() and not (tmp_path / "last.ckpt.partial").exists()  # nothing written yet
    if device == "cuda":  # a long kernel queued behind the copies, then in-place updates as the next step's would be
        torch.cuda._sleep(50_000_000)
    state["state_dict"]["embed.weight"].mul_(-1)
    state["optimizer_states"][0]["state"][0]["exp_avg"].zero_()
    state["loops"]["names"].append("c")
    io.gate.set()
    io.wait()
    got = torch.load(path, weights_only=False)
    emb, head = got["state_dict"]["embed.weight"], got["state_dict"]["head.weight"]
    assert emb.device.type == "cpu" and torch.equal(emb, torch.arange(6.0).reshape(2, 3))
    assert emb.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()  # tied weights stay one tensor
    assert torch.equal(got["optimizer_states"][0]["state"][0]["exp_avg"], torch.full((3,), 2.0))
    assert got["loops"] == {"epoch": 1, "names": ["a", "b"]} and got["hparams"] == (1, "x")
    assert got["state_dict"]["step"].item() == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    io.teardown()


@pytest.mark.gpu
def test_pinned_buffers_are_reused_from_save_to_save(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    io, state = BackgroundCheckpointIO(), _state("cuda")
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    first = [b.data_ptr() for b in io._buffers]
    state["state_dict"]["embed.weight"].add_(1)
    io.save_checkpoint(state, tmp_path / "b.ckpt")
    io.wait()
    assert [b.data_ptr() for b in io._buffers] == first and all(b.is_pinned() for b in io._buffers)
    assert torch.load(tmp_path / "a.ckpt", weights_only=False)["state_dict"]["embed.weight"][0, 0].item() == 0
    assert torch.load(tmp_path / "b.ckpt", weights_only=False)["state_dict"]["embed.weight"][0, 0].item() == 1
    io.teardown()


@pytest.mark.gpu
def test_a_checkpoint_too_large_for_the_free_host_memory_is_written_at_once(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import k3lit.train.checkpoint_background as background

    monkeypatch.setattr(background, "_available_host_bytes", lambda: 64)  # less than twice the state's CUDA bytes
    io, path = BackgroundCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_state("cuda"), path)
    assert io._pending is None and io._buffers == []
    assert torch.load(path, weights_only=False)["state_dict"]["step"].item() == 7
    io.teardown()


def test_a_failed_write_raises_at_the_next_wait_and_keeps_the_previous_file(tmp_path):
    io, path = BackgroundCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_state("cpu"), path)
    io.save_checkpoint({**_state("cpu"), "hook": lambda: 0}, path)  # a lambda cannot be pickled
    with pytest.raises(Exception, match="lambda"):
        io.wait()
    io.wait()  # raised once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert "hook" not in torch.load(path, weights_only=False)
    io.teardown()


def test_removal_and_teardown_wait_for_the_write_in_flight(tmp_path):
    io, path = GatedIO(), tmp_path / "old.ckpt"
    io.save_checkpoint(_state("cpu"), path)
    remover = threading.Thread(target=io.remove_checkpoint, args=(path,))
    remover.start()
    remover.join(0.3)
    assert remover.is_alive()  # removal waits for the write, which would otherwise land after it
    io.gate.set()
    remover.join(30)
    assert not path.exists()
    io.save_checkpoint(_state("cpu"), path)
    io.teardown()
    assert torch.load(path, weights_only=False)["loops"]["epoch"] == 1


def test_fit_writes_in_the_background_and_a_save_outside_fit_is_on_disk_at_once(tmp_path, stdlib_cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    cli = K3CLI(args=fit_args(tmp_path, stdlib_cache, 2)[1:], run=False)
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, BackgroundCheckpointIO)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert io._pending is None  # fit's teardown waited
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    cli.trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert io._pending is None and (tmp_path / "after.ckpt").is_file()
    finish_writes(cli.trainer)


def test_a_time_interval_paces_the_checkpoint_and_the_heatmap(tmp_path, stdlib_cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = fit_args(tmp_path, stdlib_cache, 8)[1:] + ["--trainer.val_check_interval=00:00:01:30"]
    cli = K3CLI(args=args, run=False)
    last = next(c for c in cli.trainer.callbacks if isinstance(c, LastCheckpoint))
    plots = next(c for c in cli.trainer.callbacks if isinstance(c, ExpertLoadPlots))
    assert last._train_time_interval == timedelta(seconds=90) and last._every_n_train_steps == 0
    assert plots.every_n_steps is None


def test_the_heatmap_at_each_validation(tmp_path, stdlib_cache, monkeypatch):
    """``ExpertLoadPlots(every_n_steps=None)`` draws when a validation of ``fit`` ends, and at the end."""
    monkeypatch.chdir(ROOT)
    args = fit_args(tmp_path, stdlib_cache, 5)[1:] + [
        "--trainer.val_check_interval=2", "--trainer.callbacks+=k3lit.train.expert_plots.ExpertLoadPlots",
        "--trainer.callbacks.every_n_steps=null"]
    cli = K3CLI(args=args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    pngs = sorted(p.name for p in (tmp_path / "expert_load").glob("*.png"))
    assert pngs == ["step0000002.png", "step0000004.png", "step0000005.png"]


def test_available_host_memory_counts_the_reclaimable_page_cache():
    import k3lit.train.checkpoint_background as background

    meminfo = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo")}
    # between the free pages alone and the whole memory (MemAvailable moves a little between the two reads)
    assert meminfo["MemFree"] * 0.9 <= background._available_host_bytes() <= meminfo["MemTotal"]


def test_last_checkpoint_needs_one_trigger(tmp_path):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="not both or neither"):
        LastCheckpoint(tmp_path)
    with pytest.raises(MisconfigurationException, match="not both or neither"):
        LastCheckpoint(tmp_path, 5, train_time_interval=timedelta(seconds=1))
