"""FedDC in federated finetuning: drift and correction states on both sides through 1-bit uplinks, and a
stopped run that resumes to the same result (client states on disk, server state in the checkpoint)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.finetune.test_federated import _federated, _rounds, _run

FEDDC = {"name": "feddc", "options": {"alpha": 0.01}, "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": True}}


def test_feddc_keeps_its_states_through_1bit_uplinks_and_resumes_to_the_same_result(
    class_folders, finetune_tree, tmp_path
):
    def tree(name: str, **federation) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {**_federated(base, rounds=3, **federation), "algorithm": FEDDC}

    straight = _run(tree("straight"))
    rounds = _rounds(straight)
    assert [r["clients"] for r in rounds] == [["client00", "client01"]] * 3
    assert all(r["drift_norm"] > 0 and r["control_norm"] > 0 for r in rounds)
    with np.load(straight / "clients/client01/state_round_000003.npz") as state:
        assert {"drift", "control", "feedback.update.error", "feedback.delta_c.error"} <= set(state.files)
        assert np.abs(state["drift"]).sum() > 0 and np.abs(state["feedback.delta_c.error"]).sum() > 0

    _run(tree("resumed", stop_after_rounds=1))
    assert [r["round"] for r in _rounds(tmp_path / "resumed")] == [1]
    resumed = _run(tree("resumed"))
    for a, b in zip(rounds, _rounds(resumed), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["val"] == pytest.approx(b["val"], rel=1e-5)
        assert a["drift_norm"] == pytest.approx(b["drift_norm"], rel=1e-5), f"round {a['round']}"
        assert a["control_norm"] == pytest.approx(b["control_norm"], rel=1e-5), f"round {a['round']}"
    ea, eb = (json.loads((run / "eval.json").read_text()) for run in (straight, resumed))
    assert ea["metrics"] == pytest.approx(eb["metrics"], rel=1e-5) and ea["selected"] == eb["selected"]
    assert ea["federation"]["algorithm"] == "feddc"
