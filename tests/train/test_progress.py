"""Where a run will end: max_steps or max_time, whichever comes first, at the run's own pace."""

from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import Timer

from k3lit.train.progress import Horizon, StepPace, run_horizon


class FixedTimer(Timer):
    """A Timer with ``seconds`` left of its duration."""

    def __init__(self, seconds: float | None) -> None:
        super().__init__(duration=None if seconds is None else "00:01:00:00")
        self.seconds = seconds

    def time_remaining(self, stage: str = "train") -> float | None:
        return self.seconds


def trainer(step: int, max_steps: int, seconds_left: float | None = None, epochs_steps: float = float("inf")):
    return SimpleNamespace(global_step=step, max_steps=max_steps, callbacks=[FixedTimer(seconds_left)],
                           estimated_stepping_batches=epochs_steps)


def test_max_steps_ends_the_run_when_it_comes_first():
    h = run_horizon(trainer(300, 1000, seconds_left=3600.0), seconds_per_step=0.5)
    assert h == Horizon(300, 1000, 350.0, "max_steps")
    assert (h.steps_text(), h.eta_text()) == ("step 300/1000", "0:05:50 left")


def test_max_time_ends_the_run_when_it_comes_first():
    h = run_horizon(trainer(300, 1000, seconds_left=120.0), seconds_per_step=0.5)
    assert h == Horizon(300, 540, 120.0, "max_time")  # 120 s at 2 steps/s: step 540 of 1000
    assert (h.steps_text(), h.eta_text()) == ("step 300/~540 (max_time)", "0:02:00 left")


def test_the_validation_after_the_time_limit_counts_in_the_time_left():
    h = run_horizon(trainer(300, 1000, seconds_left=120.0), seconds_per_step=0.5, validation_seconds=30.0)
    assert h == Horizon(300, 540, 150.0, "max_time")
    by_steps = run_horizon(trainer(300, 1000, seconds_left=3600.0), seconds_per_step=0.5, validation_seconds=30.0)
    assert by_steps.seconds_left == 350.0  # periodic validations are in the pace already


def test_unknown_pace_and_unbounded_runs():
    assert run_horizon(trainer(1, 1000, seconds_left=120.0), None) == Horizon(1, 1000, None, "max_steps")
    assert run_horizon(trainer(5, -1), 0.5) == Horizon(5, None, None, None)
    assert run_horizon(trainer(5, -1, epochs_steps=40), 0.5) == Horizon(5, 40, 17.5, "max_epochs")
    only_time = run_horizon(trainer(5, -1, seconds_left=10.0), 0.5)
    assert only_time == Horizon(5, 25, 10.0, "max_time") and only_time.steps_text() == "step 5/~25 (max_time)"
    assert run_horizon(trainer(5, -1, seconds_left=10.0), None).steps_text() == "step 5 (max_time)"
    assert run_horizon(trainer(5, -1), None).eta_text() is None


def test_pace_leaves_out_the_first_step_and_counts_everything_after():
    pace = StepPace()
    pace.update(1, now=100.0)  # the first step ends after a long start-up
    assert pace.seconds_per_step is None
    pace.update(1, now=101.0)  # no new step: nothing learnt
    assert pace.seconds_per_step is None
    pace.update(3, now=102.0)
    assert pace.seconds_per_step == pytest.approx(1.0)
    pace.validation_started(now=103.0)
    pace.validation_ended(now=109.0)
    pace.update(5, now=110.0)  # a validation in between slows the average down, as it will later on
    assert pace.seconds_per_step == pytest.approx(2.5) and pace.validation_seconds == pytest.approx(6.0)
