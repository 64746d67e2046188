"""``geofm bench predict``: peak memory and tiles/s of ``geofm predict`` on scenes of two sizes.

Each size is a generated ``size`` x ``size`` uint16 GeoTIFF of ``bands`` bands (smooth synthetic
reflectance, as ``geofm bench data``'s large scene), predicted in a fresh process by the config's
segmentation model with random weights (the demo model: what it computes, not what it knows,
sets the speed), tiled as ``geofm predict`` tiles by default. Each process reports its peak
resident memory (its own ``VmHWM``: the interpreter, torch, the model and the prediction), its
resident memory before predicting, and tiles/s. A prediction whose memory does not grow with the
scene has the same peak at both sizes: the target is the larger scene's peak within 1.2x of the
smaller's.

With ``model=RUN`` (a ``geofm finetune`` run directory) each scene is instead predicted by the
command itself, ``geofm predict --model RUN``, ``repeats`` times, each under ``/usr/bin/time -v``,
whose maximum resident set size is the process's own peak, as a user measures it; with
``baseline=FOLDER`` (another checkout of geofm, e.g. the commit before a change) the same
predictions of that code alternate with this checkout's, in the same rounds. The target: the
larger scene's median peak at most 64 MiB above the smaller's. ``python -m benchmarks.predict
--markdown RESULT.json`` prints the result's table for the docs.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Report, Target, child_env, current_rss_mib, markdown_table, peak_rss_mib, repo_path
from benchmarks.data_sources import write_scene
from geofm.errors import ConfigError

DEFAULTS: dict[str, Any] = {
    "config": "configs/finetune/demo_segmentation__swin_micro.yaml",
    "sizes": [2048, 8192],  # pixels per side of the two scenes
    "bands": 4,
    "tile": None,  # None: the model's img_size, as geofm predict
    "overlap": None,  # None: a quarter of the tile
    "batch_size": 8,
    "threads": 1,  # torch threads of the predicting process
    "model": None,  # a geofm finetune run: time `geofm predict --model RUN` itself, under /usr/bin/time -v
    "repeats": 1,  # predictions of each scene (model runs)
    "baseline": None,  # model runs: another checkout of geofm predicting the same scenes in the same rounds
    "rows": None,  # model runs: the scenes' height (default: square); memory depends on the width
}
QUICK: dict[str, Any] = {"sizes": [256, 512]}
FLAT = 1.2  # target: peak at the larger size within this factor of the smaller's
FLAT_MIB = 64  # model runs' target: the larger scene's median peak at most this far above the smaller's
TIME = Path("/usr/bin/time")


def _child(settings: dict[str, Any], scene: str, out: str) -> None:
    """In a fresh process: build the model, predict the scene, print peak memory and timing as JSON."""
    import torch

    from finetune.predict import predict_scene, tile_origins
    from geofm.config.finetune import FinetuneConfig
    from geofm.data.finetune import BandNormaliser
    from geofm.tasks.finetuning.model import build_finetune_model

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


def _command_peak(settings: dict[str, Any], code: Path, scene: Path, out: Path) -> dict[str, float]:
    """``geofm predict`` of ``scene`` by the geofm checkout in ``code`` under ``/usr/bin/time -v``: the
    process's maximum resident set size and its seconds."""
    stats = out.with_name(out.name + ".time")
    command = [str(TIME), "-v", "-o", str(stats), sys.executable, "-m", "geofm.cli", "predict", "--no-progress"]
    command += ["--model", str(repo_path(settings["model"]).resolve()), "--input", str(scene), "--output", str(out)]
    command += ["--batch-size", str(settings["batch_size"])]
    for option in ("tile", "overlap"):
        command += [f"--{option}", str(settings[option])] if settings[option] is not None else []
    env = child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(settings["threads"]), PYTHONPATH=str(code))
    started = time.perf_counter()
    child = subprocess.run(command, cwd=code, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - started
    if child.returncode:
        raise RuntimeError(f"geofm predict of {scene.name} by {code} failed:\n{child.stderr[-3000:]}")
    kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stats.read_text())
    out.unlink()
    stats.unlink()
    return {"peak_rss_mib": int(kib.group(1)) / 1024, "seconds": seconds}


def _label(code: Path) -> str:
    """A checkout's name in the table: its commit, or its folder's name."""
    commit = subprocess.run(
        ["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return commit.stdout.strip() if commit.returncode == 0 else code.name


def _run_command(settings: dict[str, Any], small: int, large: int) -> Report:
    """Model runs: each scene predicted ``repeats`` times by ``geofm predict`` of each checkout, alternating."""
    if not TIME.exists():
        raise ConfigError(f"model=: measuring geofm predict needs GNU time at {TIME}")
    codes = {"this checkout": repo_path(".").resolve()}
    if settings["baseline"]:
        codes = {"baseline": Path(settings["baseline"]).resolve(), **codes}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        scenes = {
            size: write_scene(Path(tmp) / f"scene_{size}.tif", size, settings["bands"], settings["rows"])
            for size in (small, large)
        }
        for repeat in range(settings["repeats"]):
            for size, scene in scenes.items():
                for name, code in codes.items():
                    peak = _command_peak(settings, code, scene, Path(tmp) / f"classes_{size}.tif")
                    runs.append({"code": name, "size": size, "repeat": repeat, **peak})
                    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # each run as it ends: a long benchmark
    table, growth = [], {}
    for name, code in codes.items():
        medians = {}
        for size in (small, large):
            mine = [r for r in runs if r["code"] == name and r["size"] == size]
            medians[size] = statistics.median(r["peak_rss_mib"] for r in mine)
            table.append(
                {
                    "code": f"{name} ({_label(code)})",
                    "scene": f"{size} x {settings['rows'] or size} px, {settings['bands']} bands",
                    "runs": len(mine),
                    "median peak RSS MiB": medians[size],
                    "peaks MiB": ", ".join(f"{r['peak_rss_mib']:,.0f}" for r in mine),
                    "median seconds": statistics.median(r["seconds"] for r in mine),
                }
            )
        growth[name] = medians[large] - medians[small]
    targets = [
        Target(f"median peak at {large} px - at {small} px", growth["this checkout"], "<=", FLAT_MIB, "MiB", "flat")
    ]
    notes = [
        f"geofm predict --model {settings['model']} --tile {settings['tile'] or 'model.img_size'}, batch "
        f"{settings['batch_size']}, OMP_NUM_THREADS={settings['threads']}; peak = /usr/bin/time -v's maximum resident "
        "set size of the command's process"
    ]
    return Report({"runs": runs, "table": table, "growth_mib": growth}, targets, table, notes)


def run(settings: dict[str, Any]) -> Report:
    small, large = sorted(settings["sizes"])
    if settings["model"] is not None:
        return _run_command(settings, small, large)
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
elif __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--markdown":
    print(markdown_table(json.loads(Path(sys.argv[2]).read_text())["results"]["table"]))
