"""``python -m benchmarks.device_check``: the GPU device check, one prepared run for a machine without network.

It needs torch, timm, einops, safetensors and numpy, and never imports deepspeed, pydantic,
rasterio, flwr or torchgeo, which such a machine may lack. In order, each section in a child
process of its own under a time budget (a slow compile cannot eat the run; a stopped section
keeps what it measured and the run goes on):

1. ``setup``: installs what ``benchmarks/device_requirements.txt`` lists and the machine lacks
   (pytest), offline from the wheels ``make device-wheels`` downloaded, into a temporary folder;
2. ``steps``: the GFM step of the config in bf16 (:mod:`benchmarks.device_step`: plain eager,
   geofm's choices, geofm's compiled): images/s, FLOPs, MFU against the card's bf16 dense peak,
   peak memory, the warm-up (compile) time;
3. ``loader``: chips/s of a DataLoader over a synthetic chip store (:mod:`geofm.data.chipstore`)
   with each worker count, against the step's images/s;
4. ``tests``: the tests marked ``cuda``.

After each section the JSON result and a Markdown summary are written to ``--out`` (default
``$OUT``). ``--dry-run`` runs every section on the CPU with the tiny demo model and tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    REPO,
    Report,
    exit_on_sigterm,
    repo_path,
    result_record,
    run_child,
    summary,
)
from benchmarks.device_report import markdown, report_of
from benchmarks.device_step import VARIANTS, StepShape
from benchmarks.pretrain_step import peak_tflops
from geofm.errors import ConfigError, GeoFMError

DEFAULTS: dict[str, Any] = {
    "device": "cuda",
    "config": "configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml",
    "micro_batch": None,  # None: the config's train.micro_batch_size
    "variants": list(VARIANTS),
    "warmup": 3,
    "steps": 20,
    "compile_backend": "inductor",
    "peak_tflops": None,  # None: the card's datasheet figure (benchmarks.pretrain_step.PEAK_BF16_TFLOPS)
    "loader_workers": [1, 8],
    "loader_chips": 1024,
    "loader_seconds": 8.0,
    "wheels": ".device-wheels",
    "budgets": {"setup": 30, "step": 50, "compiled_step": 190, "loader": 45, "tests": 60},
    "total_budget_s": 440,  # under `timeout 470` in the one-line command: 8 minutes in all
}
QUICK: dict[str, Any] = {  # --dry-run: every section on the CPU, tiny model and sizes
    "device": "cpu",
    "config": "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml",
    "micro_batch": 2,
    "warmup": 1,
    "steps": 2,
    "compile_backend": "aot_eager",  # traced and compiled by torch, without inductor's minutes of C++ on a CPU
    "loader_workers": [1],
    "loader_chips": 16,
    "loader_seconds": 1.0,
    "budgets": {"setup": 300, "step": 300, "compiled_step": 300, "loader": 300, "tests": 300},
    "total_budget_s": 1800,
}
REQUIREMENTS = Path(__file__).with_name("device_requirements.txt")
ENGINE_LIBRARIES = ("deepspeed", "pydantic", "rasterio", "flwr", "torchgeo")


def missing_requirements(requirements: list[str]) -> list[str]:
    """The ``name==version`` requirements whose distribution is not installed (any version counts)."""
    missing = []
    for requirement in requirements:
        try:
            metadata.version(re.split(r"[=<>!~ ]", requirement, maxsplit=1)[0])
        except metadata.PackageNotFoundError:
            missing.append(requirement)
    return missing


def setup(settings: dict[str, Any], site: Path, budget: float) -> dict[str, Any]:
    """Install the missing requirements offline from the carried wheels into ``site``."""
    lines = [line.strip() for line in REQUIREMENTS.read_text().splitlines()]
    missing = missing_requirements([line for line in lines if line and not line.startswith("#")])
    if not missing:
        return {"status": "ok", "installed": []}
    wheels = repo_path(settings["wheels"])
    if not any(wheels.glob("*.whl")):
        return {"status": "failed", "missing": missing, "note": f"no wheels in {wheels}: run make device-wheels"}
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels)]
    child = run_child([*pip, "--target", str(site), *missing], budget)
    return {"status": child.status, "installed": missing, "seconds": child.seconds, "output": child.output[-1500:]}


def step_section(variant: str, settings: dict[str, Any], budget: float, peak: float | None) -> dict[str, Any]:
    """One step variant measured in its own process."""
    child_settings = {**settings, "budget_s": budget}
    child = run_child([sys.executable, "-m", "benchmarks.device_step", variant, json.dumps(child_settings)], budget)
    result: dict[str, Any] = {"status": child.status, "seconds": child.seconds}
    for event in ("built", "flops", "syncs", "memory"):
        for record in child.events(event):
            result.update({k: v for k, v in record.items() if k not in ("event", "seconds")})
    warmup, steps = [r["seconds"] for r in child.events("warmup")], [r["seconds"] for r in child.events("step")]
    result["warmup_s"] = warmup
    if steps:
        result["step_s"] = summary(steps)
        result["images_per_s"] = result["micro_batch"] / result["step_s"]["median"]
        if result.get("flops"):
            result["achieved_tflops"] = result["flops"] / result["step_s"]["median"] / 1e12
            result["mfu"] = result["achieved_tflops"] / peak if peak else None
    if child.status != "ok" or not steps:
        result["output"] = child.output[-1500:]
    return result


def loader_section(settings: dict[str, Any], budget: float, step_rate: float | None) -> dict[str, Any]:
    """The chip-store loader's chips/s with each worker count, against ``step_rate`` images/s."""
    child = run_child([sys.executable, "-m", "benchmarks.device_loader", json.dumps(settings)], budget)
    result: dict[str, Any] = {"status": child.status, "seconds": child.seconds, "step_images_per_s": step_rate}
    result["store"] = next(iter(child.events("store")), None)
    result["workers"] = [
        {
            "workers": r["workers"],
            "chips_per_s": r["chips_per_s"],
            "per_worker": r["chips_per_s"] / max(1, r["workers"]),
            "over_step": r["chips_per_s"] / step_rate if step_rate else None,
        }
        for r in child.events("loader")
    ]
    if child.status != "ok":
        result["output"] = child.output[-1500:]
    return result


def tests_section(site: Path, budget: float, out: Path | None) -> dict[str, Any]:
    """Run the tests marked ``cuda`` (from the test files that mark any) with the installed wheels on the path."""
    files = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark.cuda" in path.read_text()
    )
    if not files:
        return {"status": "no tests marked cuda", "files": []}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider", *files]
    child = run_child(argv, budget, env)
    if out is not None:
        (out / "cuda_tests.txt").write_text(child.output)
    summary_lines = re.findall(r"^.*\d+ \w+.* in [\d.]+s.*$", child.output, re.MULTILINE)
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", summary_lines[-1] if summary_lines else "")}
    result = {"status": child.status, "seconds": child.seconds, "files": files, **counts}
    if child.status != "ok":
        result["output"] = child.output[-1500:]
    return result


def environment(dev: torch.device) -> dict[str, Any]:
    """The software the figures depend on, and whether any engine library was imported (it must not be)."""
    import platform

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "timm": metadata.version("timm"),
        "engine_libraries_imported": [name for name in ENGINE_LIBRARIES if name in sys.modules],
    }
    if dev.type == "cuda":
        info.update(
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
            bf16=torch.cuda.is_bf16_supported(),
            sdpa_backends={
                "flash": torch.backends.cuda.flash_sdp_enabled(),
                "memory_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            },
        )
    return info


def run(settings: dict[str, Any], out: Path | None = None, checkpoint=None) -> Report:
    """Run every section within its budget; ``checkpoint(report)`` is called with the report so far after each.

    Args:
        settings: :data:`DEFAULTS`, with :data:`QUICK` for a dry run.
        out: where the tests' output goes (``cuda_tests.txt``); None: nowhere.
        checkpoint: called after each section with the report so far.

    Raises:
        ConfigError: ``device`` is ``cuda`` and there is none, or the config lacks what the step needs.
    """
    started = time.perf_counter()
    if settings["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("no CUDA device here: the device check measures a GPU (run it with --dry-run on a CPU)")
    dev = torch.device(settings["device"])
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = peak_tflops(settings) if dev.type == "cuda" else settings["peak_tflops"]
    results: dict[str, Any] = {"card": card, "config": settings["config"], "peak_tflops": peak, "steps": {}}
    StepShape.from_file(settings["config"], settings["micro_batch"])  # a config error before any section

    def budget(section: str) -> float:
        return min(settings["budgets"][section], settings["total_budget_s"] - (time.perf_counter() - started))

    def done(section: str, result: dict[str, Any]) -> None:
        print(f"device check: {section}: {result['status']} ({result.get('seconds', 0):.0f} s)", file=sys.stderr)
        results["seconds"] = time.perf_counter() - started
        results["environment"] = environment(dev)
        if checkpoint is not None:
            checkpoint(report_of(results))

    with tempfile.TemporaryDirectory() as site:
        results["setup"] = setup(settings, Path(site), budget("setup"))
        done("setup", results["setup"])
        for variant in settings["variants"]:
            left = budget("compiled_step" if VARIANTS[variant]["compiled"] else "step")
            results["steps"][variant] = step_section(variant, settings, left, peak) if left > 0 else _no_time()
            done(f"step {variant}", results["steps"][variant])
        left = budget("loader")
        results["loader"] = loader_section(settings, left, _feed_rate(results)) if left > 0 else _no_time()
        done("loader", results["loader"])
        left = budget("tests")
        results["tests"] = tests_section(Path(site), left, out) if left > 0 else _no_time()
        done("tests", results["tests"])
    return report_of(results)


def _no_time() -> dict[str, Any]:
    return {"status": "not run: the run's total budget is spent"}


def _feed_rate(results: dict[str, Any]) -> float | None:
    """The images/s the loader must feed: the fastest measured geofm step."""
    rates = [r.get("images_per_s") for v, r in results["steps"].items() if v.startswith("geofm")]
    return max(filter(None, rates), default=None)


def settings_of(dry_run: bool, changes: str) -> dict[str, Any]:
    """:data:`DEFAULTS`, with :data:`QUICK` for a dry run, then the ``--settings`` JSON object.

    Raises:
        ConfigError: the JSON is malformed or names an unknown setting.
    """
    settings = {**DEFAULTS, **(QUICK if dry_run else {})}
    try:
        changes = json.loads(changes)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--settings {changes!r} is not a JSON object: {err}") from None
    unknown = sorted(set(changes) - set(settings)) if isinstance(changes, dict) else ["(not an object)"]
    if unknown:
        raise ConfigError(f"--settings: unknown {', '.join(unknown)}; the settings are {', '.join(sorted(settings))}")
    return {**settings, **changes}


def main(argv: list[str] | None = None) -> int:
    """The command line: run the check, write device_check.json and device_check.md to --out, print the summary."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.device_check",
        description="The GPU device check: the GFM step in bf16 (eager, fused, compiled), the chip-store loader "
        "and the tests marked cuda, each within a time budget, on a machine with torch, timm, einops, "
        "safetensors and numpy.",
    )
    parser.add_argument("--dry-run", action="store_true", help="every section on the CPU with a tiny model and sizes")
    parser.add_argument(
        "--out", type=Path, default=None, help="result folder (default $OUT, else runs/bench/device-check)"
    )
    parser.add_argument("--settings", default="{}", help="""settings to change, a JSON object: '{"micro_batch": 64}'""")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # `timeout` stops the check: the running section's processes stop with it
    from benchmarks.common import machine

    try:
        settings = settings_of(args.dry_run, args.settings)
        out = args.out or Path(os.environ.get("OUT") or "runs/bench/device-check")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--out {out}: cannot create the result folder ({err.strerror})") from None
        command = " ".join(["python -m benchmarks.device_check", *(["--dry-run"] if args.dry_run else [])])
        started, before = time.perf_counter(), machine()

        def write(report: Report) -> str:
            record = result_record("device-check", command, settings, report, started, before)
            (out / "device_check.json").write_text(json.dumps(record, indent=2) + "\n")
            text = markdown(record, report)
            (out / "device_check.md").write_text(text)
            return text

        print(write(run(settings, out, write)))
    except GeoFMError as exc:
        parser.exit(2, f"geofm: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
