"""The program template (:class:`geofm.training.program.TrainingProgram`) with a toy program: its steps in order, a
stopped run resumed from its checkpoint with the program's own entries, and the finish once the schedule ends."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import Sampler

from geofm.config import RunConfig, TrainConfig
from geofm.config.base import Section
from geofm.tasks import StepOutput
from geofm.training import engine as ds
from geofm.training.program import TrainingProgram

pytestmark = pytest.mark.slow


class ToyData(Section):
    num_workers: int = 0


class ToyConfig(Section):
    train: TrainConfig
    run: RunConfig
    data: ToyData = ToyData()


class InOrder(Sampler):
    """The samples in order, every epoch; ``set_start`` skips those a resumed epoch has trained."""

    def __init__(self, size: int) -> None:
        self.size, self.start = size, 0

    def set_epoch(self, epoch: int) -> None:
        pass

    def set_start(self, start: int) -> None:
        self.start = start

    def __iter__(self):
        return iter(range(self.start, self.size))

    def __len__(self) -> int:
        return self.size - self.start


class Line(TrainingProgram):
    """Fits y = 2x with one weight; records the template's calls."""

    invariants = ("run.seed",)
    schedule_keys = ("train.epochs",)

    def __init__(self, cfg, calls: list[str]) -> None:
        super().__init__(cfg)
        self.calls = calls

    def inputs(self):
        self.calls.append("inputs")
        return []

    def build(self) -> None:
        self.calls.append("build")
        self.dataset = [{"x": torch.tensor([float(i)]), "y": torch.tensor([2.0 * i])} for i in range(8)]
        self.sampler = InOrder(len(self.dataset))
        self.schedule = ds.make_schedule(self.cfg.train, len(self.dataset), self.world)
        self.engine = ds.initialize(nn.Linear(1, 1, bias=False), self.cfg.train, self.world, self.schedule)
        self.saves = 0

    def forward(self):
        return lambda batch: StepOutput({"loss": ((self.engine(batch["x"]) - batch["y"]) ** 2).mean()})

    def resumed(self, progress, client_state) -> None:
        self.calls.append(f"resumed at {progress.step} after {client_state['saves']} saves")
        self.saves = client_state["saves"]

    def client_state(self) -> dict:
        self.saves += 1
        return {"saves": self.saves}

    def saved(self, step: int) -> None:
        self.calls.append(f"saved {step}")

    def finish(self) -> None:
        self.calls.append(f"finish at {self.step}")


def test_a_stopped_program_resumes_from_its_checkpoint_and_finishes_once(tmp_path, one_torch_thread):
    train = TrainConfig(epochs=2, micro_batch_size=4, warmup_epochs=0, base_lr=0.1, lr_reference_batch=4)
    run = {"output_dir": tmp_path / "line", "log_every": 1, "checkpoint_every": 100, "progress": False}
    calls: list[str] = []
    Line(ToyConfig(train=train, run=RunConfig(**run, stop_after_steps=3)), calls).run()
    assert calls == ["inputs", "build", "saved 3"], "stopped after 3 of 4 steps: saved, no finish"
    calls.clear()
    run_dir = Line(ToyConfig(train=train, run=RunConfig(**run)), calls).run()
    assert calls == ["inputs", "build", "resumed at 3 after 1 saves", "saved 4", "finish at 4"]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], "the log goes on from the checkpoint's step"
