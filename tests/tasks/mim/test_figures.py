"""The reconstruction figure: panels from the loss's own decoder, the mosaic's colours, the PNG's rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from geofm.config import DataConfig, SourceConfig
from geofm.data.pile import PretrainPile
from geofm.data.writers import write_geotiff
from geofm.models.backbones import backbone_kwargs, create_backbone
from geofm.tasks.mim.figures import (
    MASK_BLEND,
    MASK_GREY,
    display_bands,
    figure_size,
    reconstruction_mosaic,
    reconstruction_panels,
    shown_chips,
    write_reconstruction_figure,
)
from geofm.tasks.mim.masking import MaskGenerator
from geofm.tasks.mim.model import MaskedImageModel

BANDS = ["red", "green", "blue", "nir"]
SIZE = 32
SCALE = 0.0001
TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}


def _source(root: Path, name: str, bands: list[str], seed: int, nodata: int | None = None) -> tuple[SourceConfig, dict]:
    """Two uint16 GeoTIFFs of ``bands`` (the first columns nodata when ``nodata`` is set) and their pixels by file name."""
    rng = np.random.default_rng(seed)
    raw = {}
    for i in range(2):
        data = rng.integers(200, 3000, (len(bands), SIZE, SIZE)).astype("uint16")
        if nodata is not None:
            data[:, :, :5] = nodata
        raw[f"{name}_{i}.tif"] = data
        write_geotiff(root / name / f"{name}_{i}.tif", data, transform=(10, 0, 0, 0, -10, 0), crs="EPSG:32632")
    cfg = SourceConfig(
        name=name,
        root=root / name,
        pattern="*.tif",
        bands=bands,
        scale=SCALE,
        nodata=nodata,
        mean=[0.1 + 0.01 * i for i in range(len(bands))],
        std=[0.05 + 0.01 * i for i in range(len(bands))],
    )
    return cfg, raw


@pytest.fixture(scope="module")
def shown(tmp_path_factory):
    """A tiny student, a pile of an RGB and a 4-band source (nodata at its left edge) whose samples
    are the files' pixels unchanged (whole-image crops, no flips), its shown chips and their pixels."""
    root = tmp_path_factory.mktemp("sources")
    rgb, rgb_raw = _source(root, "aerial", ["red", "green", "blue"], seed=1)
    ms, ms_raw = _source(root, "satellite", ["blue", "green", "red", "nir"], seed=2, nodata=0)
    data = DataConfig(bands=BANDS, sources=[rgb, ms], crop_scale=(1.0, 1.0), hflip=False, vflip=False, num_workers=0)
    pile = PretrainPile(data, SIZE, mask_fn=MaskGenerator(SIZE, 8, 4, 0.6))
    torch.manual_seed(0)
    kwargs = backbone_kwargs(in_chans=len(BANDS), img_size=SIZE, window_size=4, timm_kwargs=TINY_SWIN)
    model = MaskedImageModel(create_backbone("swin_tiny_patch4_window7_224", kwargs, drop_path_rate=0.1), len(BANDS))
    return model, pile, shown_chips(pile, seed=0), {**rgb_raw, **ms_raw}


def test_reconstruction_is_the_target_where_visible_and_the_losss_decoder_where_masked(shown):
    model, pile, batch, raw = shown
    assert [name.split(":")[0] for name in batch["names"]] == ["aerial", "satellite", "aerial", "satellite"]
    panels = reconstruction_panels(model, pile, batch)
    assert model.training, "the model is back in training mode"

    model.eval()
    with torch.no_grad():
        decoded, _ = model.reconstruct(batch["image"], batch["mask"])
    model.train()
    masked = model.pixel_mask(batch["mask"]).bool().expand_as(decoded)
    assert torch.equal(panels.masked, masked[:, 0]) and masked.any() and (~masked).any()
    for chip, source in enumerate(batch["source"].tolist()):
        assert torch.equal(panels.reconstruction[chip][~masked[chip]], panels.target[chip][~masked[chip]])
        expected = pile.sources[source].denormalise(decoded[chip])
        assert torch.equal(panels.reconstruction[chip][masked[chip]], expected[masked[chip]])
        assert not torch.equal(decoded[chip][masked[chip]], expected[masked[chip]]), "denormalised"

        # The target is the file's scaled values, in the model's band order, where there is data.
        file = batch["names"][chip].split(": ")[1]
        bands = pile.sources[source].cfg.bands
        for position, band in enumerate(BANDS):
            valid = panels.valid[chip, position]
            if band not in bands:
                assert not valid.any(), f"{file} has no {band}"
                continue
            pixels = torch.from_numpy(raw[file][bands.index(band)].astype("float32") * SCALE)
            torch.testing.assert_close(panels.target[chip, position][valid], pixels[valid])
            assert bool(valid.all()) == (source == 0), "the 4-band files' left edge is nodata"


def test_the_mosaic_greys_masked_patches_and_blacks_out_pixels_without_data(shown):
    model, pile, batch, _ = shown
    panels = reconstruction_panels(model, pile, batch)
    mosaic = reconstruction_mosaic(panels, BANDS)
    gap = 2
    assert mosaic.shape == (4 * (SIZE + gap) - gap, 3 * (SIZE + gap) - gap, 3)
    satellite = mosaic[SIZE + gap : 2 * SIZE + gap]  # the second row: nodata in its first 5 columns
    for column in range(3):
        panel = satellite[:, column * (SIZE + gap) : column * (SIZE + gap) + SIZE]
        assert (panel[:, :5] == 0).all(), f"column {column}: no data is black"
        assert (panel[:, 5:].max(axis=-1) > 0).any()
    target = mosaic[:SIZE, 2 * (SIZE + gap) :]
    masked_input = mosaic[:SIZE, :SIZE]
    where = panels.masked[0].numpy()
    np.testing.assert_allclose(
        masked_input[where], (1 - MASK_BLEND) * target[where] + MASK_BLEND * MASK_GREY, atol=1e-6
    )
    np.testing.assert_array_equal(masked_input[~where], target[~where])
    assert target.min() == 0 and target.max() == 1, "stretched between the 2nd and 98th percentiles"


def test_the_png_has_one_row_per_chip(shown, tmp_path):
    model, pile, batch, _ = shown
    path = write_reconstruction_figure(model, pile, batch, BANDS, tmp_path)
    with Image.open(path) as png:
        assert png.format == "PNG"
        dpi = round(png.info["dpi"][0])
        width, height = figure_size(4, SIZE, SIZE)
        assert png.size == (round(width * dpi), round(height * dpi))
    assert height > figure_size(3, SIZE, SIZE)[1] + 1.5, "each row adds a panel's height"


@pytest.mark.parametrize(
    ("bands", "drawn"),
    [(["blue", "green", "red", "nir"], [2, 1, 0]), (["nir", "swir16", "swir22", "vv"], [0, 1, 2]), (["vv"], [0])],
)
def test_natural_colour_else_the_first_three_bands_else_grey(bands, drawn):
    assert display_bands(bands) == drawn
