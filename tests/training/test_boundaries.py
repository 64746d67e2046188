"""The step-boundary guard every training loop runs: when it checkpoints, how it stops, what it keeps."""

import math
import os
import signal

import pytest

from geofm.errors import GeoFMError, LossNotFiniteError, RunInterrupted
from geofm.training.boundaries import StepBoundaries


def boundaries(saved: list[int], *, world_size: int = 1, step: int = 0) -> StepBoundaries:
    return StepBoundaries(saved.append, world_size=world_size, checkpoint_every=3, stop_at=7, step=step)


def test_checkpoints_every_interval_and_at_the_last_step():
    saved = []
    with boundaries(saved) as guard:
        done = [guard.reached(step) for step in range(1, 8)]
    assert saved == [3, 6, 7]
    assert done == [False] * 6 + [True]
    assert guard.saved_step == 7


def test_a_signal_saves_the_step_reached_and_stops():
    saved = []
    with pytest.raises(RunInterrupted, match="stopped by SIGTERM at step 2"), boundaries(saved) as guard:
        guard.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        guard.reached(2)
    assert saved == [2]


def test_bad_input_on_one_process_keeps_the_progress():
    saved = []
    with pytest.raises(GeoFMError), boundaries(saved, step=3) as guard:
        guard.reached(4)
        guard.reached(5)
        raise GeoFMError("corrupt.tif: truncated")
    assert saved == [5]


@pytest.mark.parametrize(
    "world_size, error, expected",
    [
        (1, GeoFMError("corrupt.tif"), [1]),  # bad input on one process: the step reached is kept
        (2, GeoFMError("corrupt.tif"), []),  # several processes would wait on each other in a lone save
        (1, ValueError("a bug, not bad input"), []),
    ],
)
def test_a_save_on_bad_input_only_on_one_process_and_never_for_other_errors(world_size, error, expected):
    saved = []
    with pytest.raises(type(error)), boundaries(saved, world_size=world_size) as guard:
        guard.reached(1)
        raise error
    assert saved == expected


def test_nothing_saved_twice_when_the_error_follows_a_checkpoint():
    saved = []
    with pytest.raises(OSError), boundaries(saved) as guard:
        guard.reached(3)
        raise OSError("disk went away")
    assert saved == [3]


def test_a_non_finite_loss_names_the_step_and_the_intact_checkpoint_and_saves_nothing():
    saved = []
    message = "step 5: loss is not finite .*checkpoints up to step 3 are intact"
    with pytest.raises(LossNotFiniteError, match=message) as info, boundaries(saved) as guard:
        guard.reached(3)
        guard.check_finite({"step": 4, "loss": 0.5})
        guard.reached(4)
        guard.check_finite({"step": 5, "loss": math.nan})
    assert isinstance(info.value, GeoFMError), "the command line reports it as one line"
    assert saved == [3], "the diverged weights are not checkpointed"
