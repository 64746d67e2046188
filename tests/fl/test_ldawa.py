"""L-DAWA against the paper's equations worked by hand, and against the official aggregation code."""

import numpy as np
import pytest
import torch
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.ldawa import layer_cosines, layer_weighted
from geofm.fl.communication.codec import Codec
from geofm.fl.parameter_vectors import ParameterLayout


class TwoLayers(nn.Module):
    def __init__(self, sizes=(2, 1)) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(sizes[0]))
        self.bias = nn.Parameter(torch.zeros(sizes[1]))


def _server(sizes=(2, 1)):
    return build_algorithm(AlgorithmConfig(name="ldawa"), ParameterLayout.of(TwoLayers(sizes)), num_clients=2)


def _uploads(updates, examples):
    encode = Codec(bits=32).encode
    return [
        ClientUpload(str(i), {"update": encode(u)}, n) for i, (u, n) in enumerate(zip(updates, examples, strict=True))
    ]


def test_the_layer_cosines_are_the_angular_divergence_capped_at_1_and_1_for_a_zero_layer():
    # layer 1: cos([1, 0], [1, 1]) = 1/sqrt(2); layer 2: cos([3, 4], [3, 4]) = 1; layer 3: a zero layer
    cosines = layer_cosines(torch.tensor([1.0, 0.0, 3.0, 4.0, 0.0]), torch.tensor([1.0, 1.0, 3.0, 4.0, 5.0]), [2, 2, 1])
    assert cosines.tolist() == pytest.approx([2**-0.5, 1.0, 1.0])
    assert layer_weighted(torch.tensor([2.0, 2.0, 1.0]), torch.tensor([0.5, -1.0]), [2, 1]).tolist() == [1.0, 1.0, -1.0]


def test_one_round_gives_the_papers_numbers():
    # Theta = [1, 0 | 2]. Client a: w = [1, 1 | 2], deltas 1/sqrt(2) and 1. Client b: w = [-1, 0 | 3], deltas -1 and 1.
    # Equal examples: Theta' = ([0.7071, 0.7071 | 2] + [1, 0 | 3]) / 2 = [0.8536, 0.3536 | 2.5]
    server = _server()
    updates = [torch.tensor([0.0, 1.0, 0.0]), torch.tensor([-2.0, 0.0, 1.0])]
    outcome = server.server_update(torch.tensor([1.0, 0.0, 2.0]), server.aggregate(_uploads(updates, [4, 4])))
    half = 2**-0.5 / 2
    assert outcome.model.tolist() == pytest.approx([half + 0.5, half, 2.5])
    assert outcome.metrics["layer_cosine"] == pytest.approx(((2**-0.5 + 1) / 2 + 0.0) / 2)


def test_clients_weigh_by_their_examples():
    server = _server()
    updates = [torch.tensor([0.0, 1.0, 0.0]), torch.tensor([-2.0, 0.0, 1.0])]
    outcome = server.server_update(torch.tensor([1.0, 0.0, 2.0]), server.aggregate(_uploads(updates, [1, 3])))
    assert outcome.model.tolist() == pytest.approx([0.25 * 2**-0.5 + 0.75, 0.25 * 2**-0.5, 0.25 * 2 + 0.75 * 3])


def test_it_agrees_with_the_official_aggregation_for_equal_clients():
    def official(
        results, w_g
    ):  # L-DAWA-Agg.py's my_aggregate, re-expressed: each layer x * min(cos(x, y), 1), then 1/K
        scaled = []
        for weights in results:
            layers = []
            for x, y in zip(weights, w_g, strict=True):
                v = min((x * y).sum() / (np.linalg.norm(x) * np.linalg.norm(y)), 1.0)
                layers.append(x * v)
            scaled.append(layers)
        return [sum(layer) / len(results) for layer in zip(*scaled, strict=True)]

    rng = np.random.default_rng(0)
    sizes = (6, 3)
    global_layers = [rng.normal(size=s).astype(np.float32) for s in sizes]
    clients = [[g + rng.normal(size=g.shape).astype(np.float32) for g in global_layers] for _ in range(3)]
    expected = np.concatenate(official(clients, global_layers))
    server = _server(sizes)
    model = torch.from_numpy(np.concatenate(global_layers))
    updates = [torch.from_numpy(np.concatenate(c)) - model for c in clients]
    outcome = server.server_update(model, server.aggregate(_uploads(updates, [5, 5, 5])))
    assert np.allclose(outcome.model.numpy(), expected, atol=1e-5)


def test_it_takes_no_aggregator_or_server_optimizer():
    with pytest.raises(ConfigError, match="server_optimizer: ldawa weights each client layer"):
        build_algorithm(AlgorithmConfig(name="ldawa", server_optimizer={"name": "fedadam", "lr": 0.1}), 3)
