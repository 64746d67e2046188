"""What every benchmark shares: machine and library facts, alternating timing, targets, results.

Timings on a shared or throttled machine drift; comparing variants measured minutes apart mixes
that drift into the comparison. :func:`alternate` therefore times every variant once per round,
rotating their order each round, and comparisons are reported as the median over rounds of the
per-round ratio (:func:`paired_ratio`), which cancels what the rounds share.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geofm.memory import peak_resident_bytes

if TYPE_CHECKING:
    import torch

LIBRARIES = ("torch", "torchvision", "timm", "deepspeed", "flwr", "rasterio", "numpy", "scikit-learn", "geofm")
REPO = Path(__file__).resolve().parents[1]


def machine() -> dict[str, Any]:
    """Facts about this machine that bear on timings: CPU, cores usable, threads, memory, load, GPU."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_gib": _memory_gib(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(),
        }
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def libraries() -> dict[str, str | None]:
    """Installed versions of the libraries the figures depend on (None when not installed)."""
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def peak_rss_mib() -> float | None:
    """This process's own peak resident memory so far, in MiB (:func:`geofm.memory.peak_resident_bytes`;
    None where the system does not tell it)."""
    peak = peak_resident_bytes()
    return None if peak is None else peak / 2**20


def current_rss_mib() -> float | None:
    """Resident memory of this process now, in MiB (None where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child geofm process, without the process-group variables
    this process's own one-process group set (the child forms its own)."""
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {**{k: v for k, v in os.environ.items() if k not in launcher}, **extra}


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device`` to finish its queued work (nothing to wait for on a CPU)."""
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def alternate(
    variants: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    warmup: int = 1,
    number: int = 1,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Time variants side by side: each round runs every variant once, the order rotated each round.

    Args:
        variants: name -> a call to time.
        rounds: timed rounds.
        warmup: untimed rounds first (allocations, caches, compilation).
        number: calls per timing; the time is divided by it (for calls of a few milliseconds).
        sync: waits for queued device work; called before the clock starts and before it stops.

    Returns:
        Seconds per call of each variant, one value per round, in round order.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            call = variants[name]
            sync()
            start = time.perf_counter()
            for _ in range(number):
                call()
            sync()
            times[name].append((time.perf_counter() - start) / number)
    return times


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median, minimum and maximum of timings, and how many there were."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def paired_ratio(times: Mapping[str, Sequence[float]], numerator: str, denominator: str) -> float:
    """Median over rounds of ``times[numerator][r] / times[denominator][r]``."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator], strict=True))


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares ``y = intercept + slope x`` and its coefficient of determination ``r2``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx if sxx else 0.0
    intercept = my - slope * mx
    total = sum((y - my) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - residual / total if total else 1.0}


@dataclass(frozen=True)
class Target:
    """A figure set against a goal: ``value`` compared with ``goal`` by ``op`` (``>=`` or ``<=``)."""

    name: str
    value: float | None
    op: str
    goal: float
    unit: str = ""
    note: str = ""

    @property
    def met(self) -> bool | None:
        """Whether the goal is reached (None when the figure could not be measured here)."""
        if self.value is None or (isinstance(self.value, float) and math.isnan(self.value)):
            return None
        return self.value >= self.goal if self.op == ">=" else self.value <= self.goal

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": _round(self.value),
            "goal": f"{self.op} {self.goal:g}{self.unit}",
            "met": self.met,
            **({"note": self.note} if self.note else {}),
        }


@dataclass
class Report:
    """What a benchmark returns: its figures, targets, a table for people and notes."""

    results: dict[str, Any]
    targets: list[Target] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _round(value: Any, digits: int = 4) -> Any:
    """Floats rounded to ``digits`` significant digits, recursively (JSON stays readable)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _round(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v, digits) for v in value]
    return value


def result_record(
    name: str, command: str, settings: Mapping[str, Any], report: Report, started: float, machine_before: dict
) -> dict[str, Any]:
    """The JSON result of a run: what ran where, with which settings, and what it measured."""
    after = machine()
    return {
        "benchmark": name,
        "command": command,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 2),
        "machine": {**machine_before, "load_average_after": after["load_average"]},
        "libraries": libraries(),
        "settings": _round(dict(settings)),
        "results": _round(report.results),
        "targets": [t.record() for t in report.targets],
        "notes": report.notes,
    }


def format_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """Rows of dicts as an aligned plain-text table (columns in first-seen order)."""
    rows = list(rows)
    if not rows:
        return ""
    columns = _columns(rows)
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    text = [all(isinstance(row.get(c), str) for row in rows) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in cells:
        lines.append(
            "  ".join(v.ljust(w) if t else v.rjust(w) for v, w, t in zip(r, widths, text, strict=True)).rstrip()
        )
    return "\n".join(lines)


def markdown_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """Rows of dicts as a Markdown table (columns in first-seen order, cells as :func:`format_table` writes them)."""
    rows = list(rows)
    if not rows:
        return ""
    columns = _columns(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _columns(rows: list[Mapping[str, Any]]) -> list[str]:
    """Every key of ``rows``, in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return columns


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def format_report(record: Mapping[str, Any], report: Report) -> str:
    """The human-readable view of a run: the table, the targets and the notes."""
    machine_info = record["machine"]
    gpu = machine_info["gpu"]["name"] if machine_info.get("gpu") else "no GPU"
    lines = [
        f"geofm bench {record['benchmark']}: {machine_info['cpu']}, {machine_info['usable_cpus']} usable CPUs, "
        f"{machine_info['torch_threads']} torch threads, {gpu}, load {machine_info['load_average']} -> "
        f"{machine_info['load_average_after']}, {record['seconds']:.0f} s",
        "",
        format_table(report.rows),
    ]
    if report.targets:
        lines += [
            "",
            format_table(
                {"target": t.name, "value": t.value, "goal": t.record()["goal"], "met": t.met} for t in report.targets
            ),
        ]
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def repo_path(path: str | Path) -> Path:
    """A path as given when it exists, else relative to the repository holding the benchmarks."""
    path = Path(path)
    return path if path.is_absolute() or path.exists() else REPO / path


def exit_on_sigterm() -> None:
    """Make SIGTERM (``timeout``'s signal) raise SystemExit, so that :func:`run_child` kills the running child."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def emit(event: str, **record: Any) -> None:
    """Print one JSON record for the parent of a child process (:func:`run_child`), at once."""
    print(json.dumps({"event": event, **record}), flush=True)


@dataclass
class ChildRun:
    """What a section's child process did: ``ok``, ``failed`` or ``timed out``, its JSON records and other output."""

    status: str
    seconds: float
    records: list[dict[str, Any]] = field(default_factory=list)
    output: str = ""

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == name]


def run_child(argv: list[str], budget_s: float, env: dict[str, str] | None = None) -> ChildRun:
    """Run ``argv`` in the repository (:data:`REPO`), collecting the JSON lines it prints, for at most ``budget_s`` seconds.

    Past the budget its whole process group (DataLoader workers, compile workers) is killed; the
    records printed until then are kept. The child runs in a session of its own, so that group is
    killed as well when this process stops on an exception (see :func:`exit_on_sigterm`).
    """
    started = time.perf_counter()
    lines: queue.Queue[str | None] = queue.Queue()
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True
        )

        def read() -> None:
            for line in process.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        records, text, timed_out = [], [], False
        try:
            while True:
                try:
                    line = lines.get(timeout=max(0.0, started + budget_s - time.perf_counter()))
                except queue.Empty:
                    timed_out = True
                    break
                if line is None:
                    break
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if isinstance(record, dict):
                    records.append(record)
                else:
                    text.append(line)
        finally:  # past the budget, or this process stopped (a signal): the child's group goes too
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        errors.seek(0)
        output = "".join(text) + errors.read()
    status = "timed out" if timed_out else ("ok" if process.returncode == 0 else "failed")
    return ChildRun(status, time.perf_counter() - started, records, output[-4000:])
