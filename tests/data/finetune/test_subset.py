"""Train fractions: seeded, without replacement, stratified, never empty."""

from __future__ import annotations

import numpy as np
import pytest

from geofm.data.finetune import build_finetune_dataset, subset_indices


def test_uniform_draw_is_seeded_without_replacement_and_never_empty():
    first = subset_indices(1000, 0.1, seed=3)
    assert len(first) == 100 and len(set(first)) == 100, "100 distinct samples"
    assert first == subset_indices(1000, 0.1, seed=3), "same seed, same subset"
    assert first != subset_indices(1000, 0.1, seed=4), "another seed, another subset"
    assert len(subset_indices(50, 0.01, seed=0)) == 1, "at least one sample"
    assert subset_indices(7, 1.0, seed=0) == list(range(7))


def test_classification_draw_is_stratified_with_at_least_one_per_class():
    labels = [0] * 500 + [1] * 300 + [2] * 20 + [3] * 3
    chosen = subset_indices(len(labels), 0.1, seed=0, labels=labels)
    counts = np.bincount(np.asarray(labels)[chosen], minlength=4)
    assert counts.tolist() == [50, 30, 2, 1], f"10% of each class, at least one: got {counts.tolist()}"
    assert len(set(chosen)) == len(chosen)
    one_percent = np.bincount(np.asarray(labels)[subset_indices(len(labels), 0.01, 0, labels)], minlength=4)
    assert one_percent.tolist() == [5, 3, 1, 1]


def test_multilabel_draw_keeps_the_rarest_labels():
    rng = np.random.default_rng(0)
    labels = np.zeros((400, 4), dtype=np.float32)
    labels[:, 0] = 1
    labels[:200, 1] = 1
    labels[rng.choice(400, 4, replace=False), 3] = 1
    labels[390:, 0] = 0
    chosen = subset_indices(400, 0.01, seed=1, labels=labels)
    assert labels[chosen, 3].sum() >= 1, "the rarest label (4 samples) is kept"
    assert (labels[chosen].sum(axis=1) == 0).any(), "samples without any label form their own stratum"
    assert len(set(chosen)) == len(chosen)


def test_labels_of_another_length_are_refused():
    with pytest.raises(ValueError, match="3 labels for 4 samples"):
        subset_indices(4, 0.5, 0, labels=[0, 1, 1])


def test_train_fraction_applies_to_the_train_split_only(tmp_path, tif, data_cfg):
    for split in ("train", "val"):
        for c in range(3):
            for i in range(10):
                tif(tmp_path / split / f"c{c}" / f"{i}.tif", np.full((1, 4, 4), c, dtype=np.uint8))
    cfg = data_cfg(tmp_path, num_classes=3, train_fraction=0.1, subset_seed=5)
    train = build_finetune_dataset(cfg, "classification", "train", 4, train=True)
    assert sorted(int(train[i]["label"]) for i in range(len(train))) == [0, 1, 2], "one scene of each class"
    again = build_finetune_dataset(cfg, "classification", "train", 4, train=True)
    assert train.scenes == again.scenes, "the subset depends on data.subset_seed only"
    assert len(build_finetune_dataset(cfg, "classification", "val", 4, train=False)) == 30
