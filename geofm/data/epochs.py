"""What the pretraining pile's and the finetuning sets' samplers share: epochs dealt among processes.

An epoch has a number of positions, cut to a multiple of ``world_size``; process ``rank`` takes
positions ``rank, rank + world_size, ...``. :meth:`EpochShareSampler.set_epoch` selects the epoch
(as with torch's ``DistributedSampler``) and :meth:`EpochShareSampler.set_start` resumes mid-epoch.
"""

from __future__ import annotations

from typing import TypeVar

from torch.utils.data import Sampler

T = TypeVar("T")


class EpochShareSampler(Sampler[T]):
    """This process's share of each epoch's positions; subclasses say what each position holds."""

    def __init__(self, positions: int, seed: int, rank: int, world_size: int) -> None:
        """Initialise the share of ``positions`` per epoch for process ``rank`` of ``world_size``, from ``seed``."""
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self._start = 0
        self._total = positions // world_size * world_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows."""
        self.epoch = epoch

    def set_start(self, position: int) -> None:
        """Skip the first ``position`` samples of this process's share in the next iteration only.

        Used to resume mid-epoch with the same data order; later iterations start at 0 again.

        Raises:
            ValueError: if ``position`` is outside ``[0, len(self)]``.
        """
        if not 0 <= position <= len(self):
            raise ValueError(f"start position {position} is outside [0, {len(self)}]")
        self._start = position

    def __len__(self) -> int:
        """Samples of this process's share of an epoch."""
        return self._total // self.world_size

    def _share(self) -> range:
        """This process's positions of the epoch from the start position on; the start goes back to 0."""
        start, self._start = self._start, 0
        return range(self.rank + start * self.world_size, self._total, self.world_size)
