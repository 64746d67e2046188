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
from torch.utils.data import Sampler

_SEEDS = 2**62


class SampleIndex(NamedTuple):
    """A sample of a dataset and the seed of its random augmentation."""

    index: int
    seed: int


class EpochSampler(Sampler[SampleIndex]):
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
        self.size, self.repeats, self.seed = size, repeats, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._start = 0
        self._total = size * repeats // world_size * world_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows."""
        self.epoch = epoch

    def set_start(self, position: int) -> None:
        """Skip the first ``position`` samples of this process's share in the next iteration only (a resume).

        Raises:
            ValueError: if ``position`` is outside ``[0, len(self)]``.
        """
        if not 0 <= position <= len(self):
            raise ValueError(f"start position {position} is outside [0, {len(self)}]")
        self._start = position

    def __len__(self) -> int:
        """Samples of this process's share of an epoch."""
        return self._total // self.world_size

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
        start, self._start = self._start, 0
        order, seeds = self.epoch_plan(self.epoch)
        positions = range(self.rank + start * self.world_size, self._total, self.world_size)
        return (SampleIndex(order[p], seeds[p]) for p in positions)
