"""``geofm bench startup``: seconds from the command to the first optimizer step, and where they go.

Each round starts two fresh processes, side by side: ``geofm pretrain`` on the demo config (the
demo archive and a random teacher export in a temporary folder, one step), and a floor that
only starts Python and imports torch. The pretraining process times its imports (torch,
torchvision, timm, DeepSpeed, rasterio, then geofm's own modules) and reports the phases the run
logs with its first step: input checks, process group (any extension build), teacher load,
student build, data indexing, engine (DeepSpeed) initialisation, first batch and first step.
"""

from __future__ import annotations

import importlib
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Report, Target, child_env, repo_path

DEFAULTS: dict[str, Any] = {
    "config": "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml",
    "archive": None,  # a demo archive folder; None writes one to a temporary folder
    "rounds": 3,
}
QUICK: dict[str, Any] = {"rounds": 1}
IMPORTS = ("torch", "torchvision", "timm", "deepspeed", "rasterio", "geofm.cli", "pretrain.central")


def teacher_export(folder: Path, cfg) -> Path:
    """A random backbone of the config's teacher, exported as the demo's first stage exports its teacher."""
    import torch

    from geofm.checkpoints import export_backbone
    from geofm.models.backbones import backbone_kwargs, create_backbone
    from geofm.tasks.mim.task import mim_options

    t = mim_options(cfg).teacher
    kwargs = backbone_kwargs(in_chans=3, img_size=t.img_size, window_size=t.window_size, timm_kwargs=t.timm_kwargs)
    torch.manual_seed(0)
    export_backbone(
        create_backbone(t.arch, kwargs),
        folder,
        arch=t.arch,
        create_kwargs=kwargs,
        metadata={"bands": ["red", "green", "blue"]},
    )
    return folder / "backbone.safetensors"


def _pretrain_command(config: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.startup", "--child", str(config), *overrides]


def _spawn(command: list[str]) -> tuple[float, dict]:
    """Run a child; return the wall time at its start and its JSON report (the last stdout line)."""
    started = time.time()
    child = subprocess.run(command, capture_output=True, text=True, env=child_env(DS_ACCELERATOR="cpu"), check=False)
    if child.returncode:
        raise RuntimeError(f"{' '.join(command[:4])} failed:\n{child.stderr[-3000:]}")
    return started, json.loads(child.stdout.strip().splitlines()[-1])


def run(settings: dict[str, Any]) -> Report:
    from geofm.config import PretrainConfig
    from geofm.data.demo import make_demo_archive
    from geofm.tasks.mim.task import mim_options

    config = repo_path(settings["config"])
    runs: list[dict[str, Any]] = []
    floors: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        archive = Path(settings["archive"]) if settings["archive"] else folder / "demo"
        roots = make_demo_archive(archive, seed=0)
        cfg = PretrainConfig.from_file(config)
        overrides = [f"data.sources.{i}.root={roots[s.name]}" for i, s in enumerate(cfg.data.sources)]
        if mim_options(cfg).teacher is not None:
            overrides.append(f"task_options.teacher.checkpoint={teacher_export(folder / 'teacher', cfg)}")
        floor = [sys.executable, "-c", "import json, time, torch; print(json.dumps({'end': time.time()}))"]
        for r in range(settings["rounds"]):
            run_overrides = [
                *overrides,
                f"run.output_dir={folder / f'run{r}'}",
                "run.stop_after_steps=1",
                "run.progress=false",
            ]
            for variant in ("pretrain", "floor") if r % 2 == 0 else ("floor", "pretrain"):
                if variant == "floor":
                    started, report = _spawn(floor)
                    floors.append(report["end"] - started)
                else:
                    started, report = _spawn(_pretrain_command(config, run_overrides))
                    report["total"] = report["first_step_at"] - started
                    report["interpreter"] = report["child_start"] - started
                    runs.append(report)

    total = statistics.median(r["total"] for r in runs)
    phases: dict[str, float] = {"interpreter": statistics.median(r["interpreter"] for r in runs)}
    for name in IMPORTS:
        phases[f"import {name}"] = statistics.median(r["imports"][name] for r in runs)
    for name in runs[0]["startup"]:
        phases[name] = statistics.median(r["startup"][name] for r in runs)
    # What no phase covers: the command line (plugins, arguments), config validation, logging set-up.
    phases["command line and config"] = statistics.median(
        r["total"] - r["interpreter"] - sum(r["imports"].values()) - sum(r["startup"].values()) for r in runs
    )
    floor_s = statistics.median(floors)
    results = {
        "config": str(settings["config"]),
        "seconds_to_first_step": total,
        "phases_s": phases,
        "python_and_torch_import_s": floor_s,
        "runs": [{"total": r["total"], "startup": r["startup"], "imports": r["imports"]} for r in runs],
    }
    rows = [{"phase": name, "seconds": seconds, "share": seconds / total} for name, seconds in phases.items()]
    rows.append({"phase": "total to the first optimizer step", "seconds": total, "share": 1.0})
    notes = [
        f"median of {len(runs)} runs; `python -c 'import torch'` alone takes {floor_s:.1f} s here",
        "first_batch includes starting the DataLoader workers; the phases after the imports are the run's own log",
    ]
    return Report(results, [Target("seconds to the first step (demo config)", total, "<=", 10.0, " s")], rows, notes)


def _child(config: str, overrides: list[str]) -> None:
    """In a fresh process: time the imports, run ``geofm pretrain`` for one step, print what it logged."""
    child_start = time.time()
    imports = {}
    for name in IMPORTS:
        start = time.perf_counter()
        importlib.import_module(name)
        imports[name] = time.perf_counter() - start
    captured: dict[str, Any] = {}

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if hasattr(record, "startup"):
                captured.update(startup=record.startup, first_step_at=record.created)

    logging.getLogger("geofm.pretrain").addHandler(Capture())
    from geofm.cli import main

    if main(["pretrain", "--config", config, *overrides]):
        raise SystemExit("geofm pretrain failed")
    print(json.dumps({"child_start": child_start, "imports": imports, **captured}))


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--child":
    _child(sys.argv[2], sys.argv[3:])
