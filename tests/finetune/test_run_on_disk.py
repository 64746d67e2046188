"""The finetuning program on data in real on-disk formats, one run per task family and format.

The demo archive's folders read by the shipped demo configs, and torchgeo dataset classes reading
tiny datasets written in their releases' layouts (see ``torchgeo_layouts`` in tests/conftest.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.run import finetune
from geofm.checkpoints import export_backbone
from geofm.config.finetune import FinetuneConfig, metric_names
from geofm.data.demo import make_demo_archive
from geofm.models.backbones import backbone_kwargs, create_backbone
from tests.conftest import head_overrides

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

CONFIGS = Path(__file__).parents[2] / "configs" / "finetune"
FAMILIES = ("classification", "multilabel", "segmentation", "change", "superres")
RGBN = ["red", "green", "blue", "nir"]
# One epoch of 2-8 steps and one validation, with the configs' own model: seconds per run on two CPU cores.
DEMO_OVERRIDES = [
    "train.epochs=1",
    "train.warmup_epochs=0.5",
    "train.micro_batch_size=4",
    "data.num_workers=0",
    "run.log_every=1",
    "run.progress=false",
]

TORCHGEO_RUNS = {
    "classification": ("ucmerced", {"per_split": {"train": 4, "val": 1, "test": 1}}, None),
    "multilabel": ("bigearthnet", {"per_split": {"train": 8, "val": 2, "test": 2}}, RGBN),
    "segmentation": ("loveda", {"per_split": {"train": 4, "val": 2, "test": 1}, "size": 64}, None),
    "change": ("levircd", {"per_split": {"train": 4, "val": 1, "test": 1}, "size": 64}, None),
    "superres": ("spacenet2", {"per_split": {"train": [1, 2, 3, 4], "test": [5]}}, RGBN),
}
"""Per family: the layout writer, its sizes (train splits of 4-8 samples) and the model bands (None: all)."""
TORCHGEO_TRAIN = {"epochs": 1, "warmup_epochs": 0.5, "micro_batch_size": 2}
"""One epoch of 2-4 steps and one validation (of the tiny 32 px Swin of ``finetune_tree``)."""


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(run_dir: Path, cfg: FinetuneConfig) -> dict:
    """Check a finished run's outputs; return its eval.json."""
    expected = metric_names(cfg.task, cfg.data.num_classes, cfg.data.class_names, cfg.data.ignore_index)
    assert (run_dir / "eval.json").is_file(), f"{cfg.task}: no eval.json in {run_dir}"
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert list(evaluation["metrics"]) == expected, (
        f"{cfg.task}: eval.json has {list(evaluation['metrics'])}, not {expected}"
    )
    assert all(isinstance(v, float) for v in evaluation["metrics"].values()), f"{cfg.task}: {evaluation['metrics']}"
    assert (
        evaluation["task"] == cfg.task and evaluation["dataset"] == cfg.dataset_name and evaluation["split"] == "test"
    )
    records = _records(run_dir)
    losses = [r for r in records if "loss" in r]
    assert losses and all(math.isfinite(r["loss"]) for r in losses), f"{cfg.task}: train loss records {losses}"
    assert [r["step"] for r in losses] == list(range(1, evaluation["steps"] + 1)), f"{cfg.task}: a loss per step"
    validations = [r for r in records if "val" in r]
    assert len(validations) == cfg.train.epochs, (
        f"{cfg.task}: {len(validations)} validations in {cfg.train.epochs} epochs"
    )
    assert all(list(r["val"]) == expected for r in validations), f"{cfg.task}: validation records {validations}"
    assert (run_dir / "best/model.safetensors").is_file() and (run_dir / "best/best.json").is_file(), (
        f"{cfg.task}: the best weights are missing"
    )
    selected = json.loads((run_dir / "best/best.json").read_text())
    assert selected["step"] in [r["step"] for r in validations], f"{cfg.task}: kept weights of step {selected['step']}"
    return evaluation


@pytest.fixture(scope="module")
def demo_archive(tmp_path_factory) -> dict[str, Path]:
    return make_demo_archive(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def micro_export(tmp_path_factory) -> Path:
    """A pretraining export of a random Swin with the demo configs' model, on red, green, blue and nir."""
    model = FinetuneConfig.from_file(CONFIGS / "demo_classification__swin_micro.yaml").model
    kwargs = backbone_kwargs(
        in_chans=len(RGBN), img_size=model.img_size, window_size=model.window_size, timm_kwargs=model.timm_kwargs
    )
    torch.manual_seed(3)
    out = tmp_path_factory.mktemp("export")
    metadata = {"bands": RGBN, "method": "gfm", "steps": 0}
    export_backbone(create_backbone(model.arch, kwargs), out, arch=model.arch, create_kwargs=kwargs, metadata=metadata)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_demo_config_finetunes_a_pretraining_export_on_the_demo_archive(family, demo_archive, micro_export, tmp_path):
    weights = micro_export / "backbone.safetensors"
    overrides = [f"data.root={demo_archive[family]}", f"run.output_dir={tmp_path / family}", f"checkpoint={weights}"]
    cfg = FinetuneConfig.from_file(
        CONFIGS / f"demo_{family}__swin_micro.yaml", [*overrides, *DEMO_OVERRIDES, *head_overrides(family)]
    )
    evaluation = _check_run(finetune(cfg), cfg)
    provenance = evaluation["checkpoint"]
    assert provenance is not None and provenance["path"] == str(weights), f"{family}: checkpoint {provenance}"
    assert provenance["layout"] == "geofm_export" and provenance["fresh_bands"] == [], f"{family}: {provenance}"
    assert provenance["tensors_loaded"] == len(load_file(str(weights))), f"{family}: not every exported tensor loaded"
    dropped = (
        [] if cfg.data.bands == RGBN else ["patch_embed.proj.weight: 4 -> 3 bands, from checkpoint bands [0, 1, 2]"]
    )
    assert provenance["adapted"] == dropped, f"{family}: {provenance['adapted']}"


@pytest.mark.parametrize("family", FAMILIES)
def test_torchgeo_class_finetunes_on_its_on_disk_layout(family, torchgeo_layouts, finetune_tree, tmp_path):
    writer, sizes, bands = TORCHGEO_RUNS[family]
    fields = getattr(torchgeo_layouts, writer)(tmp_path / "data", **sizes)
    n = len(fields["dataset_bands"])
    data = {**fields, "root": str(tmp_path / "data"), "bands": bands or fields["dataset_bands"]}
    data.update(mean=[0.3] * n, std=[0.2] * n)
    cfg = FinetuneConfig.from_tree(finetune_tree(family, tmp_path / "run", data=data, train=TORCHGEO_TRAIN))
    _check_run(finetune(cfg), cfg)
