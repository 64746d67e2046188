"""Scenes smaller than img_size: padding never counts as a label, in training crops and evaluation tiles alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from geofm.config.finetune_data import PADDING_LABEL
from geofm.data.finetune import build_finetune_dataset
from geofm.errors import DataMismatchError

SIZE = 32
TRUTH = np.array([[0, 1, 2, 0], [1, 1, 0, 2]], dtype=np.uint8)
"""A 2 x 4 scene: 8 real pixels, three of them class 0."""


def _scored_labels(mask: torch.Tensor, ignore_index: int | None) -> list[int]:
    unscored = PADDING_LABEL if ignore_index is None else ignore_index
    return sorted(mask[mask != unscored].tolist())


def _segmentation(tmp_path, tif, data_cfg, **fields):
    tif(tmp_path / "train" / "images" / "a.tif", np.full((1, *TRUTH.shape), 500, np.uint16))
    tif(tmp_path / "train" / "masks" / "a.tif", TRUTH[None])
    return data_cfg(tmp_path, num_classes=3, **fields)


@pytest.mark.parametrize("ignore_index", [None, 0], ids=["no ignore_index", "ignore_index 0 (LoveDA)"])
@pytest.mark.parametrize("train", [True, False])
def test_segmentation_padding_is_never_scored(tmp_path, tif, data_cfg, ignore_index, train):
    cfg = _segmentation(tmp_path, tif, data_cfg, ignore_index=ignore_index)
    dataset = build_finetune_dataset(cfg, "segmentation", "train", SIZE, train=train)
    torch.manual_seed(0)
    real = sorted(int(v) for v in TRUTH.ravel() if v != ignore_index)
    for _ in range(4 if train else 1):
        sample = dataset[0]
        assert sample["image"].shape == (1, SIZE, SIZE) and sample["mask"].shape == (SIZE, SIZE)
        assert _scored_labels(sample["mask"], ignore_index) == real, (
            "exactly the scene's own labelled pixels are scored"
        )
    if not train:
        assert torch.equal(sample["mask"][:2, :4], torch.from_numpy(TRUTH).long()), "the tile starts at the scene"
        assert (sample["image"][:, 2:] == 0).all() and (sample["image"][:, :, 4:] == 0).all(), "images padded with 0"


@pytest.mark.parametrize("train", [True, False])
def test_change_padding_is_never_scored(tmp_path, tif, data_cfg, train):
    change = (TRUTH == 1).astype(np.uint8) * 255
    for part, value in (("A", 100), ("B", 200)):
        tif(tmp_path / "train" / part / "a.tif", np.full((1, *TRUTH.shape), value, np.uint16))
    tif(tmp_path / "train" / "label" / "a.tif", change[None])
    dataset = build_finetune_dataset(data_cfg(tmp_path, num_classes=2), "change", "train", SIZE, train=train)
    torch.manual_seed(1)
    sample = dataset[0]
    assert _scored_labels(sample["mask"], None) == [0, 0, 0, 0, 0, 1, 1, 1]
    assert int((sample["mask"] == PADDING_LABEL).sum()) == SIZE * SIZE - 8


@pytest.mark.parametrize("train", [True, False])
def test_superres_target_padding_is_never_scored(tmp_path, tif, data_cfg, positions, train):
    low = positions(4, 6)
    high = low.repeat(2, axis=1).repeat(2, axis=2)
    tif(tmp_path / "train" / "lr" / "a.tif", low, transform=(2.0, 0, 0.0, 0, -2.0, 0.0))
    tif(tmp_path / "train" / "hr" / "a.tif", high, transform=(1.0, 0, 0.0, 0, -1.0, 0.0))
    dataset = build_finetune_dataset(data_cfg(tmp_path, scale_factor=2), "superres", "train", 16, train=train)
    torch.manual_seed(2)
    sample = dataset[0]
    assert sample["image"].shape == (1, 16, 16) and sample["target"].shape == (1, 32, 32)
    known = sample["target"].isfinite()
    assert int(known.sum()) == 8 * 12, "the 8 x 12 high-resolution pixels of the scene, and no padding"
    assert sorted(sample["target"][known].tolist()) == sorted(high.ravel().astype(float).tolist())
    if not train:
        assert bool(known[0, :8, :12].all()), "evaluation tiles are padded at the bottom and right"


def test_a_torchgeo_split_without_a_labelled_pixel_names_the_class(tmp_path, data_cfg, torchgeo_layouts):
    fields = torchgeo_layouts.loveda(tmp_path, per_split={"train": 2}, size=8)
    for mask in (tmp_path / "Train" / "Urban" / "masks_png").iterdir():
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(mask)
    cfg = data_cfg(tmp_path, **fields)
    with pytest.raises(
        DataMismatchError, match=r"torchgeo LoveDA at .*, split train \('train'\): none of its 2 scenes"
    ):
        build_finetune_dataset(cfg, "segmentation", "train", SIZE, train=True)
