"""Product layouts registered as a plug-in would: checked, listed, read and configured without editing geofm."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from geofm.config import DataConfig, SourceConfig
from geofm.data.layouts import PRODUCT_LAYOUTS, ProductLayout, list_images
from geofm.data.products import list_products
from geofm.data.products.base import BandFile, Product, folders_of
from geofm.data.products.synthetic import write_band
from geofm.data.sources import ImageSource
from tests.data.test_products import _source


class _TileFoldersOptions(BaseModel):
    """The plug-in layout's own settings."""

    model_config = ConfigDict(extra="forbid")
    unit: float = Field(default=0.001, gt=0, description="the value of one stored count")


class _TileFolders(ProductLayout):
    """Folders of one ``<band>.tif`` per band, values in ``options.unit`` (a plug-in's layout)."""

    pattern = "**/red.tif"
    metadata = True
    Options = _TileFoldersOptions

    def list_products(self, cfg):
        return folders_of(list_images(cfg.root, cfg.pattern))

    def open_product(self, cfg, path, bands):
        return Product(
            path,
            {
                b: BandFile(path / f"{b}.tif", scale=self.options_of(cfg).unit)
                for b in bands
                if (path / f"{b}.tif").exists()
            },
        )


@pytest.fixture
def tile_folders():
    PRODUCT_LAYOUTS.register("tile_folders", _TileFolders())
    yield
    PRODUCT_LAYOUTS.unregister("tile_folders")


def test_a_registered_layout_is_checked_listed_and_read_without_editing_geofm(tmp_path, tile_folders):
    for tile, value in (("a", 100), ("b", 300)):
        for band in ("red", "nir"):
            write_band(tmp_path / tile / f"{band}.tif", np.full((8, 8), value, np.uint16), 10.0)
    cfg = _source(tmp_path, "tile_folders", ["red", "nir"])
    assert cfg.pattern == "**/red.tif", "the layout's own pattern"
    assert list_products(cfg) == [tmp_path / "a", tmp_path / "b"]
    source = ImageSource(cfg, ["nir", "red"])
    image, valid = source.load(1)
    assert image.shape == (2, 8, 8) and torch.allclose(image, torch.tensor(0.3)) and valid.all()
    assert source.chip_label(source.chips[0]) == "a"
    with pytest.raises(ValueError, match="scale and offset come from each product's metadata"):
        _source(tmp_path, "tile_folders", ["red"], scale=0.5)


def test_a_registered_layout_takes_its_options_from_the_config(tmp_path, tile_folders):
    write_band(tmp_path / "a" / "red.tif", np.full((8, 8), 100, np.uint16), 10.0)
    source = {"name": "tiles", "root": str(tmp_path), "layout": "tile_folders", "bands": ["red"], "mean": [0.0]}
    data = DataConfig.model_validate(
        {"bands": ["red"], "sources": [{**source, "std": [1.0], "options": {"unit": 0.01}}]}
    )
    image, _ = ImageSource(data.sources[0], ["red"]).load(0)
    assert torch.allclose(image, torch.tensor(1.0)), "100 counts of options.unit 0.01"
    with pytest.raises(
        ValueError, match=r"source 'tiles' \(layout tile_folders\) options\.unit: Input should be greater"
    ):
        SourceConfig.model_validate({**source, "std": [1.0], "options": {"unit": 0}})


def test_an_unknown_layout_names_the_nearest_registered_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown product layout 'sentinel2'; did you mean 'sentinel2_safe'") as err:
        _source(tmp_path, "sentinel2", ["red"])
    assert "registered: band_files, chips, file, landsat_c2" in str(err.value)
