"""``geofm bench fed-stop``: seconds from SIGTERM or SIGINT to the exit of ``geofm fed simulate``.

Each run starts ``geofm fed simulate`` on the federated demo config (the demo archive, unless
``archive`` names one, and a random teacher export in a temporary folder, ``--num-cpus`` cores, one torch thread per process), waits until
the first round is in ``rounds.jsonl``, sends the signal and times until the process has exited,
checking its exit code (2) and its one error line. The signals alternate from run to run. The
one-minute load average (``/proc/loadavg``) at each signal is kept beside the time: the machine is
measured as it is, loaded by whatever else runs on it.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Report, Target, child_env, repo_path
from benchmarks.startup import teacher_export

DEFAULTS: dict[str, Any] = {
    "config": "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml",
    "archive": None,  # a demo archive folder; None writes one to a temporary folder
    "signals": ["SIGTERM", "SIGINT"],
    "runs": 3,  # per signal
    "num_cpus": 2,
}
QUICK: dict[str, Any] = {"signals": ["SIGTERM"], "runs": 1}
GOAL_S = 5.0


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _stop_once(command: list[str], rounds: Path, sig: signal.Signals) -> dict[str, Any]:
    """Start ``command``, send ``sig`` once ``rounds`` holds a round, and time the exit."""
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(OMP_NUM_THREADS="1")
    )
    while not (rounds.exists() and rounds.read_text()):
        if process.poll() is not None:
            raise RuntimeError(
                f"{' '.join(command[:5])} ended before its first round:\n{process.stderr.read()[-3000:]}"
            )
        time.sleep(0.1)
    load = _load()
    sent = time.perf_counter()
    process.send_signal(sig)
    _, stderr = process.communicate()
    seconds = time.perf_counter() - sent
    # Ray's workers may print abseil's mutex tracing on a loaded machine, prefixed "(pid=...)": not geofm's.
    shown = [line for line in stderr.splitlines() if " INFO " not in line and not line.startswith("(")]
    expected = f"geofm: error: stopped by {sig.name} after round"
    if process.returncode != 2 or not (len(shown) == 1 and shown[0].startswith(expected)):
        raise RuntimeError(f"{sig.name}: exit code {process.returncode}, output:\n{stderr[-3000:]}")
    return {"signal": sig.name, "seconds": seconds, "load": load}


def run(settings: dict[str, Any]) -> Report:
    from geofm.config.federated import FederatedConfig
    from geofm.data.demo import make_demo_archive

    config = repo_path(settings["config"])
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        roots = make_demo_archive(Path(settings["archive"]) if settings["archive"] else folder / "demo", seed=0)
        cfg = FederatedConfig.from_file(config)
        overrides = [f"data.sources.{i}.root={roots[s.name]}" for i, s in enumerate(cfg.data.sources)]
        overrides += [
            f"task_options.teacher.checkpoint={teacher_export(folder / 'teacher', cfg)}",
            "federation.rounds=50",
        ]
        signals = [getattr(signal, name) for name in settings["signals"]]
        for r in range(settings["runs"]):
            for i, sig in enumerate(signals if r % 2 == 0 else signals[::-1]):
                out = folder / f"run{r}_{i}"
                command = [sys.executable, "-m", "geofm.cli", "fed", "simulate", "--config", str(config)]
                command += ["--num-cpus", str(settings["num_cpus"]), *overrides, f"run.output_dir={out}"]
                runs.append(_stop_once(command, out / "rounds.jsonl", sig))

    rows, targets = [], []
    for name in settings["signals"]:
        mine = [r for r in runs if r["signal"] == name]
        median = statistics.median(r["seconds"] for r in mine)
        loads = [r["load"] for r in mine]
        rows.append(
            {"signal": name, "median_s": median, "runs_s": [round(r["seconds"], 1) for r in mine], "load": loads}
        )
        note = f"load average {min(loads):.1f}-{max(loads):.1f}"
        targets.append(Target(f"seconds from {name} to the exit (median)", median, "<=", GOAL_S, " s", note))
    notes = [f"median of {settings['runs']} runs per signal, sent once round 1 is in rounds.jsonl"]
    return Report({"config": str(settings["config"]), "runs": runs, "by_signal": rows}, targets, rows, notes)
