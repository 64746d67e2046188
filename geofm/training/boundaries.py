"""The optimizer-step boundaries of a training run: checkpoints when due, a clean stop on SIGINT or
SIGTERM, the progress kept when bad input ends a run, and the finiteness check of each log record."""

from __future__ import annotations

import logging
import signal
import threading

import torch

from geofm.errors import GeoFMError, LossNotFiniteError, RunInterrupted
from geofm.runlog import is_finite
from geofm.training import engine as ds

log = logging.getLogger("geofm.training")


class StopSignals:
    """SIGINT/SIGTERM become a stop request honoured at the next optimizer-step boundary.

    Cluster schedulers send SIGTERM before they kill a job; stopping between steps leaves the
    model and optimizer consistent for the checkpoint written on the way out. A second signal
    interrupts at once. Several processes agree on the request each step, so they stop together.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def requested(self) -> bool:
        """Whether any process received a stop signal (a collective call when distributed)."""
        flag = torch.tensor([float(self.received is not None)])
        return bool(ds.max_across_ranks(flag))

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "another process"


class StepBoundaries:
    """The optimizer-step boundaries of a training loop: checkpoints when due, a clean stop on a signal,
    and the progress kept when bad input ends a run.

    Used as ``with StepBoundaries(save, ...) as boundaries:`` around the loop, calling
    :meth:`reached` after every optimizer step. ``save(step)`` writes a checkpoint (all processes
    call it together). An input error (:class:`~geofm.errors.GeoFMError`, ``OSError``) raised in the
    loop on one process saves the step reached before it propagates (a non-finite loss does not:
    that step is not worth keeping); several processes would wait on each other in the collective
    save, so they rely on their periodic checkpoints.

    Args:
        save: writes the checkpoint of a step.
        world_size: processes training together.
        checkpoint_every: steps between periodic checkpoints (``run.checkpoint_every``).
        stop_at: the last step of this invocation (the end of the schedule or ``stop_after_steps``).
        step: the step the loop starts from (resumed runs: the checkpoint's).
    """

    def __init__(self, save, *, world_size: int, checkpoint_every: int, stop_at: int, step: int) -> None:
        self._save, self.world_size = save, world_size
        self.checkpoint_every, self.stop_at = checkpoint_every, stop_at
        self.step = self.saved_step = step
        self.signals = StopSignals()

    def __enter__(self) -> StepBoundaries:
        self.signals.__enter__()
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.signals.__exit__(exc_type, exc, traceback)
        bad_input = exc_type is not None and issubclass(exc_type, (GeoFMError, OSError))
        diverged = exc_type is not None and issubclass(exc_type, LossNotFiniteError)
        if bad_input and not diverged and self.world_size == 1 and self.step > self.saved_step:
            self.save()
            log.warning("stopped at step %d: saved a checkpoint; fix the input and rerun to resume", self.step)

    def check_finite(self, record: dict) -> None:
        """Stop the run at a logged record whose losses are not finite, keeping the checkpoints intact.

        Raises:
            LossNotFiniteError: naming the step and the last checkpoint.
        """
        if not is_finite(record):
            raise LossNotFiniteError(
                f"step {record['step']}: loss is not finite ({record}); checkpoints up to step {self.saved_step} are intact"
            )

    def save(self) -> None:
        """Checkpoint the step reached."""
        self._save(self.step)
        self.saved_step = self.step

    def reached(self, step: int) -> bool:
        """After an optimizer step: checkpoint if due or asked to stop; True when the invocation is done.

        Raises:
            RunInterrupted: after saving, when a process received SIGINT or SIGTERM.
        """
        self.step = step
        stopping = self.signals.requested()
        if step % self.checkpoint_every == 0 or step == self.stop_at or stopping:
            self.save()
        if stopping:
            raise RunInterrupted(
                f"stopped by {self.signals.name()} at step {step}; saved a checkpoint, rerun the same command to resume"
            )
        return step >= self.stop_at
