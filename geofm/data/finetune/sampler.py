"""The order of a finetuning run's training samples, epoch by epoch, each with the seed of its augmentation.

:class:`EpochSampler` gives every position of an epoch a sample and a seed drawn from ``(seed,
epoch)`` alone; :class:`~geofm.data.finetune.dataset.FinetuneDataset` draws the sample's crop and
flips from that seed. A sample is thus a pure function of its position: the same whatever the
number of DataLoader workers and whether they persist from epoch to epoch, different from one
epoch to the next, and the same after a resume mid-epoch (:meth:`EpochSampler.set_start`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from geofm.data.epochs import EpochShareSampler

_SEEDS = 2**62


class SampleIndex(NamedTuple):
    """A sample of a dataset and the seed of its random augmentation."""

    index: int
    seed: int


class EpochSampler(EpochShareSampler[SampleIndex]):
    """Each epoch, every one of ``size`` samples ``repeats`` times, shuffled, shared among processes.

    The epoch's ``size x repeats`` positions, cut to a multiple of ``world_size`` (the rest dropped),
    are dealt in turn: process ``rank`` takes positions ``rank``, ``rank + world_size``... Call
    :meth:`set_epoch` before each epoch's iteration, as with torch's ``DistributedSampler``.
    """

    def __init__(self, size: int, repeats: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        """Initialise a new EpochSampler instance.

        Args:
            size: samples of the dataset.
            repeats: times each sample appears in an epoch (``data.crops_per_scene``).
            seed: the run's seed.
            rank: this process's rank.
            world_size: processes sharing each epoch.

        Raises:
            ValueError: if an epoch holds fewer positions than processes.
        """
        if size * repeats < world_size:
            raise ValueError(f"an epoch of {size} x {repeats} samples is shorter than world_size {world_size}")
        super().__init__(size * repeats, seed, rank, world_size)
        self.size, self.repeats = size, repeats

    def epoch_plan(self, epoch: int) -> tuple[list[int], list[int]]:
        """The sample and the seed of every position of an epoch, over all processes."""
        state = np.random.SeedSequence([self.seed, epoch]).generate_state(2, np.uint32)
        generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        positions = self.size * self.repeats
        order = torch.randperm(positions, generator=generator) % self.size
        seeds = torch.randint(0, _SEEDS, (positions,), generator=generator)
        return order.tolist(), seeds.tolist()

    def __iter__(self) -> Iterator[SampleIndex]:
        """This process's share of the current epoch, from the start position on."""
        order, seeds = self.epoch_plan(self.epoch)
        positions = self._share()
        return (SampleIndex(order[p], seeds[p]) for p in positions)
