"""The toy federated program, registered by name in this process, in Ray workers and in Flower's processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from federation.runtime.contract import PROGRAMS, config_entry

# the one-shot programs run on the finetuning setups
from tests.finetune.conftest import class_folders, ensemble_tree, feddiff_tree, one_shot_tree, oscar_tree, rgb_export  # noqa: F401

HERE = Path(__file__).parent
REPO = HERE.parents[1]
TOY = "toy"
# The toy is registered as an installed plug-in is: plugin/ holds a distribution's metadata with an
# entry point in the group geofm.federated_programs, found on sys.path here, in Ray workers (they get
# this process's sys.path) and in Flower's processes (they get TOY_PYTHONPATH). This process also
# registers it in code, as a script would.
PLUGIN = HERE / "plugin"
sys.path[:0] = [str(HERE), str(PLUGIN)]
PROGRAMS.register(TOY, "toy_federated_program:PROGRAM")
TOY_PYTHONPATH = f"{REPO}:{HERE}:{PLUGIN}"


@pytest.fixture
def toy_run_config(tmp_path):
    """A run config of the toy program writing its records to ``tmp_path/records.jsonl``, with more config values."""

    def make(config: dict | None = None, **entries) -> dict:
        return {
            "program": TOY,
            "config": config_entry({"out": str(tmp_path / "records.jsonl"), **(config or {})}),
            **entries,
        }

    return make


@pytest.fixture
def toy_pythonpath() -> str:
    """PYTHONPATH for Flower's processes: this checkout first, then the toy program's folder."""
    return TOY_PYTHONPATH


DEMO = REPO / "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml"


def geofm_stderr_lines(stderr: str) -> list[str]:
    """The lines of a ``geofm fed simulate`` stderr that are geofm's: Ray's INFO lines and, on a loaded
    machine, abseil's mutex tracing from Ray's gRPC left out."""
    return [line for line in stderr.splitlines() if " INFO " not in line and "[mutex.cc" not in line]


def fedsense_options(**changes) -> dict:
    """The FedSense options of the demo config :func:`fed_tree` starts from, with ``changes``."""
    return {**yaml.safe_load(DEMO.read_text())["algorithm"]["options"], **changes}


TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}
MIM_OPTIONS = ("masking", "teacher")
"""Sections the fixtures' keyword arguments change inside ``task_options`` (masked image modelling's)."""


@pytest.fixture
def fed_tree(archive, teacher_file, tmp_path):
    """The federated demo config at 32 px with a tiny Swin, 2 local steps, 3 rounds, pointing at this test's files."""

    def make(name: str = "fed", **sections) -> dict:
        tree = yaml.safe_load(DEMO.read_text())
        tree["run"] = {"output_dir": str(tmp_path / name), "seed": 0}
        tree["model"].update(img_size=32, timm_kwargs=TINY_SWIN)
        tree["task_options"]["masking"]["mask_patch_size"] = 8
        tree["task_options"]["teacher"].update(checkpoint=str(teacher_file), img_size=32, timm_kwargs=TINY_SWIN)
        for source in tree["data"]["sources"]:
            source["root"] = str(archive[source["name"]])
        tree["train"].update(micro_batch_size=4, local_epochs=None, local_steps=2)
        tree["federation"]["rounds"] = 3
        for key, values in sections.items():
            holder = tree["task_options"] if key in MIM_OPTIONS else tree
            holder[key] = None if values is None else {**(holder.get(key) or {}), **values}
        return tree

    return make
