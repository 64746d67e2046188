"""The training loop every program runs: the micro-step with an algorithm's hooks, per-step seeding,
step-batches over epochs, the local steps of a federated client, and a run's log records and checkpoints."""

import contextlib
import itertools
import logging
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from geofm.config import RunConfig
from geofm.errors import LossNotFiniteError
from geofm.tasks import StepOutput
from geofm.training.engine_config import Schedule
from geofm.training.loop import TrainLoop, epoch_steps, micro_step
from geofm.training.rundir import RunCheckpoints, RunStart


class Engine:
    """Stands in for the DeepSpeed engine: records what the step does with it."""

    def __init__(self, events: list | None = None) -> None:
        self.events = events if events is not None else []
        self.backward_losses: list[float] = []

    def backward(self, loss: torch.Tensor) -> None:
        self.events.append("backward")
        self.backward_losses.append(float(loss))

    def step(self) -> None:
        self.events.append("step")

    def get_lr(self) -> list[float]:
        return [0.1, 0.3]


def value_forward(batch) -> StepOutput:
    """A micro-batch is a number; its loss is that number."""
    return StepOutput({"loss": torch.tensor(float(batch))}, outputs=2 * batch)


def recording_context(events: list) -> Callable[[], contextlib.AbstractContextManager]:
    """An ``around_gradient`` hook that records ``enter`` and ``exit`` in ``events``."""

    @contextlib.contextmanager
    def around_gradient():
        events.append("enter")
        yield
        events.append("exit")

    return around_gradient


def test_the_micro_step_regularises_inside_the_hook_and_steps_after_it():
    events = []
    engine = Engine(events)

    around_gradient = recording_context(events)

    def forward(batch):
        events.append("forward")
        return value_forward(batch)

    def regulariser(batch, output):
        events.append(("regulariser", batch, output.outputs))
        return torch.tensor(0.25)

    output = micro_step(engine, forward, 3, around_gradient, regulariser)
    assert events == ["enter", "forward", ("regulariser", 3, 6), "backward", "exit", "step"]
    assert engine.backward_losses == [3.25], "the regulariser's term is added to the loss"
    assert float(output.losses["loss"]) == 3.0, "the logged loss is the forward's own"


def test_the_ascent_gets_the_task_loss_inside_the_hook_and_the_regulariser_only_in_the_real_pass():
    events = []
    engine = Engine(events)

    around_gradient = recording_context(events)

    @contextlib.contextmanager
    def ascent(closure):
        events.append(("ascent", float(closure())))
        yield
        events.append("restore")

    def forward(batch):
        events.append("forward")
        return value_forward(batch)

    def regulariser(batch, output):
        events.append("regulariser")
        return torch.tensor(0.25)

    micro_step(engine, forward, 3, around_gradient, regulariser, ascent)
    assert events == [
        "enter",
        "forward",
        ("ascent", 3.0),
        "forward",
        "regulariser",
        "backward",
        "restore",
        "exit",
        "step",
    ]
    assert engine.backward_losses == [3.25]


def test_each_step_reseeds_after_taking_its_step_batch_and_before_reading_it():
    draws = []

    def step_batches():
        while True:
            torch.rand(1)  # made while taking the step-batch: overwritten by the step's seed
            yield (draws.append((float(torch.rand(1)), float(np.random.rand()))) or i for i in range(2))

    loop = TrainLoop(Engine(), value_forward, seed_of=lambda step: 100 + step, seed_numpy=True)
    batches = step_batches()
    for index in range(2):
        loop.step(index, next(batches))
    expected = []
    for seed in (100, 101):
        torch.manual_seed(seed)
        np.random.seed(seed)
        expected += [(float(torch.rand(1)), float(np.random.rand())) for _ in range(2)]
    assert draws == expected


def test_step_batches_start_mid_epoch_and_read_lazily():
    calls, read = [], []

    def epoch_batches(epoch: int, done: int):
        calls.append((epoch, done))
        return (read.append(i) or i for i in range(10 * epoch + 2 * done, 10 * epoch + 6))  # 3 steps of 2

    steps = epoch_steps(4, 3, 2, epoch_batches)
    first = next(steps)
    assert calls == [(1, 1)], "step 4 is the second step of epoch 1"
    assert read == [], "a step-batch reads its micro-batches only when the step trains them"
    assert list(first) == [12, 13]
    assert [list(next(steps)) for _ in range(2)] == [[14, 15], [20, 21]]
    assert calls == [(1, 1), (2, 0)]


def test_local_steps_train_until_the_iterator_ends_and_return_the_loss_means():
    engine = Engine()
    loop = TrainLoop(engine, value_forward, seed_of=lambda step: step)
    means, steps = loop.local_steps(iter([[1, 2], [3, 4], [5, 6]]))
    assert steps == 3
    assert means == {"loss": 3.5}, "(1 + 2 + ... + 6) / 6 micro-batches"
    assert engine.events.count("step") == 6
    assert loop.local_steps(iter([])) == ({"loss": 0.0}, 0)


class Metrics:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)


def run_loop(tmp_path, *, step: int = 0, forward=value_forward, **run):
    """Five steps of 3 per epoch, two micro-batches each (step k reads 2k+1 and 2k+2), logging every
    2nd step, checkpointing every 3rd."""
    saved, after, metrics = [], [], Metrics()
    loop = TrainLoop(Engine(), forward, seed_of=lambda step: step, images=4)

    def epoch_batches(epoch: int, done: int):
        return itertools.count(6 * epoch + 2 * done + 1)

    reached = loop.run(
        epoch_steps(step, 3, 2, epoch_batches),
        RunStart(0, 1, torch.device("cpu"), RunCheckpoints(tmp_path, keep=2, rank=0), None),
        step=step,
        schedule=Schedule(steps_per_epoch=3, total_steps=5, warmup_steps=1),
        config=RunConfig(output_dir=tmp_path, log_every=2, checkpoint_every=3, progress=False, **run),
        save=saved.append,
        metrics=metrics,
        record=lambda: {"extra": 1},
        after_step=lambda step: after.append(step) or False,
    )
    return reached, saved, after, metrics.records


def test_a_run_logs_interval_means_checkpoints_and_calls_back_each_step(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="geofm"):
        reached, saved, after, records = run_loop(tmp_path, stop_after_steps=5)
    assert not any("stopped after" in message for message in caplog.messages), "a run that ends is not stopped"
    assert reached == 5
    assert saved == [3, 5]
    assert after == [1, 2, 3, 4, 5]
    logged = [{k: v for k, v in r.items() if k != "images_per_s"} for r in records]
    assert logged == [
        {"step": 2, "epoch": 0.6667, "loss": 2.5, "lr": 0.3, "extra": 1},  # mean of 1..4
        {"step": 4, "epoch": 1.3333, "loss": 6.5, "lr": 0.3, "extra": 1},  # mean of 5..8
        {"step": 5, "epoch": 1.6667, "loss": 9.5, "lr": 0.3, "extra": 1},  # mean of 9, 10
    ]
    assert all(r["images_per_s"] >= 0 for r in records)


def test_a_resumed_run_continues_from_its_step_and_stops_where_asked(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="geofm"):
        reached, saved, after, records = run_loop(tmp_path, step=1, stop_after_steps=2)
    assert "stopped after step 3 of 5 (run.stop_after_steps); rerun without it to continue" in caplog.messages
    assert reached == 3
    assert saved == [3], "the stop step is checkpointed"
    assert after == [2, 3]
    assert [(r["step"], r["loss"]) for r in records] == [(2, 3.5), (3, 5.5)]  # steps 2 and 3 read 3, 4 and 5, 6


def test_a_non_finite_loss_stops_the_run_at_its_log_record(tmp_path):
    def forward(batch):
        return value_forward(math.nan if batch == 7 else batch)

    with pytest.raises(LossNotFiniteError, match="step 4: loss is not finite"):
        run_loop(tmp_path, forward=forward)
