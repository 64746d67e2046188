"""Tasks and heads as registered objects: config names checked against the registries, and a task
defined here (ordinal regression of the class id on a one-output head) finetuned end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torchmetrics import MeanAbsoluteError

from finetune.best import load_finetuned
from finetune.run import finetune
from finetune.splits import build_split
from geofm.config.finetune import FinetuneConfig
from geofm.data.finetune import TaskData
from geofm.data.finetune.classification import ClassFolders
from geofm.errors import ConfigError
from geofm.models.heads import HEADS
from geofm.tasks import TASKS, StepOutput
from geofm.tasks.finetuning import FinetuneTask, task_of
from geofm.tasks.finetuning.model import Classifier, build_finetune_model


class ScalarHead(Classifier):
    """timm's linear classifier with one output: a scalar per image."""

    output = "scalar"

    @classmethod
    def from_config(cls, backbone: nn.Module, cfg: FinetuneConfig) -> ScalarHead:
        return cls(backbone, 1, cfg.model.frozen)


class SquaredError(nn.Module):
    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        return ((output[:, 0] - target) ** 2).mean()


class Ordinal(FinetuneTask):
    """The class id of a class-folder image as a number: squared error, mean absolute error (lower is better)."""

    name = "ordinal"
    target = "label"
    output = "scalar"
    default_head = "scalar"
    primary_metric = "mae"
    lower_is_better = frozenset({"mae"})
    float_target = True

    @classmethod
    def data(cls) -> TaskData:
        return TaskData(cls.name, ClassFolders, cls.target)

    def build_criterion(self) -> nn.Module:
        return SquaredError()

    def metrics(self) -> dict:
        return {"mae": MeanAbsoluteError()}

    def update_metrics(self, metrics, outputs: Tensor, target: Tensor) -> None:
        metrics.collection.update(outputs[:, 0], target.float())


class Pretraining:
    """A registered task that does not finetune (no ``finetunes``)."""


@pytest.fixture
def plugins(monkeypatch):
    """The ordinal task and scalar head registered as a plug-in would, removed after the test."""
    monkeypatch.setitem(TASKS._entries, "ordinal", Ordinal)
    monkeypatch.setitem(TASKS._entries, "masked_pretraining", Pretraining)
    monkeypatch.setitem(HEADS._entries, "scalar", ScalarHead)


def _ordinal_tree(finetune_tree, class_folders, tmp_path, **sections):
    tree = finetune_tree("classification", tmp_path / "ordinal", data={"root": str(class_folders)}, **sections)
    return {**tree, "task": "ordinal"}


@pytest.mark.slow
def test_a_task_defined_outside_geofm_finetunes_end_to_end(plugins, finetune_tree, class_folders, tmp_path):
    cfg = FinetuneConfig.from_tree(_ordinal_tree(finetune_tree, class_folders, tmp_path))
    assert cfg.head_name == "scalar" and cfg.primary_metric == "mae"
    run_dir = finetune(cfg)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val"]["mae"] for r in records if "val" in r]
    best = json.loads((run_dir / "best" / "best.json").read_text())
    assert len(vals) == 2 and best["value"] == min(vals), "lower is better: the smallest error is kept"

    # the test score, recomputed by hand from the kept weights' predictions
    model, cfg, _ = load_finetuned(run_dir)
    model.eval()
    test = build_split(cfg, "test", train=False)
    errors = []
    with torch.no_grad():
        for i in range(len(test)):
            sample = test[i]
            errors.append(abs(float(model(sample["image"][None])[0, 0]) - float(sample["label"])))
    record = json.loads((run_dir / "eval.json").read_text())
    assert record["task"] == "ordinal" and record["primary_metric"] == "mae"
    assert record["score"] == pytest.approx(np.mean(errors), abs=1e-5)


def test_the_ordinal_forward_returns_its_loss_and_outputs(plugins, finetune_tree, class_folders, tmp_path):
    task = task_of(FinetuneConfig.from_tree(_ordinal_tree(finetune_tree, class_folders, tmp_path)))
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
    batch = {"image": torch.tensor([[1.0, 1.0], [0.0, 1.0]]), "label": torch.tensor([2, 0])}
    step = task.forward(model, batch, torch.device("cpu"), torch.float32)
    assert isinstance(step, StepOutput)
    # outputs 3 and 2 against 2 and 0: ((3 - 2)^2 + (2 - 0)^2) / 2
    assert step.losses["loss"].item() == pytest.approx(2.5)
    assert step.outputs[:, 0].tolist() == [3.0, 2.0]


def test_lower_and_higher_is_better():
    assert Ordinal.improves(Ordinal, "mae", 0.5, 0.7) and not Ordinal.improves(Ordinal, "mae", 0.7, 0.5)
    assert Ordinal.improves(Ordinal, "accuracy", 0.7, 0.5) and not Ordinal.improves(Ordinal, "accuracy", 0.5, 0.7)


def test_a_task_typo_names_the_nearest_tasks(task_tree):
    with pytest.raises(ConfigError, match=r"unknown task 'segmentaton'; did you mean 'segmentation'"):
        FinetuneConfig.from_tree({**task_tree("segmentation"), "task": "segmentaton"})


def test_a_pretraining_task_is_refused(plugins, task_tree):
    with pytest.raises(ConfigError, match="'masked_pretraining' is a pretraining task"):
        FinetuneConfig.from_tree({**task_tree("classification"), "task": "masked_pretraining"})


def test_a_head_typo_names_the_nearest_heads(task_tree):
    with pytest.raises(ConfigError, match=r"head\.name: unknown head 'upernt'; did you mean 'upernet'"):
        FinetuneConfig.from_tree(task_tree("segmentation", head={"name": "upernt"}))


def test_a_head_of_another_output_is_refused(task_tree):
    with pytest.raises(ConfigError, match=r"head\.name 'linear' takes \['image'\] and returns logits outputs"):
        FinetuneConfig.from_tree(task_tree("segmentation", head={"name": "linear"}))


def test_a_plug_in_head_serves_a_built_in_task_of_its_kind(monkeypatch, task_config):
    class WideLinear(Classifier):
        pass

    monkeypatch.setitem(HEADS._entries, "wide_linear", WideLinear)
    model, _ = build_finetune_model(task_config("multilabel", head={"name": "wide_linear"}))
    assert type(model) is WideLinear


@pytest.mark.parametrize(
    ("task", "head"),
    [
        ("classification", "linear"),
        ("multilabel", "linear"),
        ("segmentation", "upernet"),
        ("change", "siamese_upernet"),
        ("superres", "pixel_shuffle"),
    ],
)
def test_each_built_in_task_has_its_head(task, head, task_config):
    assert task_config(task).head_name == head
