"""Super-resolution between different bands at each resolution, end to end on GeoTIFF pairs:
finetune, evaluate and predict a scene whose output carries the high-resolution side's bands."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import rasterio

from finetune.run import finetune
from geofm.cli import main
from geofm.config.finetune import FinetuneConfig
from geofm.data.writers import write_geotiff

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOW = ["blue", "green", "red", "nir"]
LOW_TRANSFORM = (2.0, 0.0, 500_000.0, 0.0, -2.0, 4_000_000.0)
HIGH_TRANSFORM = (1.0, 0.0, 500_000.0, 0.0, -1.0, 4_000_000.0)
CASES = {
    # Pleiades-like: 4-band uint16 multispectral to 8-bit pan-sharpened RGB (other units: float32 output)
    "rgb": {"bands": ["red", "green", "blue"], "dtype": np.uint8, "scale": 1 / 255, "output": "float32"},
    # Landsat-like: multispectral to panchromatic in the same units (the input's dtype)
    "pan": {"bands": ["pan"], "dtype": np.uint16, "scale": 1e-4, "output": "uint16"},
}


def _write_pairs(root: Path, case: dict) -> None:
    """4 train, 2 val, 2 test pairs: 4-band uint16 32x32 at 2 m, and the case's bands 64x64 at 1 m."""
    rng = np.random.default_rng(0)
    high_max = 255 if case["dtype"] == np.uint8 else 10000
    for split, count in (("train", 4), ("val", 2), ("test", 2)):
        for i in range(count):
            low = rng.integers(1, 10000, (len(LOW), 32, 32)).astype(np.uint16)
            high = rng.integers(1, high_max, (len(case["bands"]), 64, 64)).astype(case["dtype"])
            write_geotiff(root / split / "lr" / f"{i}.tif", low, transform=LOW_TRANSFORM, crs=32632)
            write_geotiff(root / split / "hr" / f"{i}.tif", high, transform=HIGH_TRANSFORM, crs=32632)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_finetune_evaluate_and_predict_into_the_high_resolution_bands(name, finetune_tree, tmp_path, capsys):
    case = CASES[name]
    _write_pairs(tmp_path / "data", case)
    n = len(case["bands"])
    hr = {"dataset_bands": case["bands"], "scale": case["scale"], "mean": [0.4] * n, "std": [0.2] * n}
    data = {"root": str(tmp_path / "data"), "dataset_bands": LOW, "bands": LOW, "hr": hr}
    tree = finetune_tree("superres", tmp_path / "run", data=data, train={"epochs": 1, "micro_batch_size": 2})
    run_dir = finetune(FinetuneConfig.from_tree(tree))
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert list(evaluation["metrics"]) == ["psnr", "ssim"]
    assert all(math.isfinite(v) for v in evaluation["metrics"].values()), evaluation["metrics"]

    assert main(["eval", "--out", str(tmp_path / "eval_val.json"), f"checkpoint={run_dir}", "split=val"]) == 0
    assert json.loads((tmp_path / "eval_val.json").read_text())["samples"] == 2
    capsys.readouterr()

    scene = tmp_path / "scene.tif"
    pixels = np.random.default_rng(1).integers(1, 10000, (len(LOW), 40, 50)).astype(np.uint16)
    write_geotiff(scene, pixels, transform=LOW_TRANSFORM, crs=32632)
    out = tmp_path / "sharp.tif"
    assert (
        main(["predict", "--model", str(run_dir), "--input", str(scene), "--output", str(out), "--no-progress"]) == 0
    ), capsys.readouterr().err
    with rasterio.open(out) as src:
        assert (src.count, src.height, src.width) == (n, 80, 100), "the high-resolution side's bands at twice the size"
        assert src.descriptions == tuple(case["bands"]), "bands named as the high-resolution side's"
        assert src.dtypes[0] == case["output"]
        assert tuple(src.transform)[:6] == HIGH_TRANSFORM
        assert np.isfinite(src.read().astype(np.float64)).all()
