"""FedDC in federated finetuning: drift and correction states on both sides through 1-bit uplinks, and a
stopped run that resumes to the same result (client states on disk, server state in the checkpoint)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.finetune.test_federated import _federated, _resumes_like_unbroken

pytestmark = pytest.mark.slow

FEDDC = {"name": "feddc", "options": {"alpha": 0.01}, "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": True}}


def test_feddc_keeps_its_states_through_1bit_uplinks_and_resumes_to_the_same_result(
    class_folders, finetune_tree, tmp_path
):
    def tree(name: str, **federation) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {**_federated(base, rounds=3, **federation), "algorithm": FEDDC}

    straight, rounds, resumed = _resumes_like_unbroken(tree)
    assert [r["clients"] for r in rounds] == [["client00", "client01"]] * 3
    assert all(r["drift_norm"] > 0 and r["control_norm"] > 0 for r in rounds)
    with np.load(straight / "clients/client01/state_round_000003.npz") as state:
        assert {"drift", "control", "feedback.update.error", "feedback.delta_c.error"} <= set(state.files)
        assert np.abs(state["drift"]).sum() > 0 and np.abs(state["feedback.delta_c.error"]).sum() > 0

    for a, b in zip(rounds, resumed, strict=True):
        assert a["drift_norm"] == pytest.approx(b["drift_norm"], rel=1e-5), f"round {a['round']}"
        assert a["control_norm"] == pytest.approx(b["control_norm"], rel=1e-5), f"round {a['round']}"
    assert json.loads((straight / "eval.json").read_text())["federation"]["algorithm"] == "feddc"
