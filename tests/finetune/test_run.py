"""The finetuning program end to end: run directory, best weights, eval.json, resume, checkpoints and bands."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.run import finetune
from geofm.config.finetune import FinetuneConfig, metric_names
from geofm.errors import ConfigError
from geofm.tasks.finetuning.model import build_finetune_model


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_classification_run_writes_its_outputs_and_evaluates_the_best_weights(classification_run, class_folders):
    run_dir = classification_run
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "loss_curve.png",
        "val_curve.png",
        "best/model.safetensors",
        "eval.json",
    ):
        assert (run_dir / name).is_file(), f"{name} is missing from the run directory"
    records = _records(run_dir)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13)), "a train loss per logged step"
    validations = [r for r in records if "val" in r]
    assert [r["step"] for r in validations] == [6, 12], "a validation at the end of each epoch"
    evaluation = json.loads((run_dir / "eval.json").read_text())
    best = max(validations, key=lambda r: r["val"]["accuracy"])
    assert evaluation["selected"]["step"] == min(
        r["step"] for r in validations if r["val"]["accuracy"] == best["val"]["accuracy"]
    )
    assert evaluation["task"] == "classification" and evaluation["split"] == "test"
    assert set(evaluation["metrics"]) == {"accuracy"} and evaluation["score"] == evaluation["metrics"]["accuracy"]
    assert evaluation["dataset"] == class_folders.name, "a folder dataset is named after its root"
    assert (evaluation["steps"], evaluation["epochs"], evaluation["train_fraction"]) == (12, 2, 1.0)
    assert evaluation["checkpoint"] is None and evaluation["seconds"] > 0


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_same_result(class_folders, task_tree, classification_run):
    tree = task_tree("classification", "resumed", data={"root": str(class_folders)}, run={"stop_after_steps": 5})
    run_dir = finetune(FinetuneConfig.from_tree(tree))
    assert (run_dir / "checkpoints/last").exists() and not (run_dir / "eval.json").exists()
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3, 4, 5]

    changed = task_tree("classification", "resumed", data={"root": str(class_folders)}, finetune={"layer_decay": 0.75})
    with pytest.raises(ConfigError, match=r"another finetune"):
        finetune(FinetuneConfig.from_tree(changed))

    finetune(FinetuneConfig.from_tree(task_tree("classification", "resumed", data={"root": str(class_folders)})))
    resumed, straight = _records(run_dir), _records(classification_run)
    assert [r["step"] for r in resumed] == [r["step"] for r in straight]
    for a, b in zip(resumed, straight, strict=False):
        if "loss" in a:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), f"step {a['step']}: the resumed run diverged"
            assert a["lr"] == pytest.approx(b["lr"])
    assert json.loads((run_dir / "eval.json").read_text())["metrics"] == pytest.approx(
        json.loads((classification_run / "eval.json").read_text())["metrics"]
    )


@pytest.mark.slow
def test_linear_probe_from_an_rgb_export_keeps_its_weights_and_reports_the_fresh_band(
    class_folders, task_tree, rgb_export, caplog
):
    tree = task_tree(
        "classification", "probe", checkpoint=str(rgb_export), data={"root": str(class_folders)}, model={"frozen": True}
    )
    with caplog.at_level(logging.WARNING, logger="geofm.finetune"):
        run_dir = finetune(FinetuneConfig.from_tree(tree))
    assert "bands ['nir'] are not in the checkpoint" in caplog.text
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["checkpoint"]["fresh_bands"] == ["nir"] and evaluation["frozen"] is True
    assert evaluation["checkpoint"]["layout"] == "geofm_export"

    exported = load_file(str(rgb_export / "backbone.safetensors"))
    kept = load_file(str(run_dir / "best/model.safetensors"))
    key = "layers.2.blocks.1.mlp.fc1.weight"
    assert torch.equal(kept[f"backbone.{key}"], exported[key]), "the frozen backbone holds the export's weights"
    kernels = kept["backbone.patch_embed.proj.weight"]
    assert torch.equal(kernels[:, :3], exported["patch_embed.proj.weight"]), "red, green, blue kernels from the export"
    assert not torch.equal(kept["backbone.head.fc.weight"], torch.zeros_like(kept["backbone.head.fc.weight"]))


def test_finetuning_starts_from_the_exports_weights(task_config, rgb_export):
    cfg = task_config("segmentation", checkpoint=str(rgb_export))
    model, report = build_finetune_model(cfg)
    exported = load_file(str(rgb_export / "backbone.safetensors"))
    key = "layers.0.blocks.0.attn.qkv.weight"
    assert torch.equal(model.backbone.state_dict()[key], exported[key]), "the backbone holds the export's weights"
    assert report.fresh_bands == ["nir"] and "fresh bands (not in the checkpoint, newly initialised): nir" in str(
        report
    )


def test_a_checkpoint_without_any_task_band_is_an_error(task_config, rgb_export):
    nir = {"bands": ["nir"], "dataset_bands": ["nir"], "mean": [0.2], "std": [0.1]}
    cfg = task_config("classification", checkpoint=str(rgb_export), data=nir)
    with pytest.raises(
        ConfigError, match=r"none of the bands \['nir'\] is among the checkpoint's bands \['red', 'green', 'blue'\]"
    ):
        build_finetune_model(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task", "family"),
    [
        ("multilabel", "swin"),
        ("segmentation", "swin"),
        ("segmentation", "vit"),
        ("change", "swin"),
        ("superres", "swin"),
    ],
)
def test_every_task_family_trains_and_writes_its_metrics(task, family, task_config, random_datasets):
    cfg = task_config(task, f"{task}_{family}", family)
    run_dir = finetune(cfg)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    expected = metric_names(task, cfg.data.num_classes, cfg.data.class_names, cfg.data.ignore_index)
    assert list(evaluation["metrics"]) == expected, f"{task}: metrics {list(evaluation['metrics'])}"
    assert evaluation["primary_metric"] == expected[0]
    losses = [r["loss"] for r in _records(run_dir) if "loss" in r]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses), "4 finite training steps"


@pytest.mark.slow
def test_a_resume_undoes_a_selection_made_after_its_checkpoint(class_folders, task_tree, classification_run):
    root = {"root": str(class_folders)}
    run_dir = finetune(
        FinetuneConfig.from_tree(task_tree("classification", "undo", data=root, run={"stop_after_steps": 8}))
    )
    kept = json.loads((run_dir / "best/best.json").read_text())
    assert kept["step"] == 6 and (run_dir / "checkpoints/last/best/model.safetensors").is_file()
    # a selection after the step-8 checkpoint, as if the run had gone on and been killed (written as save_best does)
    later = run_dir / "best/later.json"
    later.write_text(json.dumps({**kept, "step": 10, "value": 2.0}))
    os.replace(later, run_dir / "best/best.json")

    finetune(FinetuneConfig.from_tree(task_tree("classification", "undo", data=root)))
    selected = json.loads((run_dir / "eval.json").read_text())["selected"]
    straight = json.loads((classification_run / "eval.json").read_text())["selected"]
    assert selected["step"] == straight["step"], "the selection of the step-8 checkpoint competed with step 12 again"
    assert selected["value"] == pytest.approx(straight["value"])


@pytest.mark.slow
def test_a_config_without_model_takes_the_architecture_from_the_exports_backbone_json(
    class_folders, task_tree, rgb_export, caplog
):
    tree = task_tree("classification", "from_export", checkpoint=str(rgb_export), data={"root": str(class_folders)})
    stated = tree.pop("model")
    with caplog.at_level(logging.INFO, logger="geofm.config"):
        cfg = FinetuneConfig.from_tree(tree)
    assert cfg.model.model_dump(include={"arch", "img_size", "window_size", "timm_kwargs"}) == stated
    taken = [r.getMessage() for r in caplog.records if r.name == "geofm.config"]
    assert taken == [
        f"model: arch {stated['arch']}, img_size 32, window_size 4, timm_kwargs {stated['timm_kwargs']} "
        f"taken from {rgb_export / 'backbone.json'}"
    ]
    run_dir = finetune(cfg)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["checkpoint"]["layout"] == "geofm_export" and evaluation["checkpoint"]["fresh_bands"] == ["nir"]


def test_a_partial_model_keeps_its_values_and_takes_the_rest_from_backbone_json(task_tree, rgb_export, caplog):
    tree = task_tree("segmentation", checkpoint=str(rgb_export))
    stated = tree["model"]
    tree["model"] = {"img_size": 64, "frozen": True}
    with caplog.at_level(logging.INFO, logger="geofm.config"):
        cfg = FinetuneConfig.from_tree(tree)
    assert (cfg.model.img_size, cfg.model.frozen) == (64, True), "the config's own values win"
    assert (cfg.model.arch, cfg.model.window_size, cfg.model.timm_kwargs) == (
        stated["arch"],
        stated["window_size"],
        stated["timm_kwargs"],
    )
    assert "img_size" not in caplog.text and "taken from" in caplog.text


def test_a_config_without_model_needs_a_checkpoint_with_backbone_json(task_tree, rgb_export):
    (rgb_export / "backbone.json").unlink()
    tree = task_tree("classification", checkpoint=str(rgb_export))
    del tree["model"]
    with pytest.raises(ConfigError, match=r"has no backbone.json to take the backbone's architecture from"):
        FinetuneConfig.from_tree(tree)
