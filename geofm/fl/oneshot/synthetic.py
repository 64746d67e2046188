"""The synthetic classification split of the one-shot programs: samples per client and class, resumably.

FedDiff (:mod:`geofm.fl.oneshot.feddiff`) and OSCAR (:mod:`geofm.fl.oneshot.oscar`) draw, per client
and class, as many samples as the client holds of the class (``diffusion.samples: as_data``) or a
fixed number, in batches. Each batch is written as float32 GeoTIFFs of the dataset's bands in raw
units into ``folder/<class name>/<client>_<i>.tif`` and recorded in ``folder/samples.jsonl``, after
its files: a rerun skips the recorded batches, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from geofm.config.oneshot import DiffusionOneShotConfig
from geofm.data.writers import write_geotiff
from geofm.fl.privacy.client_level import noise_generator
from geofm.runlog import progress_bar

SAMPLES_LOG = "samples.jsonl"


@dataclass(frozen=True)
class SampleJob:
    """One batch to draw: ``count`` samples of class ``label`` for ``client``, numbered from ``start``."""

    client: str
    label: int
    start: int
    count: int


Draw = Callable[[SampleJob], tuple[Tensor, list[float] | None]]
"""Draws a job's samples: normalised images (count, bands, H, W) on the CPU, and a score per sample or None."""


def seeded_generator(device: torch.device | str, seed: int | None, *parts: object) -> torch.Generator:
    """A generator on ``device`` seeded from ``seed`` and ``parts`` as :func:`~geofm.fl.privacy.client_level.noise_generator`
    seeds one: the same in every process, from OS entropy when ``seed`` is None."""
    return torch.Generator(device).manual_seed(noise_generator(seed, *parts).initial_seed())


def planned(counts: np.ndarray, samples: str | int) -> dict[int, int]:
    """How many samples of each class a client gets from its per-class ``counts``: its count (``samples:
    as_data``) or ``samples`` for each class it holds."""
    return {k: int(n) if samples == "as_data" else int(samples) for k, n in enumerate(counts) if n}


def sample_jobs(cfg: DiffusionOneShotConfig, counts: dict[str, np.ndarray]) -> list[SampleJob]:
    """The batches of ``diffusion.sample_batch`` samples of every client (by name: its per-class counts)."""
    d = cfg.diffusion
    return [
        SampleJob(client, k, start, min(d.sample_batch, n - start))
        for client, held in counts.items()
        for k, n in planned(held, d.samples).items()
        for start in range(0, n, d.sample_batch)
    ]


def key(job: SampleJob) -> tuple[str, int, int]:
    """A job's key in ``samples.jsonl``: client, label, start."""
    return job.client, job.label, job.start


def _records(path: Path) -> list[dict]:
    """The batches ``samples.jsonl`` records as done (a last line cut short by a kill is left out)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def write_samples(cfg: DiffusionOneShotConfig, jobs: list[SampleJob], draw: Draw, folder: Path) -> list[dict]:
    """Draw and write every job not yet recorded in ``folder/samples.jsonl``, with a progress bar.

    Returns:
        One record per job, in order: ``client``, ``label``, ``start``, ``files`` (relative to
        ``folder``) and ``scores`` (what ``draw`` returned beside the images).
    """
    data = cfg.data
    log_path = folder / SAMPLES_LOG
    done = {(r["client"], r["label"], r["start"]): r for r in _records(log_path)}
    std, mean = (torch.tensor(v).view(-1, 1, 1) for v in (data.std, data.mean))
    bar = progress_bar(len(jobs), sum(key(j) in done for j in jobs), cfg.run.progress, "sampling", unit="batch")
    for job in jobs:
        if key(job) in done:
            continue
        images, scores = draw(job)
        files = []
        for i, pixels in enumerate(((images * std + mean) / data.scale).numpy().astype(np.float32)):
            path = folder / data.class_names[job.label] / f"{job.client}_{job.start + i:05d}.tif"
            write_geotiff(path, pixels, transform=(1.0, 0.0, 0.0, 0.0, -1.0, float(pixels.shape[1])), crs=None)
            files.append(path.relative_to(folder).as_posix())
        record = {"client": job.client, "label": job.label, "start": job.start, "files": files, "scores": scores}
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        done[key(job)] = record
        bar.update()
    bar.close()
    return [done[key(job)] for job in jobs]


__all__ = ["SAMPLES_LOG", "Draw", "SampleJob", "planned", "sample_jobs", "seeded_generator", "write_samples"]
