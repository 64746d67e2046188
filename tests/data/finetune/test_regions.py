"""Large scenes: chips read by window, and train/val/test as disjoint regions of one scene."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geofm.config.finetune_data import PADDING_LABEL, RegionSplitConfig
from geofm.data.finetune import build_finetune_dataset
from geofm.data.finetune.regions import split_regions
from geofm.errors import DatasetTooSmallError

SIDE = 256
TILE = 32
SPLIT = {"by": "regions", "fractions": [0.5, 0.25, 0.25], "block": 64}


@pytest.fixture
def scene(tmp_path, tif, positions):
    """Write one ``height`` x 256 segmentation scene under ``folder`` (default: the data root itself),
    whose first band holds each pixel's position (row x 256 + column) and whose mask holds it modulo 3."""

    def write(folder: str = "", height: int = SIDE) -> np.ndarray:
        image = positions(height, SIDE)
        tif(tmp_path / folder / "images" / "a.tif", image)
        tif(tmp_path / folder / "masks" / "a.tif", (image % 3).astype(np.uint8))
        return image

    return write


def _pixels(sample: dict) -> torch.Tensor:
    """Positions of the scene's pixels in a sample (padding left out), checking that each pixel's label is its own."""
    real = sample["mask"] != PADDING_LABEL
    position = sample["image"][0].round().long()
    assert torch.equal(sample["mask"][real], position[real] % 3), "labels come from the image's own window"
    return position[real]


@pytest.mark.slow
def test_a_region_split_deals_every_pixel_to_one_split_reproducibly(tmp_path, scene, data_cfg):
    scene(height=250)  # the last row of blocks is 58 px high
    cfg = data_cfg(tmp_path, num_classes=3, split=SPLIT)
    covered = {}
    for split, blocks in (("train", 8), ("val", 4), ("test", 4)):
        tiles = build_finetune_dataset(cfg, "segmentation", split, TILE, train=False)
        assert len(tiles.regions) == blocks, f"16 blocks dealt 8/4/4, {len(tiles.regions)} to {split}"
        covered[split] = set(torch.cat([_pixels(sample).flatten() for sample in tiles]).tolist())
        _, (row, col, height, width) = tiles.sample_window(len(tiles) - 1)
        last = _pixels(tiles[len(tiles) - 1])
        assert (int(last.min()), int(last.max())) == (row * SIDE + col, (row + height - 1) * SIDE + col + width - 1)
    assert not covered["train"] & covered["val"] and not covered["train"] & covered["test"]
    assert not covered["val"] & covered["test"], "no pixel is in two splits"
    assert set().union(*covered.values()) == set(range(250 * SIDE)), "every pixel is in a split"

    train = build_finetune_dataset(cfg, "segmentation", "train", TILE, train=True)
    torch.manual_seed(0)
    for index in range(len(train)):
        assert set(_pixels(train[index]).flatten().tolist()) <= covered["train"], "training crops stay in train"

    again = build_finetune_dataset(cfg, "segmentation", "val", TILE, train=False)
    other = data_cfg(tmp_path, num_classes=3, split={**SPLIT, "seed": 1})
    reseeded = build_finetune_dataset(other, "segmentation", "val", TILE, train=False)
    assert again.regions == build_finetune_dataset(cfg, "segmentation", "val", TILE, train=False).regions
    assert reseeded.regions != again.regions, "another seed deals the blocks otherwise"


def test_stripes_cut_each_scene_in_order():
    spec = RegionSplitConfig(by="rows", fractions=(0.5, 0.25, 0.25))
    stripes = [split_regions([(256, 200), (10, 7)], spec, split) for split in ("train", "val", "test")]
    assert [[tuple(r.window) for r in regions] for regions in stripes] == [
        [(0, 0, 128, 200), (0, 0, 5, 7)],
        [(128, 0, 64, 200), (5, 0, 3, 7)],
        [(192, 0, 64, 200), (8, 0, 2, 7)],
    ]
    columns = RegionSplitConfig(by="columns", fractions=(0.6, 0.0, 0.4))
    assert [tuple(r.window) for r in split_regions([(8, 10)], columns, "test")] == [(0, 6, 8, 4)]
    with pytest.raises(
        DatasetTooSmallError, match=r"by columns with fractions \[0.6, 0.0, 0.4\]: the val split gets no"
    ):
        split_regions([(8, 10)], columns, "val")


@pytest.mark.slow
def test_a_split_left_empty_is_an_error_that_says_what_to_change(tmp_path, scene, data_cfg):
    scene()
    cfg = data_cfg(tmp_path, num_classes=3, split={**SPLIT, "block": 256})
    with pytest.raises(DatasetTooSmallError, match=r"the val split gets none of the 1 blocks of 256 px.*smaller"):
        build_finetune_dataset(cfg, "segmentation", "val", TILE, train=False)


def test_chips_are_the_training_samples_and_crops_stay_inside_them(tmp_path, scene, data_cfg):
    scene("train")
    cfg = data_cfg(tmp_path, num_classes=3, chip_size=64)
    train = build_finetune_dataset(cfg, "segmentation", "train", TILE, train=True)
    assert len(train) == 16, "a 4 x 4 grid of 64 px chips"
    torch.manual_seed(0)
    for index, (_, chip) in enumerate(train.regions):
        pixels = _pixels(train[index])
        rows, cols = pixels // SIDE, pixels % SIDE
        assert pixels.numel() == TILE * TILE
        assert chip.row <= int(rows.min()) and int(rows.max()) < chip.row + chip.height, "the crop is in its chip"
        assert chip.col <= int(cols.min()) and int(cols.max()) < chip.col + chip.width
    tiles = build_finetune_dataset(cfg, "segmentation", "train", TILE, train=False)
    assert len(tiles) == 64 and sorted(torch.cat([_pixels(t).flatten() for t in tiles]).tolist()) == list(
        range(SIDE * SIDE)
    ), "evaluation tiles the chips, every pixel once"
