"""A tiny pretraining setup on a generated multi-sensor archive, small enough for CI's CPUs."""

from __future__ import annotations

import copy
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[2]
DEMO_GFM = REPO / "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml"
TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}
MIM_OPTIONS = ("masking", "teacher")
"""Sections ``tiny_tree``'s keyword arguments change inside ``task_options`` (masked image modelling's)."""


@pytest.fixture
def tiny_tree(archive, teacher_file, tmp_path):
    """The demo GFM config shrunk to 32 px, 2 epochs of 6 steps, pointing at this test's files; keyword
    arguments merge into its sections (``masking`` and ``teacher``: into ``task_options``; None: null)."""

    def make(name: str = "run", **sections) -> dict:
        tree = yaml.safe_load(DEMO_GFM.read_text())
        tree["run"] = {"output_dir": str(tmp_path / name), "log_every": 1, "checkpoint_every": 4, "progress": False}
        tree["model"].update(img_size=32, timm_kwargs=TINY_SWIN)
        tree["task_options"]["masking"]["mask_patch_size"] = 8
        tree["task_options"]["teacher"].update(checkpoint=str(teacher_file), img_size=32, timm_kwargs=TINY_SWIN)
        tree["data"]["num_workers"] = 0
        tree["data"]["samples_per_epoch"] = 24
        for source in tree["data"]["sources"]:
            source["root"] = str(archive[source["name"]])
        tree["train"].update(epochs=2, micro_batch_size=4, warmup_epochs=0.5)
        for key, values in sections.items():
            holder = tree["task_options"] if key in MIM_OPTIONS else tree
            holder[key] = None if values is None else {**copy.deepcopy(holder.get(key) or {}), **values}
        return tree

    return make


@pytest.fixture
def write_config():
    def write(tree: dict, path: Path) -> Path:
        path.write_text(yaml.safe_dump(tree))
        return path

    return write


def _wait_for(proc: subprocess.Popen, condition: Callable[[], bool], what: str) -> None:
    while not condition():
        if proc.poll() is not None:
            stderr = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"the process exited with {proc.returncode} before {what}:\n{stderr[-3000:]}")
        time.sleep(0.05)


@pytest.fixture
def wait_for():
    """Poll until ``condition()`` holds; fail (with the process's stderr) if the process ends first.

    There is no deadline: a loaded machine may take long, and only the event matters.
    """
    return _wait_for


@pytest.fixture
def killed_then_resumed(write_config, child_env, wait_for, tmp_path):
    """Run ``geofm pretrain`` on ``tree`` in a child process, SIGKILL it once its first checkpoint is
    written, resume it for ``more`` steps and check that the resumed run continued from that
    checkpoint and logged every step once; returns the step the checkpoint held."""
    import json
    import signal
    import sys

    def run(tree: dict, more: int) -> int:
        config = write_config(tree, tmp_path / "killed.yaml")
        cmd = [sys.executable, "-m", "geofm.cli", "pretrain", "--config", str(config)]
        proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        run_dir = Path(tree["run"]["output_dir"])
        last = run_dir / "checkpoints/last"
        wait_for(proc, last.exists, "writing its first checkpoint")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, "killed, not finished"
        reached = int(last.resolve().name.split("_")[1])
        done = subprocess.run(
            [*cmd, f"run.stop_after_steps={more}"], env=child_env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resumed from" in done.stderr and f"at step {reached}" in done.stderr
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records if "loss" in r]
        assert steps == list(range(1, reached + more + 1)), "the resumed run logs every step once"
        return reached

    return run
