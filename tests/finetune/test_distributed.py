"""Finetuning on two processes (ZeRO-2 over gloo on CPU): metrics gathered across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.evaluate import evaluate_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
SCRIPT = """
import sys
from finetune.run import finetune
from geofm.config.finetune import FinetuneConfig
finetune(FinetuneConfig.from_file(sys.argv[1]))
"""


def test_two_processes_train_and_evaluate_the_whole_test_split(task_tree, class_folders, tmp_path):
    tree = task_tree("classification", "two", data={"root": str(class_folders)}, train={"zero_stage": 2})
    config, script = tmp_path / "two.yaml", tmp_path / "run.py"
    config.write_text(yaml.safe_dump(tree))
    script.write_text(SCRIPT)
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        str(config),
    ]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"the two-process run failed:\n{done.stderr[-3000:]}"

    run_dir = Path(tree["run"]["output_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6], (
        "24 images at 2 x 4 per step: 3 steps an epoch"
    )
    progress = json.loads((run_dir / "checkpoints/last/progress.json").read_text())
    assert (progress["world_size"], progress["zero_stage"], progress["global_batch"]) == (2, 2, 8)
    two = json.loads((run_dir / "eval.json").read_text())["metrics"]
    one = evaluate_run(run_dir, "test")["metrics"]
    assert two == pytest.approx(one), "the 9 test images, split 5/4 over the processes, are all counted once"
