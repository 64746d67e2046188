"""Fractions of a train split (1%, 10%...): seeded, without replacement, stratified where labels allow."""

from __future__ import annotations

import numpy as np

from geofm.errors import DatasetTooSmallError


def _strata(labels: list[int] | np.ndarray | None) -> np.ndarray | None:
    """A stratum per sample: its class, its rarest positive label (multi-label), or None (no labels)."""
    if labels is None:
        return None
    labels = np.asarray(labels)
    if labels.ndim == 1:
        return labels.astype(np.int64)
    positive = labels > 0
    frequency = positive.sum(axis=0)
    rarity = np.where(positive, frequency[None, :], np.iinfo(np.int64).max)
    rarest = rarity.argmin(axis=1)
    return np.where(positive.any(axis=1), rarest, labels.shape[1])


def subset_indices(count: int, fraction: float, seed: int, labels: list[int] | np.ndarray | None = None) -> list[int]:
    """Indices of a ``fraction`` of ``count`` samples, drawn without replacement.

    With labels, each stratum gives ``round(fraction * size)`` samples and at least one: the
    stratum of a classification sample is its class; of a multi-label sample, its rarest positive
    label (the one with fewest samples in the split; samples without a positive label form one
    more stratum), so rare labels are kept. Without labels the draw is uniform, at least one sample.

    Args:
        count: number of samples of the split.
        fraction: share to keep, in (0, 1].
        seed: the draw's seed; the same seed gives the same subset.
        labels: class ids (count,), a multi-hot array (count, classes), or None.

    Returns:
        Sorted indices.

    Raises:
        DatasetTooSmallError: if ``count`` is not positive.
        ValueError: if ``fraction`` is outside (0, 1] or ``labels`` has another length than ``count``.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if count <= 0:
        raise DatasetTooSmallError(f"no sample to draw a data.train_fraction {fraction} subset from")
    rng = np.random.default_rng(seed)
    strata = _strata(labels)
    if strata is None:
        return sorted(int(i) for i in rng.choice(count, max(1, int(fraction * count + 0.5)), replace=False))
    if len(strata) != count:
        raise ValueError(f"{len(strata)} labels for {count} samples")
    chosen: list[int] = []
    for stratum in np.unique(strata):
        members = np.flatnonzero(strata == stratum)
        keep = max(1, int(fraction * len(members) + 0.5))
        chosen.extend(int(i) for i in rng.choice(members, keep, replace=False))
    return sorted(chosen)
