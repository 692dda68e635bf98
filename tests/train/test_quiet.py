"""quiet_third_party drops exactly the messages it lists; other warnings and log records pass."""

import logging
import warnings

import pytest

from k3lit.train.quiet import quiet_third_party, quiet_validate

AWARE = ("Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided during "
         "`Trainer` instantiation. Please add the following callbacks: ")
NOISE = [
    ("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "lightning.pytorch.utilities._pytree"),
    ("some API is deprecated", DeprecationWarning, "lightning.fabric.utilities.throughput"),
    ("Your `IterableDataset` has `__len__` defined. In combination with ...", UserWarning, "lightning.pytorch.x"),
    ("It is recommended to use `self.log('val/loss', ..., sync_dist=True)` when ...", UserWarning, "lightning.x"),
    ("Detected an existing checkpoint in runs/x/checkpoints/last.ckpt, overwriting since self.overwrite=True.",
     UserWarning, "torch.distributed.checkpoint.filesystem"),
    (AWARE + """["LastCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 3}", 'Timer'].""",
     UserWarning, "lightning.pytorch.trainer.call"),
    (AWARE + "['Timer'].", UserWarning, "lightning.pytorch.trainer.call"),
]
KEPT = [
    ("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "k3lit.model"),  # ours: to be fixed, not hidden
    ("It is recommended to use `self.log('train/loss', ..., sync_dist=True)` when ...", UserWarning, "lightning.x"),
    ("The dirpath has changed from 'a' to 'b'", UserWarning, "lightning.pytorch.callbacks.model_checkpoint"),
    (AWARE + "['Timer', \"EarlyStopping{'monitor': 'val/loss', 'mode': 'min'}\"].", UserWarning,
     "lightning.pytorch.trainer.call"),  # a user's callback: the warning says what to do
]


def _emit(message: str, category: type[Warning], module: str) -> None:
    warnings.warn_explicit(message, category, filename=module.replace(".", "/") + ".py", lineno=1, module=module)


def test_listed_warnings_are_dropped_and_others_pass():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party()
        quiet_third_party()  # idempotent
        for args in NOISE + KEPT:
            _emit(*args)
    assert [str(w.message) for w in caught] == [m for m, _, _ in KEPT]


SRUN = ("The `srun` command is available on your system but is not used. HINT: If your intention is to run Lightning "
        "on SLURM, prepend your python command with `srun` like so: srun python k3lit fit ...")


@pytest.mark.parametrize("in_job", [False, True])
def test_the_srun_hint_passes_inside_a_slurm_job_only(monkeypatch, in_job):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if in_job:
        monkeypatch.setenv("SLURM_JOB_ID", "42")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party()
        _emit(SRUN, UserWarning, "lightning.fabric.plugins.environments.slurm")
    assert [str(w.message) for w in caught] == ([SRUN] if in_job else [])


def test_lightning_tips_are_dropped_from_its_log(caplog):
    quiet_third_party()
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO):
        log.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger")
        log.info("Trainer.fit stopped: max_steps=3 reached.")
    assert [r.getMessage() for r in caplog.records] == ["Trainer.fit stopped: max_steps=3 reached."]


def test_validate_also_drops_the_moved_checkpoint_folder_notice():
    dirpath = ("The dirpath has changed from 'runs/tiny/checkpoints' to 'runs/tiny-val/checkpoints', therefore "
               "`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and `best_k_models` won't "
               "be reloaded.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party()
        quiet_validate()
        _emit(dirpath, UserWarning, "lightning.pytorch.callbacks.model_checkpoint")
        _emit(*KEPT[1])
    assert [str(w.message) for w in caught] == [KEPT[1][0]]
