"""The chip-store loader of the GPU device check: chips/s of a DataLoader over a synthetic store.

``python -m benchmarks.device_loader SETTINGS_JSON`` writes a store of ``loader_chips`` chips
shaped like the step's input (:func:`geofm.data.chipstore.write_synthetic_store`), then times a
DataLoader over :class:`~geofm.data.chipstore.ChipDataset` (decode, crop, flips, normalisation)
with each of ``loader_workers`` workers for ``loader_seconds``, the batches copied to the device,
and prints one JSON record per line (``store``, then one ``loader`` per worker count).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import emit, synchronizer
from benchmarks.device_step import StepShape


def serve_loader(settings: dict[str, Any]) -> None:
    """Write a synthetic chip store and time a DataLoader over it with each worker count."""
    from torch.utils.data import DataLoader, RandomSampler

    from geofm.data.chipstore import ChipDataset, write_synthetic_store

    shape = StepShape.from_file(settings["config"], settings["micro_batch"])
    bands, size, batch = list(shape.bands), shape.student["img_size"], shape.micro_batch
    dev = torch.device(settings["device"])
    sync = synchronizer(dev)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        root = write_synthetic_store(Path(tmp) / "store", settings["loader_chips"], bands, size, seed=0)
        emit(
            "store", seconds=time.perf_counter() - started, chips=settings["loader_chips"], bands=len(bands), size=size
        )
        dataset = ChipDataset(root, size, mean=[0.0] * len(bands), std=[1.0] * len(bands))
        for workers in settings["loader_workers"]:
            sampler = RandomSampler(dataset, replacement=True, num_samples=10**9)
            loader = DataLoader(
                dataset, batch_size=batch, sampler=sampler, num_workers=workers, pin_memory=dev.type == "cuda"
            )
            batches = iter(loader)
            for _ in range(2 * workers + 1):  # worker start-up and the batches prefetched meanwhile
                next(batches)
            sync()
            started, chips = time.perf_counter(), 0
            while time.perf_counter() - started < settings["loader_seconds"]:
                images = next(batches)["image"].to(dev, non_blocking=True)
                chips += images.shape[0]
            sync()
            emit("loader", workers=workers, chips_per_s=chips / (time.perf_counter() - started), chips=chips)
            del batches


if __name__ == "__main__" and len(sys.argv) == 2:
    serve_loader(json.loads(sys.argv[1]))
