"""FedBN in federated finetuning: each client keeps its own normalisation layers and batch-norm statistics,
the server validates and exports their mean, and a stopped run resumes to the same result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import geofm.fl.client_round
from geofm.checkpoints.io import DEEPSPEED_MODEL_STATES
from geofm.config.federated import read_federated_config
from geofm.fl.parameter_vectors import ParameterLayout
from geofm.tasks import federated_task
from tests.finetune.test_federated import _federated, _resumes_like_unbroken, _rounds, _run

pytestmark = pytest.mark.slow


def _fedbn(tree: dict, layers: str = "all", **federation) -> dict:
    return {**_federated(tree, **federation), "algorithm": {"name": "fedbn", "options": {"layers": layers}}}


def _client_state(run_dir: Path, client: str, rnd: int) -> dict[str, np.ndarray]:
    with np.load(run_dir / f"clients/{client}/state_round_{rnd:06d}.npz") as state:
        return {key: state[key] for key in state.files}


def _weights(run_dir: Path) -> dict[str, float]:
    """Each client's FedAvg weight p_k: its share of the training samples."""
    counts = {c: len(v["samples"]) for c, v in json.loads((run_dir / "partition.json").read_text())["clients"].items()}
    return {c: n / sum(counts.values()) for c, n in counts.items()}


def _server_model(run_dir: Path) -> dict[str, torch.Tensor]:
    """The module of the server's last checkpoint: the model it validated in the last round."""
    last = sorted((run_dir / "checkpoints").glob(f"*/{DEEPSPEED_MODEL_STATES}"))[-1]
    return torch.load(last, map_location="cpu", weights_only=False)["module"]


CLIENTS = ("client00", "client01")


def test_classification_keeps_each_clients_layer_norms_and_validates_their_mean(class_folders, finetune_tree, tmp_path):
    tree = _fedbn(finetune_tree("classification", tmp_path / "fed", data={"root": str(class_folders)}))
    run_dir = _run(tree)
    rounds = _rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2] and all("accuracy" in r["val"] for r in rounds)
    assert json.loads((run_dir / "eval.json").read_text())["federation"]["algorithm"] == "fedbn"
    own = {c: _client_state(run_dir, c, 2)["local"] for c in CLIENTS}
    assert not np.allclose(own["client00"], own["client01"]), "each client trained its own norms"
    # The server's model holds the clients' round-2 norms averaged by weight (a 32-bit uplink: exact up to
    # float sums); the norms are the Swin's LayerNorms, in the order of the model's parameters.
    layout = ParameterLayout.of(federated_task(read_federated_config(tree)).build_model(initial_weights=False))
    assert {kind for _, kind in layout.norms} == {"layernorm"}
    weights, module = _weights(run_dir), _server_model(run_dir)
    served = torch.cat([module[name].flatten() for name, _ in layout.norms]).numpy()
    assert served.size == own["client00"].size
    np.testing.assert_allclose(served, sum(weights[c] * own[c] for c in CLIENTS), rtol=1e-5, atol=1e-6)


def test_segmentation_clients_keep_their_batchnorm_statistics(random_datasets, finetune_tree, tmp_path, monkeypatch):
    loaded: list[np.ndarray] = []  # every vector of running statistics a client put into its model
    load = geofm.fl.client_round.load_running_statistics

    def record(model, vector):
        loaded.append(np.array(vector))
        load(model, vector)

    monkeypatch.setattr(geofm.fl.client_round, "load_running_statistics", record)
    run_dir = _run(_fedbn(finetune_tree("segmentation", tmp_path / "seg"), layers="batchnorm"))
    assert [r["round"] for r in _rounds(run_dir)] == [1, 2]
    first = {c: _client_state(run_dir, c, 1)["local_statistics"] for c in CLIENTS}
    second = {c: _client_state(run_dir, c, 2)["local_statistics"] for c in CLIENTS}
    start = loaded[0]
    assert not np.allclose(first["client00"], first["client01"]), "each client's own statistics"
    # Round 1: both start from the server's start statistics. Round 2: each gets the start ones again and
    # puts its own round-1 statistics over them; the server's round-1 average never reaches a client.
    assert len(loaded) == 6 and all(np.array_equal(v, start) for v in (loaded[1], loaded[2], loaded[4]))
    assert {loaded[3].tobytes(), loaded[5].tobytes()} == {first[c].tobytes() for c in CLIENTS}
    weights = _weights(run_dir)
    average = sum(weights[c] * first[c] for c in CLIENTS)
    assert not any(np.allclose(v, average) for v in loaded)
    # The server validates and exports the clients' round-2 statistics averaged by weight.
    module = _server_model(run_dir)
    served = torch.cat([module[k].flatten() for k in module if k.endswith(("running_mean", "running_var"))]).numpy()
    np.testing.assert_allclose(served, sum(weights[c] * second[c] for c in CLIENTS), rtol=1e-5, atol=1e-6)


def test_a_stopped_fedbn_finetune_resumes_to_the_same_result(random_datasets, finetune_tree, tmp_path):
    """Each client's norms and statistics come back from its state on disk; the server's from its checkpoint."""

    def tree(name: str, **federation) -> dict:
        return _fedbn(finetune_tree("segmentation", tmp_path / name), rounds=2, **federation)

    _, _, resumed = _resumes_like_unbroken(tree)
    assert [r["round"] for r in resumed] == [1, 2]
