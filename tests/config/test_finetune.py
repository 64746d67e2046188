"""The finetuning schema: shipped configs, the papers' settings, and combinations that are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from geofm.config.finetune import FinetuneConfig, metric_names
from geofm.errors import ConfigError

CONFIGS = sorted(Path(__file__).parents[2].joinpath("configs", "finetune").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = FinetuneConfig.from_file(path)
    assert cfg.run.output_dir.name == path.stem, "configs are named after the run they make"


def test_gfm_ucmerced_recipe():
    cfg = FinetuneConfig.from_file(
        Path(__file__).parents[2] / "configs/finetune/ucmerced__swin_base__img256_win8__100ep.yaml"
    )
    assert (cfg.model.img_size, cfg.model.window_size, cfg.model.drop_path_rate) == (256, 8, 0.1)
    assert (cfg.train.epochs, cfg.train.warmup_epochs, cfg.train.base_lr, cfg.train.lr_reference_batch) == (
        100,
        20,
        1e-4,
        512,
    )
    assert cfg.train.base_lr * cfg.train.warmup_start_ratio == pytest.approx(1e-7), "GFM's warmup lr"
    assert cfg.train.base_lr * cfg.train.min_lr_ratio == pytest.approx(1e-5), "GFM's min lr"
    opt = cfg.finetune
    assert (opt.layer_decay, opt.label_smoothing, opt.mixup, opt.cutmix) == (0.9, 0.1, 0.8, 1.0)
    assert cfg.primary_metric == "accuracy"


def test_bigearthnet_fractions():
    root = Path(__file__).parents[2] / "configs/finetune"
    fractions = {p.name: FinetuneConfig.from_file(p).data.train_fraction for p in root.glob("bigearthnet_*.yaml")}
    assert fractions == {
        "bigearthnet_1pct__swin_base__img128_win4__100ep.yaml": 0.01,
        "bigearthnet_10pct__swin_base__img128_win4__100ep.yaml": 0.1,
        "bigearthnet_v2_10pct__swin_base__img128_win4__100ep.yaml": 0.1,
    }


def test_defaults_are_the_finetuning_recipe(task_config):
    cfg = task_config("classification")
    assert (cfg.finetune.layer_decay, cfg.model.drop_path_rate, cfg.finetune.val_split) == (0.9, 0.1, "val")
    assert cfg.primary_metric == "accuracy" and not cfg.finetune.mixing


def test_metric_names_per_task():
    assert metric_names("segmentation", 2, ["background", "building"]) == [
        "miou",
        "accuracy",
        "iou/background",
        "iou/building",
    ]
    assert metric_names("segmentation", 2, None)[2:] == ["iou/class_0", "iou/class_1"]
    assert metric_names("segmentation", 3, None, ignore_index=0)[2:] == ["iou/class_1", "iou/class_2"], (
        "no IoU of the ignored class"
    )
    assert metric_names("change", 2, None) == ["f1", "precision", "recall", "iou"]


@pytest.mark.parametrize(
    ("task", "sections", "message"),
    [
        ("change", {"data": {"num_classes": 3}}, "task change has 2 classes"),
        ("segmentation", {"finetune": {"mixup": 0.8}}, "apply to classification, not segmentation"),
        (
            "classification",
            {"finetune": {"cutmix": 1.0}, "train": {"micro_batch_size": 3}},
            "micro_batch_size must be even",
        ),
        (
            "segmentation",
            {"finetune": {"best_metric": "iou/roof"}},
            r"not a segmentation metric; choose one of \['miou'",
        ),
        ("classification", {"finetune": {"layer_decay": 1.5}}, r"finetune\.layer_decay"),
        ("classification", {"finetune": {"eval_every": 0}}, r"finetune\.eval_every"),
        ("classification", {"layer_decay": 0.9}, r"layer_decay: unknown key"),
        ("superres", {"data": {"scale_factor": None}}, "task superres needs data.scale_factor"),
        (
            "segmentation",
            {"data": {"hr": {"dataset_bands": ["red"], "mean": [0.0], "std": [1.0]}}},
            r"data\.hr describes the high-resolution side of super-resolution pairs, not of segmentation data",
        ),
        ("change", {"train": {"micro_batch_size": 1}}, r"need train\.micro_batch_size >= 2"),
    ],
)
def test_impossible_combinations_are_refused(task, sections, message, task_tree):
    with pytest.raises(ConfigError, match=message):
        FinetuneConfig.from_tree(task_tree(task, **sections))


def test_per_class_best_metric_is_accepted(task_tree, tmp_path):
    tree = task_tree(
        "segmentation", data={"num_classes": 2, "class_names": ["background", "building"], "ignore_index": None}
    )
    tree["finetune"] = {"best_metric": "iou/building"}
    path = tmp_path / "whu.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert FinetuneConfig.from_file(path).primary_metric == "iou/building"
