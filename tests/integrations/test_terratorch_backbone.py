"""The geofm backbone TerraTorch builds (geofm.integrations.terratorch), tested without TerraTorch:
its features are geofm's own finetuning model's, its bands follow names, it normalises as pretraining did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geofm.checkpoints import load_backbone_for_bands
from geofm.errors import CheckpointNotFoundError, ConfigError
from geofm.integrations.terratorch import geofm_backbone
from geofm.models.backbones import backbone_kwargs, create_backbone
from geofm.tasks.finetuning.model import DenseFeatures
from tests.conftest import SWIN_ARCH, TINY_SWIN
from tests.integrations.conftest import NORMALISATION

REPO = Path(__file__).parents[2]


def geofm_features(export: Path, bands: list[str], images: torch.Tensor) -> list[torch.Tensor]:
    """The feature maps of geofm's own finetuning model (its dense heads' input) from the export."""
    kwargs = backbone_kwargs(in_chans=len(bands), img_size=images.shape[-1], window_size=4, timm_kwargs=TINY_SWIN)
    backbone = create_backbone(SWIN_ARCH, kwargs)
    load_backbone_for_bands(backbone, export, bands)
    with torch.no_grad():
        return DenseFeatures(backbone, frozen=True, feature_blocks=None).eval().features(images)


@pytest.mark.parametrize("size", [64, 96])
def test_features_are_geofm_finetuning_features_with_bands_in_the_data_order(make_export, size):
    export = make_export()
    bands = ["blue", "green", "red", "nir"]  # the data's order, not the export's
    images = torch.randn(2, 4, size, size, generator=torch.Generator().manual_seed(3))

    backbone = geofm_backbone(export, bands, img_size=size if size != 64 else None).eval()
    with torch.no_grad():
        features = backbone(images)

    expected = geofm_features(export, bands, images)
    assert backbone.out_channels == [16, 32, 64, 128] == [f.shape[1] for f in features]
    assert [f.shape[-1] for f in features] == [size // 4, size // 8, size // 16, size // 32]
    for got, want in zip(features, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the kernels follow the names: the same scene in the export's order gives the same features
    in_export_order = geofm_backbone(export, img_size=size if size != 64 else None).eval()
    with torch.no_grad():
        reordered = in_export_order(images[:, [2, 1, 0, 3]])
    torch.testing.assert_close(reordered[-1], features[-1], rtol=0, atol=1e-5)


def test_bands_the_export_lacks_are_a_one_line_error(make_export):
    export = make_export()
    with pytest.raises(
        ConfigError, match=r"backbone_bands: \['swir16'\] are not among the bands .* \['red', 'green', 'blue', 'nir'\]"
    ):
        geofm_backbone(export, ["red", "green", "b11"])
    with pytest.raises(
        ConfigError, match=r"unknown band 'NIR_NARROW'.*export's bands \['red', 'green', 'blue', 'nir'\]"
    ):
        geofm_backbone(export, ["RED", "NIR_NARROW"])
    with pytest.raises(ConfigError, match=r"names \['red'\] twice"):
        geofm_backbone(export, ["red", "B04"])


def test_inputs_of_another_size_or_band_count_are_refused_naming_the_setting(make_export):
    backbone = geofm_backbone(make_export(), ["red", "green", "blue"])
    with pytest.raises(
        ValueError, match=r"takes 3 bands .* at 64x64 px, got input of shape \(1, 3, 96, 96\).*backbone_img_size"
    ):
        backbone(torch.zeros(1, 3, 96, 96))
    with pytest.raises(ValueError, match=r"backbone_bands"):
        backbone(torch.zeros(1, 4, 64, 64))


def test_normalise_applies_the_pretraining_statistics_of_the_first_source_with_the_bands(make_export):
    export = make_export()
    raw = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 255
    rgb = ["red", "green", "blue"]

    plain = geofm_backbone(export, rgb).eval()
    own = geofm_backbone(export, rgb, normalise=True).eval()  # aerial: scale 1/255
    scaled = geofm_backbone(export, rgb, normalise=True, input_scale=1.0).eval()

    aerial = NORMALISATION["aerial"]
    mean, std = torch.tensor(aerial["mean"]).view(1, 3, 1, 1), torch.tensor(aerial["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        want = plain((raw / 255 - mean) / std)
        torch.testing.assert_close(own(raw), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(scaled(raw / 255), want, rtol=0, atol=1e-5)
    assert own.statistics.source == "aerial" and own.input_scale == pytest.approx(1 / 255)

    nir = geofm_backbone(export, ["nir", "red"], normalise=True, source="s2")
    s2 = NORMALISATION["s2"]
    assert nir.statistics.mean == (s2["mean"][3], s2["mean"][2]) and nir.input_scale == 1e-4
    with pytest.raises(ConfigError, match=r"no source's statistics cover all the model's bands \['nir'\]"):
        geofm_backbone(export, ["nir"], normalise=True, source="aerial")


def test_vit_gives_four_blocks_and_out_indices_pick_stages(make_export):
    vit = geofm_backbone(make_export("vit", img_size=32)).eval()
    with torch.no_grad():
        maps = vit(torch.randn(1, 4, 32, 32))
    assert vit.out_indices == [0, 1, 2, 3] and vit.out_channels == [32] * 4
    assert [tuple(m.shape) for m in maps] == [(1, 32, 2, 2)] * 4

    swin = geofm_backbone(make_export(name="swin"), out_indices=[1, -1])
    assert swin.out_indices == [1, 3] and swin.out_channels == [32, 128]
    with pytest.raises(
        ConfigError, match=r"backbone_out_indices: \[4\] out of range for swin_tiny_patch4_window7_224's 4 stages"
    ):
        geofm_backbone(make_export(name="swin2"), out_indices=[4])


def test_unpretrained_backbone_has_the_architecture_and_fresh_weights(make_export):
    export = make_export()
    fresh = geofm_backbone(export, pretrained=False)
    loaded = geofm_backbone(export)
    assert fresh.out_channels == loaded.out_channels
    assert not torch.equal(fresh.model.patch_embed.proj.weight, loaded.model.patch_embed.proj.weight)


def test_missing_export_and_foreign_patch_size_are_named(make_export, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"backbone_path: .*nowhere does not exist"):
        geofm_backbone(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"backbone_patch_size: 16 differs from the export's patch size \(4, 4\)"):
        geofm_backbone(make_export(), patch_size=16)


@pytest.mark.slow
def test_the_module_imports_none_of_the_training_stack():
    """TerraTorch's environment lacks DeepSpeed and Flower; torchgeo and rasterio are not needed either."""
    probe = (
        "import json, sys, geofm.integrations.terratorch; "
        "print(json.dumps(sorted(m for m in ('deepspeed', 'flwr', 'rasterio', 'torchgeo', 'terratorch', 'pretrain', "
        "'finetune', 'federation') if m in sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == []
