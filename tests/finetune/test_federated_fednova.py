"""FedNova in federated finetuning: clients with shares of different sizes run different numbers of local
steps, the server normalises by the counts they report, and a stopped run resumes to the same result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.finetune.test_federated import _federated, _rounds, _run

pytestmark = pytest.mark.slow

ONE_BIT = {"bits": 1, "bucket_size": 512, "error_feedback": True}


def _uneven_tree(finetune_tree, class_folders: Path, tmp_path: Path, name: str, **federation) -> dict:
    """Two clients by site: 'big' holds the field and forest scenes (16), 'small' the water scenes (8);
    one local epoch at micro-batch 4 is then 4 steps for one and 2 for the other."""
    metadata = tmp_path / "sites.csv"
    rows = [
        f"train/{c}/{i}.tif,{'small' if c == 'water' else 'big'}"
        for c in ("field", "forest", "water")
        for i in range(8)
    ]
    metadata.write_text("sample,site\n" + "\n".join(rows) + "\n")
    base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
    scenario = {"partition": "by_field", "partition_field": "site", "metadata": str(metadata)}
    tree = _federated(base, rounds=3, **scenario, **federation)
    tree["train"] = {**tree["train"], "local_epochs": 1.0, "local_steps": None}
    return {**tree, "algorithm": {"name": "fednova", "uplink": ONE_BIT}}


def test_fednova_normalises_uneven_step_counts_and_resumes_to_the_same_result(class_folders, finetune_tree, tmp_path):
    straight = _run(_uneven_tree(finetune_tree, class_folders, tmp_path, "straight"))
    rounds = _rounds(straight)
    assert [r["round"] for r in rounds] == [1, 2, 3] and all(len(r["clients"]) == 2 for r in rounds)
    # tau = 4 and 2 steps, p = 16/24 and 8/24: tau_eff = (2 * 4 + 1 * 2) / 3 = 10/3, read from the clients' reports.
    assert all(r["tau_eff"] == pytest.approx(10 / 3) for r in rounds)

    _run(_uneven_tree(finetune_tree, class_folders, tmp_path, "resumed", stop_after_rounds=1))
    assert [r["round"] for r in _rounds(tmp_path / "resumed")] == [1]
    resumed = _run(_uneven_tree(finetune_tree, class_folders, tmp_path, "resumed"))
    for a, b in zip(rounds, _rounds(resumed), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["val"] == pytest.approx(b["val"], rel=1e-5)
        assert a["tau_eff"] == b["tau_eff"]
    ea, eb = (json.loads((run / "eval.json").read_text()) for run in (straight, resumed))
    assert ea["metrics"] == pytest.approx(eb["metrics"], rel=1e-5) and ea["selected"] == eb["selected"]
    assert ea["federation"]["algorithm"] == "fednova"
