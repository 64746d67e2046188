"""Training order and augmentation seeds: new each epoch, the same whatever the workers, exact on resume."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from geofm.data.finetune import build_finetune_dataset
from geofm.data.finetune.sampler import EpochSampler


def test_every_sample_comes_crops_times_an_epoch_in_a_new_order_shared_among_processes():
    sampler = EpochSampler(10, 2, seed=3)
    first = list(sampler)
    assert Counter(i.index for i in first) == dict.fromkeys(range(10), 2), "each sample twice an epoch"
    assert len({i.seed for i in first}) == 20, "each position its own seed"
    assert list(sampler) == first, "an epoch's plan depends on (seed, epoch) alone"
    sampler.set_epoch(1)
    second = list(sampler)
    assert [i.index for i in second] != [i.index for i in first], "the next epoch is shuffled anew"
    sampler.set_start(7)
    assert list(sampler) == second[7:], "a resume mid-epoch continues the epoch's plan"
    assert list(sampler) == second, "for that iteration only"

    ranks = [EpochSampler(10, 2, seed=3, rank=r, world_size=3) for r in range(3)]
    shares = [list(s) for s in ranks]
    assert [len(s) for s in shares] == [6, 6, 6], "20 positions cut to 18 for 3 processes"
    assert sorted(i.seed for s in shares for i in s) == sorted(i.seed for i in first[:18])
    with pytest.raises(ValueError, match=r"start position 7 is outside \[0, 6\]"):
        ranks[0].set_start(7)


def _epochs(dataset, workers: int, resume_at: int | None = None) -> list[torch.Tensor]:
    """The images of epochs 0 and 1 (from sample ``resume_at`` on in epoch 1) from one loader, batch 4."""
    sampler = EpochSampler(len(dataset), 2, seed=0)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers, persistent_workers=workers > 0)
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        if epoch == 1 and resume_at is not None:
            sampler.set_start(resume_at)
        epochs.append(torch.cat([batch["image"] for batch in loader]))
    return epochs


def test_persistent_workers_draw_new_crops_each_epoch_the_same_as_without_workers(tmp_path, tif, positions, data_cfg):
    for name in ("a", "b", "c", "d"):
        image = positions(48, 48)
        tif(tmp_path / "train" / "images" / f"{name}.tif", image)
        tif(tmp_path / "train" / "masks" / f"{name}.tif", (image % 3).astype(np.uint8))
    dataset = build_finetune_dataset(data_cfg(tmp_path, num_classes=3), "segmentation", "train", 32, train=True)
    first, second = _epochs(dataset, workers=2)
    assert first.shape == second.shape == (8, 1, 32, 32), "4 scenes, 2 crops each"
    assert not torch.equal(first, second), "the workers persist, the crops change with the epoch"
    assert len({tuple(image[0, 0, :2].tolist()) for image in first}) > 4, "each scene's two crops differ"
    alone = _epochs(dataset, workers=0)
    assert torch.equal(first, alone[0]) and torch.equal(second, alone[1]), "a sample depends on its position only"
    assert torch.equal(_epochs(dataset, workers=2, resume_at=4)[1], second[4:]), "a resume reads the same crops"
