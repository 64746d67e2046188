"""MOON in federated finetuning: classification and segmentation on a tiny Swin, a 1-bit uplink, resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.torch import load_file

from tests.finetune.test_federated import _federated, _resumes_like_unbroken, _rounds, _run

pytestmark = pytest.mark.slow

MOON_1BIT = {"name": "moon", "uplink": {"bits": 1, "error_feedback": True}}


def test_moon_finetunes_a_classifier_its_first_round_as_fedavg(class_folders, finetune_tree, tmp_path):
    """Round 1 has no previous models: l_con is log 2 with no gradient and the round is FedAvg's; round 2
    contrasts each client's backbone with its own round-1 backbone, kept in its state."""

    def tree(name: str, algorithm: str) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {**_federated(base), "algorithm": {"name": algorithm}}

    moon, fedavg = _rounds(_run(tree("moon", "moon"))), _rounds(_run(tree("fedavg", "fedavg")))
    assert [r["round"] for r in moon] == [1, 2]
    assert moon[0]["loss"] == fedavg[0]["loss"] and moon[0]["val"] == fedavg[0]["val"]
    assert moon[1]["loss"] != fedavg[1]["loss"]
    assert moon[0]["contrastive_loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert moon[1]["contrastive_loss"] != pytest.approx(math.log(2), rel=1e-5)
    weights = load_file(tmp_path / "moon" / "best/model.safetensors")
    backbone = sum(
        v.numel() for k, v in weights.items() if k.startswith("backbone.") and "relative_position_index" not in k
    )
    with np.load(tmp_path / "moon/clients/client00/state_round_000002.npz") as state:
        assert state["moon.previous"].shape == (backbone,)


def test_moon_finetunes_a_segmenter(random_datasets, finetune_tree, tmp_path):
    """A dense head reads the backbone through forward_intermediates: the hooks see its last stage all the same."""
    run_dir = _run({**_federated(finetune_tree("segmentation", tmp_path / "seg")), "algorithm": {"name": "moon"}})
    rounds = _rounds(run_dir)
    metric = json.loads((run_dir / "eval.json").read_text())["primary_metric"]
    assert [r["round"] for r in rounds] == [1, 2] and all(metric in r["val"] for r in rounds)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["contrastive_loss"]) for r in rounds)


def test_a_stopped_moon_finetune_with_1bit_uploads_resumes_to_the_same_result(class_folders, finetune_tree, tmp_path):
    """The clients' previous backbones and residuals come back from their state folders after the stop."""

    def tree(name: str, **federation) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {**_federated(base, **federation), "algorithm": MOON_1BIT}

    _, a, b = _resumes_like_unbroken(tree)
    assert [r["round"] for r in b] == [1, 2]
    for ra, rb in zip(a, b, strict=True):
        assert ra["contrastive_loss"] == pytest.approx(rb["contrastive_loss"], rel=1e-5)
    assert a[0]["uplink_bytes"] < a[0]["downlink_bytes"] / 16, "1-bit uploads"
