"""geofm exports inside TerraTorch: found by name through its custom modules, built by its
EncoderDecoderFactory, finetuned by its own CLI and Lightning tasks on a torchgeo dataset.

TerraTorch pins its own torchgeo and dependencies, so these tests run in their own environment
(``make test-terratorch``); where TerraTorch is not installed (the project's venv) they are skipped.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("terratorch")

from terratorch.models import EncoderDecoderFactory
from terratorch.registry import BACKBONE_REGISTRY

import geofm_terratorch  # registers geofm_export, as TerraTorch's custom_modules_path does
from geofm.checkpoints import load_backbone_for_bands
from geofm.errors import ConfigError
from geofm.models.backbones import backbone_kwargs, create_backbone
from geofm.tasks.finetuning.model import DenseFeatures
from tests.conftest import SWIN_ARCH, TINY_SWIN

DATA_BANDS = ["BLUE", "GREEN", "RED", "NIR"]  # TerraTorch's HLSBands names, in the data's order


def segmentation_model(export: Path, bands=DATA_BANDS, **backbone):
    return EncoderDecoderFactory().build_model(
        task="segmentation",
        backbone="geofm_export",
        backbone_path=str(export),
        backbone_bands=bands,
        decoder="UperNetDecoder",
        decoder_channels=16,
        num_classes=3,
        **{f"backbone_{key}": value for key, value in backbone.items()},
    )


def test_importing_the_custom_modules_package_registers_the_source():
    assert "geofm_export" in BACKBONE_REGISTRY
    assert Path(__file__).parents[2] / "geofm_terratorch" == geofm_terratorch.PATH


def test_features_inside_terratorch_are_geofm_finetuning_features(make_export):
    export = make_export()
    model = segmentation_model(export).eval()
    images = torch.randn(2, 4, 64, 64, generator=torch.Generator().manual_seed(5))

    kwargs = backbone_kwargs(in_chans=4, img_size=64, window_size=4, timm_kwargs=TINY_SWIN)
    own = create_backbone(SWIN_ARCH, kwargs)
    load_backbone_for_bands(own, export, ["blue", "green", "red", "nir"])
    with torch.no_grad():
        features = model.encoder(images)
        expected = DenseFeatures(own, frozen=True, feature_blocks=None).eval().features(images)
        output = model(images).output

    assert len(features) == 4
    for got, want in zip(features, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert output.shape == (2, 3, 64, 64) and torch.isfinite(output).all()


def test_bands_the_export_lacks_fail_the_model_build_with_the_export_bands_named(make_export):
    with pytest.raises(
        ConfigError, match=r"backbone_bands: \['swir16'\] are not among .*\['red', 'green', 'blue', 'nir'\]"
    ):
        segmentation_model(make_export(), bands=["RED", "GREEN", "swir16"])


@pytest.mark.slow
def test_terratorch_fit_finetunes_the_export_on_a_torchgeo_dataset(make_export, torchgeo_layouts, tmp_path):
    """``terratorch fit --config``: UCMerced (its on-disk layout, 2 classes) through torchgeo's own
    datamodule, which scales to [0, 1] and resizes to 256 px; the backbone normalises with the
    export's RGB statistics (input_scale 1: the inputs are reflectances already)."""
    root = tmp_path / "ucmerced"
    fields = torchgeo_layouts.ucmerced(root)
    export = make_export()
    config = tmp_path / "ucmerced.yaml"
    config.write_text(yaml.safe_dump(ucmerced_config(export, root, tmp_path / "logs", fields["num_classes"])))

    done = subprocess.run(
        [str(Path(sys.executable).with_name("terratorch")), "fit", "--config", str(config)],
        cwd=tmp_path,
        capture_output=True,
        check=False,
        text=True,
    )

    assert done.returncode == 0, done.stderr[-4000:]
    rows = list(csv.DictReader((tmp_path / "logs" / "ucmerced" / "version_0" / "metrics.csv").open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    val_losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    accuracy = [float(r["val/Accuracy"]) for r in rows if r.get("val/Accuracy")]
    assert losses and all(math.isfinite(v) for v in losses + val_losses) and len(val_losses) == 2
    assert accuracy and all(0.0 <= v <= 1.0 for v in accuracy)


def ucmerced_config(export: Path, root: Path, logs: Path, num_classes: int) -> dict:
    """A TerraTorch config in the form of its examples: trainer, data, model (task and factory), optimizer."""
    return {
        "seed_everything": 0,
        "custom_modules_path": str(geofm_terratorch.PATH),
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 2,
            "log_every_n_steps": 1,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(logs), "name": "ucmerced"},
            },
        },
        "data": {
            "class_path": "terratorch.datamodules.TorchNonGeoDataModule",
            "init_args": {"cls": "torchgeo.datamodules.UCMercedDataModule", "batch_size": 2, "num_workers": 0},
            "dict_kwargs": {"root": str(root)},
        },
        "model": {
            "class_path": "terratorch.tasks.ClassificationTask",
            "init_args": {
                "model_factory": "EncoderDecoderFactory",
                "model_args": {
                    "backbone": "geofm_export",
                    "backbone_path": str(export),
                    "backbone_bands": ["RED", "GREEN", "BLUE"],
                    "backbone_img_size": 256,
                    "backbone_normalise": True,
                    "backbone_input_scale": 1.0,
                    "decoder": "IdentityDecoder",
                    "num_classes": num_classes,
                },
                "loss": "ce",
                "freeze_backbone": False,
            },
        },
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1.0e-3, "weight_decay": 0.05}},
    }
