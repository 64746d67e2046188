"""``geofm bench onnx``: ``geofm predict`` of one scene by the PyTorch and the ONNX Runtime engine.

A segmentation run (the demo config's model and data, ``geofm demo-data``'s archive; or ``model=RUN``)
is exported with ``geofm export onnx``'s function, and a generated ``scene`` x ``scene`` px GeoTIFF
(smooth synthetic reflectance, as ``geofm bench predict``'s) is predicted by both engines through
the same :func:`finetune.predict.predict_scene`: once untimed, recording every tile's model output,
then ``repeats`` timed rounds alternating the engines' order. Reported: the share of the class map's
pixels where the engines agree, the largest absolute difference of their outputs (logits) over the
scene's tiles, and per engine the median CPU seconds (the process's, all threads) and wall seconds
of a prediction, both engines held to ``threads`` threads.

The config's checkpoint is the demo's federated backbone (``make demo``); by default the benchmark
finetunes from random initialisation instead (``checkpoint=PATH`` to use one): what the engines
compute, not what the weights know, is measured.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Report, Target, repo_path
from benchmarks.data_sources import write_scene
from geofm.data.demo import make_demo_archive

DEFAULTS: dict[str, Any] = {
    "config": "configs/finetune/demo_segmentation__swin_micro.yaml",
    "archive": "data/demo",  # the demo archive (geofm demo-data --out data/demo); written there when missing
    "checkpoint": None,  # the backbone the run starts from (None: random initialisation)
    "epochs": 5,  # the run's finetuning epochs (the config's)
    "model": None,  # a finished geofm finetune run to export instead of finetuning the config
    "work_dir": None,  # keeps the run, the export and the scene there (None: a temporary folder)
    "scene": 1024,  # pixels per side of the generated scene
    "batch_size": 8,
    "repeats": 3,  # timed predictions per engine
    "threads": 1,  # torch threads and ONNX Runtime intra-op threads
}
QUICK: dict[str, Any] = {"epochs": 2, "scene": 160, "repeats": 1}  # 2 epochs: the config warms up for 1
AGREEMENT = 0.999
MAX_ABS_DIFF = 1e-4
ENGINES = ("torch", "onnx")


def _run(settings: dict[str, Any], work: Path) -> Path:
    """The run to export: ``model``, or the config finetuned on the demo archive into ``work/run``."""
    if settings["model"] is not None:
        return repo_path(settings["model"])
    from finetune.run import finetune
    from geofm.config.finetune import FinetuneConfig

    archive = make_demo_archive(repo_path(settings["archive"]))["segmentation"]
    overrides = [
        f"data.root={archive}",
        f"checkpoint={settings['checkpoint'] if settings['checkpoint'] is not None else 'null'}",
        f"run.output_dir={work / 'run'}",
        f"train.epochs={settings['epochs']}",
        "data.num_workers=0",
        "run.progress=false",
    ]
    return finetune(FinetuneConfig.from_file(repo_path(settings["config"]), overrides))


def _predict(predictor: Any, scene: Path, out: Path, batch_size: int, record: list | None = None) -> dict[str, float]:
    """Predict ``scene`` into ``out`` with ``predictor``; its CPU and wall seconds (``record``: append each output)."""
    from finetune.predict import predict_scene

    model_fn = predictor.model_fn
    if record is not None:

        def model_fn(*tiles: Any) -> Any:
            out = predictor.model_fn(*tiles)
            record.append(out.numpy().copy())
            return out

    cpu, wall = time.process_time(), time.perf_counter()
    predict_scene(
        model_fn,
        scene,
        out,
        task=predictor.task,
        normaliser=predictor.normaliser,
        tile=predictor.tile,
        batch_size=batch_size,
        progress=False,
        overwrite=True,
    )
    return {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}


def run(settings: dict[str, Any]) -> Report:
    import torch

    from finetune.onnx_model import export_onnx, load_onnx_predictor
    from finetune.predict import tile_origins
    from finetune.predictor import load_predictor
    from geofm.data.readers import read_raster

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(settings["work_dir"]) if settings["work_dir"] else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        run_dir = _run(settings, work)
        started = time.perf_counter()
        exported = export_onnx(run_dir, work / "model.onnx")
        export_seconds = time.perf_counter() - started
        torch.set_num_threads(settings["threads"])
        predictors = {
            "torch": load_predictor(run_dir),
            "onnx": load_onnx_predictor(run_dir, exported.path, threads=settings["threads"]),
        }
        bands = len(predictors["torch"].normaliser.dataset_bands)
        scene = write_scene(work / "scene.tif", settings["scene"], bands)
        outputs = {name: work / f"classes_{name}.tif" for name in ENGINES}
        recorded: dict[str, list] = {name: [] for name in ENGINES}
        for name in ENGINES:  # untimed: the outputs of every tile, and the class maps compared
            _predict(predictors[name], scene, outputs[name], settings["batch_size"], recorded[name])
        diff = max(float(np.abs(a - b).max()) for a, b in zip(recorded["torch"], recorded["onnx"], strict=True))
        maps = {name: read_raster(path, 1).data for name, path in outputs.items()}
        agreement = float(np.mean(maps["torch"] == maps["onnx"]))
        times: dict[str, list[dict[str, float]]] = {name: [] for name in ENGINES}
        for r in range(settings["repeats"]):
            for name in ENGINES[r % 2 :] + ENGINES[: r % 2]:
                times[name].append(_predict(predictors[name], scene, outputs[name], settings["batch_size"]))
        tile = predictors["torch"].tile
        tiles = len(tile_origins(settings["scene"], tile, tile // 4)) ** 2
        size_mib = exported.path.stat().st_size / 2**20
    engines = {
        name: {
            "cpu_s": [t["cpu_s"] for t in runs],
            "wall_s": [t["wall_s"] for t in runs],
            "median_cpu_s": statistics.median(t["cpu_s"] for t in runs),
            "median_wall_s": statistics.median(t["wall_s"] for t in runs),
        }
        for name, runs in times.items()
    }
    ratio = statistics.median(o["cpu_s"] / t["cpu_s"] for o, t in zip(times["onnx"], times["torch"], strict=True))
    results = {
        "run": str(run_dir),
        "scene_px": settings["scene"],
        "tile": tile,
        "tiles": tiles,
        "pixels": int(maps["torch"].size),
        "agreement": agreement,
        "max_abs_diff": diff,
        "export_check_max_abs_diff": exported.max_abs_diff,
        "export_seconds": export_seconds,
        "onnx_mib": size_mib,
        "engines": engines,
        "cpu_ratio_onnx_to_torch": ratio,
    }
    rows = [
        {
            "engine": name,
            "median CPU s": engines[name]["median_cpu_s"],
            "median wall s": engines[name]["median_wall_s"],
            "tiles/s (wall)": tiles / engines[name]["median_wall_s"],
            "runs": len(times[name]),
        }
        for name in ENGINES
    ]
    targets = [
        Target("class map pixels where the engines agree", agreement, ">=", AGREEMENT),
        Target("max abs difference of the outputs over the scene's tiles", diff, "<=", MAX_ABS_DIFF),
    ]
    start = "random initialisation" if settings["checkpoint"] is None else settings["checkpoint"]
    notes = [
        f"{settings['scene']} x {settings['scene']} px, {bands} bands; {tiles} tiles of {tile} px (overlap "
        f"{tile // 4}), batch {settings['batch_size']}; {settings['threads']} thread(s) per engine (torch threads, "
        "ONNX Runtime intra-op threads), ONNX Runtime's CPUExecutionProvider",
        "the run: "
        + (
            str(settings["model"])
            if settings["model"] is not None
            else f"{settings['config']} finetuned {settings['epochs']} epochs from {start} on the demo archive"
        ),
        f"export: torch.onnx.export(dynamo=True) in {export_seconds:.0f} s, {size_mib:.1f} MiB",
    ]
    return Report(results, targets, rows, notes)
