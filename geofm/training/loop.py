"""The training loop of every program: one micro-step and the optimizer steps around it.

A program supplies its forward pass (a micro-batch in, a :class:`~geofm.tasks.StepOutput` out) and
an iterator of step-batches (each an iterable of the micro-batches of one optimizer step); an
algorithm may add hooks around the gradient, a regulariser and an ascent. Central pretraining and
finetuning run :meth:`TrainLoop.run` (checkpoints, stop signals, progress bar, log records) through
:class:`geofm.training.program.TrainingProgram`; a federated client's round
(:class:`geofm.fl.client_round.ClientRound`) runs its local steps with
:meth:`TrainLoop.local_steps`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from geofm.runlog import MetricsLog, Phases, Throughput, progress_bar
from geofm.tasks import StepOutput
from geofm.training import engine as ds
from geofm.training.boundaries import StepBoundaries

if TYPE_CHECKING:
    from geofm.config import RunConfig
    from geofm.training.engine_config import Schedule
    from geofm.training.rundir import RunStart

log = logging.getLogger("geofm.training")

# A micro-batch's forward pass; ``losses["loss"]`` is what the step minimises.
Forward = Callable[[Any], StepOutput]
# A term added to the loss of a micro-batch, from the batch and the forward's output.
Regulariser = Callable[[Any, StepOutput], torch.Tensor]
# A context that moves the parameters for the gradient of a micro-batch from a first gradient of it:
# it gets the micro-batch's task loss as a closure (SAM's ascent step) and restores them on exit.
Ascent = Callable[[Callable[[], torch.Tensor]], AbstractContextManager]


def micro_step(
    engine,
    forward: Forward,
    batch: Any,
    around_gradient: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    regulariser: Regulariser | None = None,
    ascent: Ascent | None = None,
) -> StepOutput:
    """Forward and backward of one micro-batch; the engine steps the optimizer at accumulation boundaries.

    Args:
        engine: the DeepSpeed engine (``forward`` calls it).
        forward: the micro-batch's forward pass.
        batch: the micro-batch as the loader gives it.
        around_gradient: a context entered around the forward and backward (e.g. FedSense's
            perturbation, which moves the parameters and restores them before the optimizer step).
        regulariser: a term added to the loss (e.g. FedProx's proximal term).
        ascent: a context entered inside ``around_gradient``, given the micro-batch's task loss as a
            closure: SAM computes its ascent gradient from it, moves the parameters for the forward
            and backward, and restores them before the optimizer step. The regulariser stays out of
            the closure: SAM perturbs the training loss, an algorithm's terms stay outside its
            maximisation (as weight decay does in Foret et al.).
    """

    def loss_of() -> tuple[StepOutput, torch.Tensor]:
        output = forward(batch)
        loss = output.losses["loss"]
        return output, loss if regulariser is None else loss + regulariser(batch, output)

    def task_loss() -> torch.Tensor:
        with ds.plain_forward(engine):  # a gradient apart from the engine's backward
            return forward(batch).losses["loss"]

    with around_gradient():
        moved = contextlib.nullcontext() if ascent is None else ascent(task_loss)
        with moved:
            output, loss = loss_of()
            engine.backward(loss)
    engine.step()
    return output


def epoch_steps(
    step: int, steps_per_epoch: int, accum: int, epoch_batches: Callable[[int, int], Iterator]
) -> Iterator[Iterator]:
    """A run's step-batches from ``step`` on, epoch after epoch, for :meth:`TrainLoop.run`.

    ``epoch_batches(epoch, done)`` returns the micro-batches of ``epoch`` after its first ``done``
    steps (a loader's iterator, made when called); each step-batch reads its ``accum``
    micro-batches from it only when the step trains them.
    """
    while True:
        epoch, done = divmod(step, steps_per_epoch)
        batches = epoch_batches(epoch, done)
        for _ in range(done, steps_per_epoch):
            yield itertools.islice(batches, accum)
        step = (epoch + 1) * steps_per_epoch


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the global RNG (drop path) for one step: a pure function, so resumes match."""
    return (seed * 1_000_003 + step * 7_919 + rank) % 2**63


class TrainLoop:
    """Optimizer steps on a DeepSpeed engine, one per step-batch (an iterable of micro-batches).

    Each step reseeds torch's global RNG (and numpy's, with ``seed_numpy``) with ``seed_of(step)``
    after its step-batch is taken from the iterator and before its micro-batches are read: a lazy
    step-batch reads (and augments) each micro-batch in the step's random stream, between the
    micro-steps.

    Args:
        engine: the DeepSpeed engine.
        forward: a micro-batch's forward pass.
        loss_keys: the entries of ``StepOutput.losses`` averaged between log records.
        seed_of: the seed of a step (its index in the run, or in the round for local steps).
        seed_numpy: seed numpy's global RNG too (timm's Mixup draws from it).
        around_gradient, regulariser, ascent: an algorithm's hooks (see :func:`micro_step`).
        on_step: called with a step's index after its optimizer step (a task's EMA teacher).
        images: images per micro-batch over all processes, for the throughput.
    """

    def __init__(
        self,
        engine,
        forward: Forward,
        loss_keys: Iterable[str] = ("loss",),
        *,
        seed_of: Callable[[int], int],
        seed_numpy: bool = False,
        around_gradient: Callable[[], AbstractContextManager] = contextlib.nullcontext,
        regulariser: Regulariser | None = None,
        ascent: Ascent | None = None,
        on_step: Callable[[int], None] | None = None,
        images: int = 0,
    ) -> None:
        self.engine, self.forward = engine, forward
        self.on_step = on_step
        self.seed_of, self.seed_numpy = seed_of, seed_numpy
        self.around_gradient, self.regulariser, self.ascent = around_gradient, regulariser, ascent
        self.images = images
        self.interval, self.speed = IntervalMeans(loss_keys), Throughput()
        self.startup: Phases | None = None

    def step(self, index: int, micro_batches: Iterable) -> None:
        """One optimizer step from the micro-batches of step ``index``."""
        seed = self.seed_of(index)
        torch.manual_seed(seed)
        if self.seed_numpy:
            np.random.seed(seed % 2**32)
        for batch in micro_batches:
            if self.startup is not None and "first_batch" not in self.startup.seconds:
                self.startup.lap("first_batch")
            output = micro_step(self.engine, self.forward, batch, self.around_gradient, self.regulariser, self.ascent)
            self.interval.add(output.losses)
            self.speed.add(self.images)
        if self.on_step is not None:
            self.on_step(index)

    def local_steps(self, step_batches: Iterable[Iterable]) -> tuple[dict[str, float], int]:
        """Train one step per step-batch until the iterator ends (a federated client's round): no
        checkpoints, stop signals, progress bar or log records.

        Returns:
            The means of the losses over these steps' micro-batches, and the number of steps.
        """
        steps = 0
        for steps, micro_batches in enumerate(step_batches, 1):
            self.step(steps - 1, micro_batches)
        return self.interval.means(), steps

    def run(
        self,
        step_batches: Iterator[Iterable],
        start: RunStart,
        *,
        step: int,
        schedule: Schedule,
        config: RunConfig,
        save: Callable[[int], None],
        metrics: MetricsLog | None,
        record: Callable[[], dict] | None = None,
        after_step: Callable[[int], bool] | None = None,
        startup: Phases | None = None,
        logger: logging.Logger = log,
    ) -> int:
        """Train a run's steps from ``step`` until ``config.stop_step`` (the schedule's end, or a stop asked for).

        Every ``config.log_every`` steps and at the last one, the loss means, learning rate and
        images per second go to ``metrics`` (rank 0) after the finiteness check; checkpoints and
        stops follow :class:`StepBoundaries`. A stop before the schedule's end is logged (rank 0); a
        failure before any checkpoint removes the run directory this start created.

        Args:
            step_batches: the run's step-batches from ``step`` on (the loop takes no more than it trains).
            start: the run as started (rank, world size, checkpoints).
            step: the step the run starts from (resumed runs: the checkpoint's).
            schedule: the run's step counts.
            config: the ``run`` section (log and checkpoint intervals, progress bar, stop step).
            save: writes the checkpoint of a step (all processes call it together).
            metrics: the metrics log (None on ranks other than 0).
            record: more entries for each log record (called on every rank together).
            after_step: called after each step's log record with the step reached; returns True
                when it spent time (a validation) that the throughput should not count.
            startup: the start-up phases so far, to time the first batch and first step and log them
                (rank 0) on ``logger``, the program's.

        Returns:
            The step reached.

        Raises:
            LossNotFiniteError: a logged loss is not finite.
            RunInterrupted: after saving, when a process received SIGINT or SIGTERM.
        """
        stop_at = config.stop_step(step, schedule.total_steps)

        def save_and_restart(step: int) -> None:
            save(step)
            self.speed.restart()

        boundaries = StepBoundaries(
            save_and_restart,
            world_size=start.world_size,
            checkpoint_every=config.checkpoint_every,
            stop_at=stop_at,
            step=step,
        )
        bar = progress_bar(schedule.total_steps, step, start.rank == 0 and config.progress, config.output_dir.name)
        self.startup = startup
        with start.checkpoints.removed_on_failure(), boundaries:
            try:
                while step < stop_at:
                    self.step(step, next(step_batches))
                    step += 1
                    self._first_step_done(start.rank == 0, logger)
                    bar.update(1)
                    if step % config.log_every == 0 or step == stop_at:
                        entry = {
                            "step": step,
                            "epoch": round(step / schedule.steps_per_epoch, 4),
                            **self.interval.means(),
                            "lr": max(self.engine.get_lr()),
                            "images_per_s": round(self.speed.rate(), 2),
                            **(record() if record is not None else {}),
                        }
                        boundaries.check_finite(entry)
                        if metrics is not None:
                            metrics.write(entry)
                            bar.set_postfix(loss=f"{entry['loss']:.4f}", img_s=f"{entry['images_per_s']:.1f}")
                    if after_step is not None and after_step(step):
                        self.speed.restart()
                    if boundaries.reached(step):
                        break
            finally:
                bar.close()
        if step == stop_at < schedule.total_steps and start.rank == 0:
            logger.info(
                "stopped after step %d of %d (run.stop_after_steps); rerun without it to continue",
                step,
                schedule.total_steps,
            )
        return step

    def _first_step_done(self, report: bool, logger: logging.Logger) -> None:
        """Close the start-up timing at the first step of the invocation, logging it when ``report``."""
        if self.startup is None:
            return
        self.startup.lap("first_step")
        if report:
            seconds = self.startup.seconds
            logger.info("first optimizer step after %s", self.startup.describe(), extra={"startup": seconds})
        self.startup = None


class IntervalMeans:
    """Sums of named losses since the last log line, averaged over steps and ranks on demand.

    The sums stay on the losses' device: adding a step's losses never waits for the device, only
    :meth:`means` does.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = tuple(keys)
        self._reset()

    def _reset(self) -> None:
        self.sums: torch.Tensor | None = None
        self.count = 0

    def add(self, losses: Mapping[str, torch.Tensor]) -> None:
        step = torch.stack([losses[key].detach().float() for key in self.keys])
        self.sums = step if self.sums is None else self.sums + step
        self.count += 1

    def means(self) -> dict[str, float]:
        sums = self.sums if self.sums is not None else torch.zeros(len(self.keys))
        values = ds.mean_across_ranks(sums / max(self.count, 1))
        self._reset()
        return dict(zip(self.keys, values.tolist(), strict=False))
