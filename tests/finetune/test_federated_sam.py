"""SAM-family algorithms in federated finetuning: FedSAM, FedASAM and FedGloSS train a classifier on a tiny
Swin with AdamW on the engine, and a stopped FedSAM run resumes to the same result."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.finetune.test_federated import _federated, _resumes_like_unbroken, _rounds, _run

pytestmark = pytest.mark.slow


def test_sam_family_algorithms_finetune_a_classifier(class_folders, finetune_tree, tmp_path):
    """SAM steps move the local losses off FedAvg's; FedGloSS (2 rounds: its server ascent starts in round 2)
    keeps each client's dual."""

    def rounds(algorithm: dict, count: int) -> list[dict]:
        base = finetune_tree("classification", tmp_path / algorithm["name"], data={"root": str(class_folders)})
        return _rounds(_run({**_federated(base, rounds=count), "algorithm": algorithm}))

    fedavg = rounds({"name": "fedavg"}, 1)
    for algorithm, count in (({"name": "fedsam"}, 1), ({"name": "fedasam"}, 1), ({"name": "fedgloss"}, 2)):
        run = rounds(algorithm, count)
        assert [r["round"] for r in run] == list(range(1, count + 1))
        assert all(math.isfinite(r["loss"]) and r["val"] for r in run)
        assert run[0]["loss"] != fedavg[0]["loss"], algorithm["name"]
    assert all(math.isfinite(r["sigma_norm"]) and r["sigma_norm"] > 0 for r in run)
    with np.load(tmp_path / "fedgloss/clients/client00/state_round_000002.npz") as state:
        assert np.isfinite(state["dual"]).all() and np.abs(state["dual"]).sum() > 0


def test_a_stopped_fedsam_finetune_resumes_to_the_same_result(class_folders, finetune_tree, tmp_path):
    def tree(name: str, **federation) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {**_federated(base, **federation), "algorithm": {"name": "fedsam", "sam": {"rho": 0.05}}}

    _, _, resumed = _resumes_like_unbroken(tree)
    assert [r["round"] for r in resumed] == [1, 2]
