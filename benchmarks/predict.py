"""``geofm bench predict``: peak memory and tiles/s of ``geofm predict`` on scenes of two sizes.

Each size is a generated ``size`` x ``size`` uint16 GeoTIFF of ``bands`` bands (smooth synthetic
reflectance, as ``geofm bench data``'s large scene), predicted in a fresh process by the config's
segmentation model with random weights (the demo model: what it computes, not what it knows,
sets the speed), tiled as ``geofm predict`` tiles by default. Each process reports its peak
resident memory (its own ``VmHWM``: the interpreter, torch, the model and the prediction), its
resident memory before predicting, and tiles/s. A prediction whose memory does not grow with the
scene has the same peak at both sizes: the target is the larger scene's peak within 1.2x of the
smaller's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Report, Target, child_env, current_rss_mib, peak_rss_mib, repo_path

DEFAULTS: dict[str, Any] = {
    "config": "configs/finetune/demo_segmentation__swin_micro.yaml",
    "sizes": [2048, 8192],  # pixels per side of the two scenes
    "bands": 4,
    "tile": None,  # None: the model's img_size, as geofm predict
    "overlap": None,  # None: a quarter of the tile
    "batch_size": 8,
    "threads": 1,  # torch threads of the predicting process
}
QUICK: dict[str, Any] = {"sizes": [512, 1024]}
FLAT = 1.2  # target: peak at the larger size within this factor of the smaller's


def _child(settings: dict[str, Any], scene: str, out: str) -> None:
    """In a fresh process: build the model, predict the scene, print peak memory and timing as JSON."""
    import torch

    from finetune.models import build_finetune_model
    from finetune.predict import predict_scene, tile_origins
    from geofm.config.finetune import FinetuneConfig
    from geofm.data.finetune import BandNormaliser

    torch.set_num_threads(settings["threads"])
    cfg = FinetuneConfig.from_file(repo_path(settings["config"]), ["checkpoint=null"])
    torch.manual_seed(0)
    model, _ = build_finetune_model(cfg, load_weights=False)
    model.eval()
    tile = settings["tile"] or cfg.model.img_size
    overlap = tile // 4 if settings["overlap"] is None else settings["overlap"]
    before = current_rss_mib()
    started = time.perf_counter()
    predict_scene(
        model,
        scene,
        out,
        task=cfg.task,
        normaliser=BandNormaliser.from_config(cfg.data),
        tile=tile,
        overlap=overlap,
        batch_size=settings["batch_size"],
        progress=False,
    )
    seconds = time.perf_counter() - started
    size = settings["size"]
    tiles = len(tile_origins(size, tile, overlap)) ** 2
    report = {
        "seconds": seconds,
        "tiles": tiles,
        "tile": tile,
        "rss_before_mib": before,
        "peak_rss_mib": peak_rss_mib(),
    }
    print(json.dumps(report))


def _predict(settings: dict[str, Any], size: int, folder: Path) -> dict[str, Any]:
    """Generate a ``size`` px scene and predict it in a child process; its report."""
    from benchmarks.data_sources import write_scene

    scene = write_scene(folder / f"scene_{size}.tif", size, settings["bands"])
    out = folder / f"classes_{size}.tif"
    command = [sys.executable, "-m", "benchmarks.predict", "--child", json.dumps({**settings, "size": size})]
    child = subprocess.run(
        [*command, str(scene), str(out)],
        capture_output=True,
        text=True,
        env=child_env(DS_ACCELERATOR="cpu"),
        check=False,
    )
    if child.returncode:
        raise RuntimeError(f"predicting the {size} px scene failed:\n{child.stderr[-3000:]}")
    report = json.loads(child.stdout.strip().splitlines()[-1])
    scene.unlink()
    return {**report, "size": size, "tiles_per_s": report["tiles"] / report["seconds"]}


def run(settings: dict[str, Any]) -> Report:
    small, large = sorted(settings["sizes"])
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_predict(settings, size, Path(tmp)) for size in (small, large)]
    growth = runs[1]["peak_rss_mib"] / runs[0]["peak_rss_mib"]
    rows = [
        {
            "scene": f"{r['size']} x {r['size']} px, {settings['bands']} bands",
            "raw MiB": r["size"] ** 2 * settings["bands"] * 2 / 2**20,
            "tiles": r["tiles"],
            "tiles/s": r["tiles_per_s"],
            "seconds": r["seconds"],
            "RSS before MiB": r["rss_before_mib"],
            "peak RSS MiB": r["peak_rss_mib"],
        }
        for r in runs
    ]
    targets = [
        Target(
            f"peak RSS at {large} px / at {small} px",
            growth,
            "<=",
            FLAT,
            "x",
            "memory flat in the scene's size",
        )
    ]
    notes = [
        f"{runs[0]['tile']} px tiles, batch {settings['batch_size']}, {settings['threads']} torch thread(s), "
        "random weights; RSS before = the interpreter, torch and the model, before predicting",
        "before GDAL's cache was bounded and freed memory handed back (the scene's input blocks cached, "
        "freed arrays kept by glibc), an 8000 x 8000 px, 4-band scene peaked at 2.2 GB",
    ]
    return Report({"runs": runs, "peak_growth": growth}, targets, rows, notes)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--child":
    _child(json.loads(sys.argv[2]), sys.argv[3], sys.argv[4])
