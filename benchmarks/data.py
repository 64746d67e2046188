"""``geofm bench data``: images/s of the pretraining data pipeline against what the training step consumes.

Timed side by side, in alternating rounds:

* ``worker``: what one DataLoader worker does, in this process with one torch thread: read,
  normalise, augment and mask ``micro_batch`` samples of the config's pile and collate them;
* ``step``: the config's training step alone on synthetic batches (its images/s is what the
  pipeline has to feed), shared by ``data.num_workers`` workers;
* ``pipeline``: the step fed by a real DataLoader with the config's workers, as a run trains;
* ``scene``: the worker's job on chips of a large scene (a generated Sentinel-2-sized GeoTIFF, cut
  by ``chip_size`` and read window by window), with the memory it takes.

The archive is the built-in demo archive, written to a temporary folder unless ``archive`` names
one; the teacher has random weights.
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from benchmarks.common import Report, Target, alternate, current_rss_mib, paired_ratio, summary
from benchmarks.pretrain_step import build, synthetic_batch

DEFAULTS: dict[str, Any] = {
    "config": "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml",
    "archive": None,  # a demo archive folder; None writes one to a temporary folder
    "rounds": 4,
    "steps": 8,  # training steps per timing of ``step`` and ``pipeline``
    "scene_size": 10980,  # pixels per side of the generated large scene (Sentinel-2 10 m tile)
    "scene_bands": 4,
    "chip_size": 512,
}
QUICK: dict[str, Any] = {"rounds": 2, "steps": 3, "scene_size": 1536, "chip_size": 256}


@contextlib.contextmanager
def torch_threads(count: int):
    """Run a block with ``count`` torch threads, as a DataLoader worker has one."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_scene(path: Path, size: int, bands: int) -> Path:
    """A ``size`` x ``size`` uint16 GeoTIFF of smooth synthetic reflectance, written strip by strip."""
    from geofm.data.writers import GeoTiffWriter

    columns = np.arange(size, dtype=np.float32)
    with GeoTiffWriter(
        path,
        width=size,
        height=size,
        count=bands,
        dtype="uint16",
        crs="EPSG:32632",
        transform=(10.0, 0.0, 300000.0, 0.0, -10.0, 5000000.0),
        nodata=0,
    ) as writer:
        for row in range(0, size, 1024):
            rows = np.arange(row, min(row + 1024, size), dtype=np.float32)[:, None]
            strip = np.stack(
                [
                    1000 + 800 * np.sin(rows / (50 + 7 * b)) * np.cos(columns / (60 + 5 * b)) + 300 * b
                    for b in range(bands)
                ]
            )
            writer.write((strip + 1500).astype(np.uint16), row)
    return path


def scene_source(cfg, scene: Path, chip_size: int, bands: int):
    """The config's data section reading only the large scene, cut into chips."""
    from geofm.data.bands import canonical_bands

    names = ["blue", "green", "red", "nir", "rededge1", "swir16"][:bands]
    source = {
        "name": "scene",
        "root": str(scene.parent),
        "pattern": scene.name,
        "bands": canonical_bands(names, []),
        "scale": 0.0001,
        "nodata": 0,
        "mean": [0.2] * bands,
        "std": [0.1] * bands,
        "chip_size": chip_size,
    }
    return cfg.data.model_copy(update={"sources": [type(cfg.data.sources[0]).model_validate(source)]})


class WorkerJob:
    """One worker's batches from a pile: samples in the sampler's order, collated, with one torch thread."""

    def __init__(self, pile, micro: int, seed: int = 0) -> None:
        from geofm.data.pile import PileSampler

        sampler = PileSampler(pile.source_sizes, pile.weights, max(pile.samples_per_epoch, micro), seed=seed)
        self.pile, self.micro = pile, micro
        self.indices = itertools.cycle(list(sampler))
        self.rss_peak = 0.0

    def __call__(self) -> None:
        with torch_threads(1):
            default_collate([self.pile[next(self.indices)] for _ in range(self.micro)])
        self.rss_peak = max(self.rss_peak, current_rss_mib() or 0.0)


class Pipeline:
    """The training step fed by a DataLoader as a run sets it up: persistent workers, one long epoch,
    and torch's threads leaving a core to each worker (:func:`geofm.training.threads_beside_workers`)."""

    def __init__(self, pile, step, micro: int, workers: int, steps: int) -> None:
        from geofm.data.pile import PileSampler
        from geofm.training import threads_beside_workers

        sampler = PileSampler(pile.source_sizes, pile.weights, 10**6, seed=0)
        loader = DataLoader(
            pile, batch_size=micro, sampler=sampler, num_workers=workers, drop_last=True, persistent_workers=workers > 0
        )
        self.batches, self.step, self.steps = iter(loader), step, steps
        self.threads = threads_beside_workers(workers)

    def __call__(self) -> None:
        with torch_threads(self.threads):
            for _ in range(self.steps):
                self.step.batch = next(self.batches)
                self.step()


def run(settings: dict[str, Any]) -> Report:
    from benchmarks.pretrain_step import load_config
    from geofm.data.demo import make_demo_archive
    from geofm.data.pile import PretrainPile
    from geofm.models.backbones import patch_size_of
    from geofm.models.masking import MaskGenerator

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        archive = Path(settings["archive"]) if settings["archive"] else folder / "demo"
        roots = make_demo_archive(archive, seed=0)
        cfg = load_config({"config": settings["config"], "overrides": [], "micro_batch": None}, folder)
        cfg = cfg.model_copy(
            update={
                "data": cfg.data.model_copy(
                    update={"sources": [s.model_copy(update={"root": roots[s.name]}) for s in cfg.data.sources]}
                )
            }
        )
        micro, workers = cfg.train.micro_batch_size, cfg.data.num_workers
        masks = MaskGenerator(
            cfg.model.img_size,
            cfg.masking.mask_patch_size,
            patch_size_of(cfg.model.arch, cfg.model.timm_kwargs),
            cfg.masking.mask_ratio,
        )
        pile = PretrainPile(cfg.data, cfg.model.img_size, mask_fn=masks)

        started = time.perf_counter()
        scene = write_scene(folder / "scene.tif", settings["scene_size"], settings["scene_bands"])
        written_s = time.perf_counter() - started
        scene_pile = PretrainPile(
            scene_source(cfg, scene, settings["chip_size"], settings["scene_bands"]), cfg.model.img_size, mask_fn=masks
        )

        step = build("optimised", cfg, synthetic_batch(cfg))
        steps = settings["steps"]
        worker, scene_worker = WorkerJob(pile, micro), WorkerJob(scene_pile, micro)
        pipeline = Pipeline(pile, build("optimised", cfg, synthetic_batch(cfg)), micro, workers, steps)
        rss_before = current_rss_mib() or 0.0

        def model_alone() -> None:
            for _ in range(steps):
                step()

        times = alternate(
            {"worker": worker, "step": model_alone, "pipeline": pipeline, "scene": scene_worker},
            settings["rounds"],
            warmup=1,
        )
        scene_bytes = scene.stat().st_size

    per_image = {
        "worker": [t / micro for t in times["worker"]],
        "step": [t / (micro * steps) for t in times["step"]],
        "pipeline": [t / (micro * steps) for t in times["pipeline"]],
        "scene": [t / micro for t in times["scene"]],
    }
    rate = {k: 1.0 / summary(v)["median"] for k, v in per_image.items()}
    # Without workers the main process loads between steps: its "share" is the whole step.
    share = rate["step"] / max(workers, 1)
    worker_over_share = paired_ratio(per_image, "step", "worker") * max(workers, 1)
    pipeline_over_step = paired_ratio(per_image, "step", "pipeline")
    raw_scene = settings["scene_size"] ** 2 * settings["scene_bands"] * 2
    results = {
        "micro_batch": micro,
        "num_workers": workers,
        "images_per_s": rate,
        "step_share_per_worker": share,
        "worker_over_share": worker_over_share,
        "pipeline_over_model_alone": pipeline_over_step,
        "scene": {
            "size": settings["scene_size"],
            "bands": settings["scene_bands"],
            "chip_size": settings["chip_size"],
            "chips": len(scene_pile.sources[0]),
            "file_mib": scene_bytes / 2**20,
            "raw_mib": raw_scene / 2**20,
            "write_s": written_s,
            "rss_growth_mib": max(0.0, scene_worker.rss_peak - rss_before),
        },
    }
    rows = [
        {"what": "worker: demo chips", "images/s": rate["worker"], "x its share": worker_over_share},
        {
            "what": f"worker: {settings['scene_size']} px scene by {settings['chip_size']} px windows",
            "images/s": rate["scene"],
        },
        {"what": "training step alone", "images/s": rate["step"]},
        {"what": f"step fed by {workers} worker(s)", "images/s": rate["pipeline"], "x its share": pipeline_over_step},
    ]
    targets = [Target("one worker / its share of the step's images/s", worker_over_share, ">=", 2.0, "x")]
    targets.append(Target("pipeline / model-alone images/s", pipeline_over_step, ">=", 0.9, "x", "below: data-bound"))
    notes = [
        f"large scene: {raw_scene / 2**20:,.0f} MiB of pixels ({scene_bytes / 2**20:,.0f} MiB on disk), "
        f"{results['scene']['chips']} chips read by window; resident memory grew by at most "
        f"{results['scene']['rss_growth_mib']:.0f} MiB over the run's state while reading",
        f"per-worker share = step images/s / {workers} worker(s) = {share:.0f} images/s",
    ]
    return Report(results, targets, rows, notes)
