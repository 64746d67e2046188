"""SWA and WiMA in federated finetuning: the server validates and keeps the average of its global models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from finetune.federated_task import FederatedFinetuning
from geofm.checkpoints.io import DEEPSPEED_MODEL_STATES
from tests.finetune.test_federated import _federated, _resumes_like_unbroken, _rounds, _run

pytestmark = pytest.mark.slow

# SWA from round 1, a cycle per round (every model averaged) at half FedAvg's step; WiMA over the last 2 rounds.
SWA = {"name": "swa", "options": {"start": 1, "cycle": 1, "lr_max": 1.0, "lr_min": 0.5}}
WIMA = {"name": "wima", "options": {"window": 2, "blocks": 1}}


def _modules(run_dir) -> list[dict[str, torch.Tensor]]:
    """The training global model after each round, as the server checkpointed it."""
    paths = sorted((run_dir / "checkpoints").glob(f"round_*/{DEEPSPEED_MODEL_STATES}"))
    return [torch.load(path, weights_only=True)["module"] for path in paths]


@pytest.mark.parametrize("algorithm", [SWA, WIMA], ids=["swa", "wima"])
def test_the_server_validates_and_keeps_the_average_of_its_models(
    algorithm, class_folders, finetune_tree, tmp_path, monkeypatch
):
    validated: list[dict[str, torch.Tensor]] = []
    evaluate_round = FederatedFinetuning.evaluate_round

    def recording(self, model, rnd):
        validated.append({k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad})
        return evaluate_round(self, model, rnd)

    monkeypatch.setattr(FederatedFinetuning, "evaluate_round", recording)
    base = finetune_tree("classification", tmp_path / "run", data={"root": str(class_folders)})
    run_dir = _run({**_federated(base), "algorithm": algorithm})
    rounds, modules = _rounds(run_dir), _modules(run_dir)
    assert len(validated) == len(modules) == 2
    # Round 1 validates x1; round 2 the mean (x1 + x2) / 2: SWA averaged both cycles' models, WiMA's window
    # holds both rounds. The clients trained on from x2, not from the average.
    for name, value in validated[1].items():
        torch.testing.assert_close(value, (modules[0][name] + modules[1][name]) / 2)
        torch.testing.assert_close(validated[0][name], modules[0][name])
    assert any(not torch.equal(v, modules[1][k]) for k, v in validated[1].items())
    if algorithm is SWA:
        assert [(r["server_lr"], r["swa_models"]) for r in rounds] == [(0.5, 1.0), (0.5, 2.0)]
    else:
        assert [r["wima_models"] for r in rounds] == [1.0, 2.0]
    kept = load_file(run_dir / "best/model.safetensors")
    best = validated[json.loads((run_dir / "best/best.json").read_text())["round"] - 1]
    assert kept.keys() >= best.keys() and all(torch.equal(kept[k], v) for k, v in best.items())


def test_a_stopped_wima_finetune_resumes_to_the_same_result(class_folders, finetune_tree, tmp_path):
    """Averaging is on before and after the stop; round 3 reads the window's block sums kept by round 2's
    checkpoint (the window of 2 rounds is one block: round 3 is the partial-block rule)."""

    def tree(name: str, **federation) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {**_federated(base, rounds=3, **federation), "algorithm": WIMA}

    straight, _, b = _resumes_like_unbroken(tree)
    assert [r["wima_models"] for r in b] == [1.0, 2.0, 2.0]
    states = [
        torch.load(run / f"checkpoints/round_0000003/{DEEPSPEED_MODEL_STATES}", weights_only=True)
        for run in (straight, tmp_path / "resumed")
    ]
    for key, value in states[0]["server"]["algorithm"]["state"].items():
        torch.testing.assert_close(value, states[1]["server"]["algorithm"]["state"][key])
