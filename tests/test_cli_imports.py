"""``geofm --help`` and config errors answer without importing the deep-learning stack.

Each case runs the command line in a fresh interpreter and lists which heavy packages it imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[1]
HEAVY = ("torch", "timm", "deepspeed", "flwr", "rasterio", "torchgeo")
PROBE = f"""
import json, sys
from geofm.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""
PRETRAIN = "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml"
FINETUNE = "configs/finetune/demo_segmentation__swin_micro.yaml"
FEDERATED = "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml"


def _probe(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return {**json.loads(done.stdout.splitlines()[-1]), "stderr": done.stderr}


@pytest.mark.parametrize(
    "args",
    [["--help"], ["pretrain", "--help"], ["fed", "simulate", "--help"], ["finetune", "--help"], ["bench", "--help"]],
)
def test_help_imports_no_heavy_package(args):
    result = _probe(args)
    assert result["code"] == 0 and result["heavy"] == []


@pytest.mark.parametrize(
    "args",
    [
        ["pretrain", "--config", PRETRAIN, "train.epoch=3"],
        ["pretrain", "--config", PRETRAIN, "task_options.masking.mask_ratio=2"],
        ["pretrain", "--config", PRETRAIN, "task_options.masking.mask_patch_size=48"],
        ["fed", "simulate", "--config", FEDERATED, "task_options.masking.mask_patch_size=48"],
        ["finetune", "--config", FINETUNE, "train.micro_batch_size=0"],
        ["fed", "simulate", "--config", FEDERATED, "federation.rounds=0"],
        ["pretrain", "--config", "missing.yaml"],
        ["eval", f"checkpoint={REPO}/runs/none", "train.micro_batch_size=0", "--config", FINETUNE],
        ["eval", f"checkpoint={REPO}/runs/none", "split=dev"],
    ],
)
def test_a_config_error_imports_no_heavy_package(args):
    result = _probe(args)
    assert result["code"] == 2 and result["stderr"].startswith("geofm: error: ")
    assert result["heavy"] == []


def test_architecture_checks_still_run_once_the_keys_are_valid():
    result = _probe(["pretrain", "--config", PRETRAIN, "model.arch=swin_nonexistent"])
    assert result["code"] == 2 and "model: unknown backbone architecture 'swin_nonexistent'" in result["stderr"]
