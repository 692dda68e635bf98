"""K3ThroughputMonitor takes the dense peak of Hopper GPUs from k3lit's table, without Lightning's 'FLOPs not found'."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from k3lit.train.callbacks import K3ThroughputMonitor
from k3lit.train.flops import compute_dtype


def fake_trainer(precision: str) -> SimpleNamespace:
    return SimpleNamespace(precision=precision, precision_plugin=MixedPrecision(precision, "cuda"),
                           strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), enable_validation=True,
                           world_size=1, state=SimpleNamespace(stage=RunningStage.TRAINING))


@pytest.mark.parametrize("name,peak", [("NVIDIA H200", 989.4e12), ("NVIDIA H100 80GB HBM3", 989.4e12)])
def test_hopper_peak_without_lightnings_warning(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    monitor = K3ThroughputMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.setup(fake_trainer("bf16-mixed"), None, TrainerFn.FITTING)
    assert not [w for w in caught if "FLOPs not found" in str(w.message)]
    assert monitor.available_flops == peak


def test_an_unknown_gpu_is_still_reported_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA Imaginary 9000")
    monitor = K3ThroughputMonitor()
    with pytest.warns(UserWarning, match="FLOPs not found for 'NVIDIA Imaginary 9000'") as caught:
        monitor.setup(fake_trainer("bf16-mixed"), None, TrainerFn.FITTING)
    assert sum("FLOPs not found" in str(w.message) for w in caught) == 1 and monitor.available_flops is None


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16),
                                             ("16-mixed", torch.float16), ("16-true", torch.float16),
                                             ("32-true", torch.float32), ("64-true", torch.float64)])
def test_compute_dtype_of_lightning_precisions(precision, dtype):
    assert compute_dtype(precision) == dtype
