"""Training augmentation keeps images, masks, both dates and super-resolution pairs aligned."""

from __future__ import annotations

import numpy as np
import torch

from geofm.data.finetune import build_finetune_dataset

DRAWS = 24


def _decode(position: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each pixel's original place, from the position pattern of its first band."""
    position = position.round().long()
    return position // width, position % width


def _check_geometry(rows: list[torch.Tensor], cols: list[torch.Tensor]) -> None:
    """The crops move about and flips happen in both directions over the draws."""
    assert len({(int(r[0, 0]), int(c[0, 0])) for r, c in zip(rows, cols, strict=False)}) > 3, (
        "crops should land at different places"
    )
    assert any(bool((c[:, 1] < c[:, 0]).all()) for c in cols), "some draws should flip left-right"
    assert any(bool((r[1] < r[0]).all()) for r in rows), "some draws should flip top-bottom"


def test_segmentation_crop_and_flips_keep_the_mask_aligned(tmp_path, tif, data_cfg, positions):
    image = positions(48, 56, bands=2)
    mask = ((image[0] // 56) // 4 + (image[0] % 56) // 6) % 5
    tif(tmp_path / "train" / "images" / "a.tif", image)
    tif(tmp_path / "train" / "masks" / "a.tif", mask[None].astype(np.uint16))
    cfg = data_cfg(tmp_path, dataset_bands=["red", "nir"], num_classes=5)
    ds = build_finetune_dataset(cfg, "segmentation", "train", 32, train=True)
    torch.manual_seed(0)
    rows, cols = [], []
    for _ in range(DRAWS):
        sample = ds[0]
        assert sample["image"].shape == (2, 32, 32) and sample["mask"].shape == (32, 32)
        r, c = _decode(sample["image"][0], 56)
        expected = (r // 4 + c // 6) % 5
        assert torch.equal(sample["mask"], expected), "the mask must follow the image's crop and flips"
        assert (sample["image"][1] == 1000).all(), "every band is cropped alike"
        rows.append(r)
        cols.append(c)
    _check_geometry(rows, cols)


def test_change_crop_and_flips_keep_both_dates_and_the_mask_aligned(tmp_path, tif, data_cfg, positions):
    before = positions(40, 40)
    change = (((before[0] // 40) // 5 + (before[0] % 40) // 3) % 2 * 255).astype(np.uint8)
    tif(tmp_path / "train" / "A" / "a.tif", before)
    tif(tmp_path / "train" / "B" / "a.tif", before + 7)
    tif(tmp_path / "train" / "label" / "a.tif", change[None])
    ds = build_finetune_dataset(data_cfg(tmp_path, num_classes=2), "change", "train", 24, train=True)
    torch.manual_seed(1)
    rows, cols = [], []
    for _ in range(DRAWS):
        sample = ds[0]
        r, c = _decode(sample["image1"][0], 40)
        assert torch.equal(sample["image2"][0], sample["image1"][0] + 7), "after follows before"
        assert torch.equal(sample["mask"], (r // 5 + c // 3) % 2), "the change mask follows the images"
        rows.append(r)
        cols.append(c)
    _check_geometry(rows, cols)


def test_superres_crops_are_aligned_at_the_scale_factor(tmp_path, tif, data_cfg, positions):
    low = positions(30, 26)
    high = low.repeat(3, axis=1).repeat(3, axis=2)
    tif(tmp_path / "train" / "lr" / "a.tif", low, transform=(3.0, 0, 0.0, 0, -3.0, 0.0))
    tif(tmp_path / "train" / "hr" / "a.tif", high, transform=(1.0, 0, 0.0, 0, -1.0, 0.0))
    ds = build_finetune_dataset(data_cfg(tmp_path, scale_factor=3), "superres", "train", 16, train=True)
    torch.manual_seed(2)
    rows, cols = [], []
    for _ in range(DRAWS):
        sample = ds[0]
        assert sample["image"].shape == (1, 16, 16) and sample["target"].shape == (1, 48, 48)
        expected = sample["image"].repeat_interleave(3, dim=-2).repeat_interleave(3, dim=-1)
        assert torch.equal(sample["target"], expected), (
            "each low-resolution pixel sits on its 3 x 3 high-resolution block"
        )
        r, c = _decode(sample["image"][0], 26)
        rows.append(r)
        cols.append(c)
    _check_geometry(rows, cols)


def test_classification_crops_vary_and_evaluation_is_deterministic(tmp_path, tif, data_cfg, positions):
    tif(tmp_path / "train" / "a" / "x.tif", positions(64, 64))
    cfg = data_cfg(tmp_path, num_classes=1, crop_scale=(0.3, 0.6))
    train = build_finetune_dataset(cfg, "classification", "train", 32, train=True)
    torch.manual_seed(3)
    crops = {train[0]["image"][0, 0, 0].item() for _ in range(DRAWS)}
    assert len(crops) > 3, "random resized crops should differ"
    evaluation = build_finetune_dataset(cfg, "classification", "train", 32, train=False)
    first, second = evaluation[0]["image"], evaluation[0]["image"]
    assert torch.equal(first, second)
    assert first.shape == (1, 32, 32) and first[0, 0, 0] < 64 and first[0, -1, -1] > 63 * 64, "the whole scene, resized"
