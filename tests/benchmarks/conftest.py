"""The benchmarks' quick runs on the command line, each run once and checked by the test of its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]
KEYS = {"benchmark", "command", "created", "seconds", "machine", "libraries", "settings", "results", "targets", "notes"}


def run_quick(name: str, folder: Path, settings: list[str]) -> dict:
    """The JSON result of ``geofm bench NAME --quick SETTINGS`` run in ``folder`` as its own process, after
    checking what every benchmark's result holds and that the table for people was printed."""
    out = folder / f"{name}.json"
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cli", name, "--quick", "--out", str(out), *settings],
        check=False,
        capture_output=True,
        text=True,
        cwd=folder,
        env=env,
    )
    assert proc.returncode == 0, f"geofm bench {name} --quick failed:\n{proc.stderr[-3000:]}"
    record = json.loads(out.read_text())
    assert set(record) == KEYS, f"unexpected top-level keys {sorted(set(record) ^ KEYS)}"
    assert record["benchmark"] == name and record["results"], "the result holds no figures"
    assert record["libraries"]["torch"] and record["machine"]["usable_cpus"] >= 1
    assert all({"name", "value", "goal", "met"} <= set(t) for t in record["targets"])
    assert "wrote" in proc.stdout, "the table for people was not printed"
    return record
