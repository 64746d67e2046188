"""pFedLA in federated finetuning: it trains across clients, validates the clients' data-weighted mean model
each round, and a run stopped after a round resumes to the same result (client models and hypernetworks
are server state)."""

from __future__ import annotations

import json

import pytest

from geofm.config.federated import read_federated_config
from geofm.errors import ConfigError
from tests.finetune.test_federated import _federated, _rounds, _run

pytestmark = pytest.mark.slow


def _tree(finetune_tree, class_folders, output_dir, **federation) -> dict:
    base = finetune_tree("classification", output_dir, data={"root": str(class_folders)})
    options = {"embedding_dim": 8, "hidden_dim": 8, "hn_lr": 0.05}
    return {**_federated(base, **{"rounds": 3, **federation}), "algorithm": {"name": "pfedla", "options": options}}


def test_pfedla_finetunes_across_clients_and_resumes_to_the_same_result(class_folders, finetune_tree, tmp_path):
    straight = _run(_tree(finetune_tree, class_folders, tmp_path / "straight"))
    rounds = _rounds(straight)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["clients"] == ["client00", "client01"] and "accuracy" in r["val"] for r in rounds)
    assert all(0 < r["self_weight"] < 1 and r["layers"] == 12 for r in rounds)  # a tiny Swin's blocks
    evaluation = json.loads((straight / "eval.json").read_text())
    assert evaluation["federation"]["algorithm"] == "pfedla" and evaluation["federation"]["rounds"] == 3

    _run(_tree(finetune_tree, class_folders, tmp_path / "resumed", stop_after_rounds=1))
    assert [r["round"] for r in _rounds(tmp_path / "resumed")] == [1]
    resumed = _run(_tree(finetune_tree, class_folders, tmp_path / "resumed"))
    b = _rounds(resumed)
    assert [r["round"] for r in b] == [1, 2, 3]
    for ra, rb in zip(rounds, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5) and ra["val"] == pytest.approx(rb["val"], rel=1e-5)
        assert ra["self_weight"] == pytest.approx(rb["self_weight"], rel=1e-5)
    ea, eb = (json.loads((run / "eval.json").read_text()) for run in (straight, resumed))
    assert ea["metrics"] == pytest.approx(eb["metrics"], rel=1e-5) and ea["selected"] == eb["selected"]


def test_pfedla_runs_under_a_1bit_uplink_with_error_feedback(class_folders, finetune_tree, tmp_path):
    tree = _tree(finetune_tree, class_folders, tmp_path / "onebit", rounds=2)
    tree["algorithm"]["uplink"] = {"bits": 1, "error_feedback": True}
    rounds = _rounds(_run(tree))
    assert [r["round"] for r in rounds] == [1, 2] and all(r["clients"] == ["client00", "client01"] for r in rounds)
    assert rounds[0]["uplink_bytes"] * 20 < rounds[0]["downlink_bytes"]


def test_a_pfedla_config_with_a_compressed_downlink_is_refused(class_folders, finetune_tree, tmp_path):
    tree = _tree(finetune_tree, class_folders, tmp_path / "x")
    tree["algorithm"]["downlink"] = {"bits": 8}
    with pytest.raises(ConfigError, match=r"algorithm\.downlink\.bits: pfedla sends each client its own"):
        read_federated_config(tree)
