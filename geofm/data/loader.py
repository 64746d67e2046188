"""The training loader of a run, and torch's threads beside its workers on a CPU."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def threads_beside_workers(num_workers: int) -> int:
    """torch threads that leave one core to each of ``num_workers`` DataLoader workers (at least one).

    An explicit ``OMP_NUM_THREADS``, or no workers, keeps torch's current number.
    """
    if num_workers <= 0 or "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores - num_workers))


def leave_cores_to_workers(num_workers: int) -> int:
    """On a CPU, keep torch's threads to the cores that ``num_workers`` DataLoader workers leave free.

    torch starts one thread per core; with loader workers beside them, threads outnumber cores and
    wait for each other at every parallel operation (on two cores with one worker, the demo trained
    40% slower than its model alone). An explicit ``OMP_NUM_THREADS`` is left as it is.

    Returns:
        The number of torch threads now.
    """
    torch.set_num_threads(threads_beside_workers(num_workers))
    return torch.get_num_threads()


def run_loader(
    dataset: Dataset, sampler: Sampler, micro_batch: int, num_workers: int, device: torch.device
) -> DataLoader:
    """The one training loader of a run: its workers persist from epoch to epoch, and each epoch's
    iterator reads the sampler's epoch and start position as set just before."""
    return DataLoader(
        dataset,
        batch_size=micro_batch,
        sampler=sampler,
        num_workers=num_workers,
        drop_last=True,
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
    )
