from __future__ import annotations

import json
import logging

import pytest
import timm
import torch
from safetensors import safe_open

from geofm.checkpoints import export_backbone, load_backbone_weights, read_export_sidecar
from geofm.checkpoints.card import model_card
from geofm.errors import CheckpointFormatError, CheckpointNotFoundError, ConfigError
from geofm.models.backbones import backbone_kwargs, create_backbone

METADATA = {
    "bands": ["blue", "green", "red", "nir"],
    "normalisation": {"mean": [0.1, 0.2, 0.3, 0.4], "std": [0.5, 0.5, 0.5, 0.5]},
    "img_size": 64,
    "method": "gfm",
    "data": ["demo"],
}


def _timm_load(sidecar: dict, weights) -> torch.nn.Module:
    """Load an export the way a timm user would, with nothing but the sidecar and timm."""
    overlay = dict(file=str(weights), **sidecar["timm_pretrained_cfg_overlay"])
    return timm.create_model(sidecar["arch"], pretrained=True, pretrained_cfg_overlay=overlay, **sidecar["timm_kwargs"])


@pytest.mark.parametrize("family", ["swin", "swinv2", "vit"])
def test_export_loads_into_plain_timm_with_the_same_features(kit, tmp_path, caplog, family):
    if family == "swin":
        arch, kwargs = kit.SWIN, kit.swin_kwargs(in_chans=4)
    elif family == "swinv2":  # geofm's backbone with N bands, window and image size, rebuilt by the sidecar
        arch = "swinv2_tiny_window8_256"
        kwargs = backbone_kwargs(in_chans=4, img_size=kit.IMG, window_size=4, timm_kwargs=kit.SWIN_KWARGS)
    else:
        arch, kwargs = kit.VIT, kit.vit_kwargs(in_chans=4)
    torch.manual_seed(3)
    model = create_backbone(arch, kwargs).eval()

    weights = export_backbone(model, tmp_path / "export", arch=arch, create_kwargs=kwargs, metadata=METADATA)

    assert weights == tmp_path / "export" / "backbone.safetensors"
    sidecar = json.loads((tmp_path / "export" / "backbone.json").read_text())
    assert sidecar == read_export_sidecar(tmp_path / "export")
    assert sidecar["format"] == "geofm-backbone/1" and sidecar["arch"] == arch
    assert sidecar["timm_kwargs"] == json.loads(json.dumps(kwargs)) and sidecar["bands"] == METADATA["bands"]
    assert sidecar["timm_pretrained_cfg_overlay"] == {
        "num_classes": 0,
        "classifier": None,
        "first_conv": None,
        "input_size": [4, 64, 64],
    }
    with safe_open(str(weights), "pt") as f:
        assert set(f.keys()) == set(model.state_dict())
        assert not any(k.startswith("head") for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())  # noqa: SIM118

    with caplog.at_level(logging.INFO, logger="timm"):
        via_timm = _timm_load(sidecar, weights).eval()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not any("Missing keys" in r.getMessage() or "Converted input conv" in r.getMessage() for r in caplog.records)

    via_geofm = create_backbone(sidecar["arch"], sidecar["timm_kwargs"]).eval()
    report = load_backbone_weights(via_geofm, tmp_path / "export")
    assert report.layout == "geofm_export" and not report.adapted

    expected = kit.features(model, in_chans=4)
    assert torch.equal(kit.features(via_timm, in_chans=4), expected)
    assert torch.equal(kit.features(via_geofm, in_chans=4), expected)


def test_timm_load_of_an_export_is_strict(kit, tmp_path):
    kwargs = kit.swin_kwargs(in_chans=4)
    model = create_backbone(kit.SWIN, kwargs)
    weights = export_backbone(model, tmp_path, arch=kit.SWIN, create_kwargs=kwargs, metadata={})
    sidecar = read_export_sidecar(weights)
    sidecar["timm_kwargs"]["depths"] = [2, 2, 3, 1]  # a model with one more block than the file
    with pytest.raises(RuntimeError, match="Missing key"):
        _timm_load(sidecar, weights)


def test_export_refuses_what_would_not_load_back(kit, tmp_path):
    kwargs = kit.swin_kwargs()
    model = create_backbone(kit.SWIN, kwargs)
    with pytest.raises(ConfigError, match=r"reserved|written by geofm"):
        export_backbone(model, tmp_path, arch=kit.SWIN, create_kwargs=kwargs, metadata={"arch": "other"})
    with pytest.raises(ConfigError, match="does not rebuild"):
        export_backbone(model, tmp_path, arch=kit.SWIN, create_kwargs={**kwargs, "in_chans": 4}, metadata={})
    with pytest.raises(ConfigError, match="headless"):
        export_backbone(
            create_backbone(kit.SWIN, {**kwargs, "num_classes": 5}),
            tmp_path,
            arch=kit.SWIN,
            create_kwargs=kwargs,
            metadata={},
        )
    with pytest.raises(ConfigError, match="JSON"):
        export_backbone(model, tmp_path, arch=kit.SWIN, create_kwargs=kwargs, metadata={"when": object()})
    assert not list(tmp_path.iterdir())


def test_read_export_sidecar_errors(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"backbone.json"):
        read_export_sidecar(tmp_path)
    (tmp_path / "backbone.json").write_text('{"format": "other/2"}')
    with pytest.raises(CheckpointFormatError, match="other/2"):
        read_export_sidecar(tmp_path / "backbone.safetensors")
    (tmp_path / "backbone.json").write_text("{")
    with pytest.raises(CheckpointFormatError, match="JSON"):
        read_export_sidecar(tmp_path / "backbone.json")


def test_model_card_is_written_next_to_every_export(kit, tmp_path):
    kwargs = kit.swin_kwargs(in_chans=4)
    model = create_backbone(kit.SWIN, kwargs)
    metadata = {**METADATA, "gsd": [0.5, 10.0], "metrics": {"step": 12, "loss": 0.25}, "steps": 12}

    export_backbone(model, tmp_path, arch=kit.SWIN, create_kwargs=kwargs, metadata=metadata)

    card = (tmp_path / "MODEL_CARD.md").read_text()
    sidecar = read_export_sidecar(tmp_path)
    assert sidecar["num_params"] == sum(p.numel() for p in model.parameters())
    assert card.startswith(f"# {kit.SWIN} backbone (gfm)")
    for text in (
        "| timm architecture | `swin_tiny_patch4_window7_224` |",
        f"| parameters | {sidecar['num_params'] / 1e6:.2f} M ({sidecar['num_params']:,}) |",
        "| window size | 4 |",
        "Bands, in order: `blue`, `green`, `red`, `nir`.",
        "Ground sample distance: 0.5 to 10 m/px.",
        "Method: GFM continual pretraining",
        "| metric | value |",
        "| loss | 0.25 |",
        "| steps | 12 |",
        "pretrained_cfg_overlay=dict(",
        "torchgeo_weights(",
    ):
        assert text in card, text


def test_a_federated_export_card_counts_rounds_and_local_steps(kit):
    sidecar = {
        "format": "geofm-backbone/1",
        "arch": kit.SWIN,
        "timm_kwargs": kit.swin_kwargs(),
        "steps": 12,  # a federated run's export records the rounds it ran here
        "federation": {"algorithm": "fedavg", "rounds": 12},
        "config": {"train": {"local_steps": 3, "local_epochs": None, "micro_batch_size": 8}},
    }
    card = model_card(sidecar)
    assert "| rounds | 12 |\n| local_steps | 3 |\n| micro_batch_size | 8 |" in card
    assert "| steps |" not in card and "local_epochs" not in card


@pytest.mark.parametrize("spelling", ["today", "before_task_options"])
def test_a_gfm_export_card_lists_the_masking_and_teacher_of_its_config(kit, spelling):
    """An export's sidecar keeps its run's config: today with masking and teacher in ``task_options``,
    before as top-level sections; the card reads either."""
    settings = {
        "masking": {"mask_patch_size": 16, "mask_ratio": 0.6},
        "teacher": {"arch": kit.SWIN, "stage": 3, "alpha": 1.0, "checkpoint": "teacher.pth"},
    }
    config = {"train": {"micro_batch_size": 8}, "task": "mim"}
    config |= {"task_options": settings} if spelling == "today" else settings
    sidecar = {"format": "geofm-backbone/1", "arch": kit.SWIN, "timm_kwargs": kit.swin_kwargs(), "config": config}
    card = model_card(sidecar)
    assert "| mask_patch_size | 16 |\n| mask_ratio | 0.6 |\n| teacher stage | 3 |\n| alpha | 1 |" in card


def test_run_export_records_gsd_range_metrics_and_a_card(kit, tmp_path):
    from types import SimpleNamespace

    from geofm.config import PretrainConfig
    from geofm.tasks.mim.task import export_student

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    model = {"arch": kit.SWIN, "img_size": kit.IMG, "window_size": 4, "timm_kwargs": kit.SWIN_KWARGS}
    tree = kit.run_tree(run_dir, model, ["red", "green", "blue", "nir"])
    tree["data"]["sources"][0]["gsd"] = None  # a source without a known GSD is left out of the range
    tree["data"]["sources"].append({**tree["data"]["sources"][1], "name": "l8", "gsd": 30.0})
    final = {"step": 12, "loss": 1 / 12}

    export_student(
        PretrainConfig.from_tree(tree), SimpleNamespace(encoder=kit.make_swin(in_chans=4)), run_dir, 12, final
    )

    sidecar = read_export_sidecar(run_dir)
    assert sidecar["gsd"] == [10.0, 30.0] and sidecar["metrics"] == {"step": 12, "loss": 1 / 12}
    assert [d["gsd"] for d in sidecar["data"]] == [None, 10.0, 30.0]
    card = (run_dir / "MODEL_CARD.md").read_text()
    assert "Ground sample distance: 10 to 30 m/px." in card and "| l8 | `/archive/s2` | 1.0 | 30 |" in card
    assert "| s2 | nir | 0.0001 | 0.26 | 0.1 |" in card and "| mask_patch_size | 16 |" in card
