"""FedEMA against the paper's equations worked by hand, and against the official code's EMA form."""

import numpy as np
import pytest
import torch
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.fedema import PREVIOUS, SCALER, autoscaler, ema_decay, ema_start
from geofm.fl.algorithms.rounds import LocalRound
from geofm.fl.parameter_vectors import ParameterLayout


def _client(options=None):
    module = nn.Linear(2, 1, bias=False)
    return module, build_algorithm(AlgorithmConfig(name="fedema", options=options or {}), ParameterLayout.of(module))


def _holding(module, values):
    with torch.no_grad():
        module.weight.copy_(torch.tensor([values]))
    return module


def test_the_decay_the_autoscaler_and_the_start_are_the_papers():
    # mu = min(lambda ||W_g - W_k||, 1): 2 * 0.25 = 0.5, and 2 * 1 capped at 1
    assert ema_decay(2.0, 0.25) == 0.5 and ema_decay(2.0, 1.0) == 1.0
    # lambda_k = tau / ||W_g - W_k||: 0.7 / 2 = 0.35, so that its first mu is tau
    assert autoscaler(0.7, 2.0) == pytest.approx(0.35) and ema_decay(autoscaler(0.7, 2.0), 2.0) == pytest.approx(0.7)
    # mu W_k + (1 - mu) W_g: 0.25 [1, 3] + 0.75 [3, 1] = [2.5, 1.5]
    assert ema_start(torch.tensor([1.0, 3.0]), torch.tensor([3.0, 1.0]), 0.25).tolist() == [2.5, 1.5]


def test_a_client_starts_from_the_global_model_then_from_its_ema_with_the_autoscaled_decay():
    module, algorithm = _client({"tau": 0.7})
    state = {}
    algorithm.restore_local(_holding(module, [3.0, 4.0]), state)
    assert module.weight.tolist() == [[3.0, 4.0]] and algorithm.mu is None, "no model of its own yet"

    # round 2: W_k = [0, 0], W_g = [3, 4]: divergence 5, lambda = 0.7 / 5 = 0.14, mu = 0.7
    state[PREVIOUS] = np.zeros(2, dtype=np.float32)
    algorithm.restore_local(_holding(module, [3.0, 4.0]), state)
    assert float(state[SCALER][0]) == pytest.approx(0.14) and algorithm.mu == pytest.approx(0.7)
    assert module.weight.detach().flatten().tolist() == pytest.approx([0.9, 1.2])  # 0.3 [3, 4]

    # round 3: lambda stays 0.14; divergence 10 gives mu = min(1.4, 1) = 1, the client's own model
    algorithm.restore_local(_holding(module, [6.0, 8.0]), state)
    assert algorithm.mu == 1.0 and module.weight.detach().flatten().tolist() == [0.0, 0.0]


def test_a_fixed_scaler_replaces_the_autoscaler():
    module, algorithm = _client({"scaler": 0.1})
    state = {PREVIOUS: np.zeros(2, dtype=np.float32)}
    algorithm.restore_local(_holding(module, [3.0, 4.0]), state)  # mu = 0.1 * 5
    assert algorithm.mu == pytest.approx(0.5) and SCALER not in state


def test_the_client_keeps_what_it_trained_and_uploads_its_change_from_the_global_model():
    module, algorithm = _client()
    state = {PREVIOUS: np.array([1.0, 1.0], dtype=np.float32)}
    algorithm.restore_local(_holding(module, [2.0, 1.0]), state)  # divergence 1, mu = tau = 0.7
    local = LocalRound("a", {"model": torch.tensor([2.0, 1.0])}, [], [], state, 0.1)
    update = algorithm.finish_local(local, torch.tensor([5.0, 5.0]), steps=1)
    assert update.payloads["update"].tolist() == [3.0, 4.0] and update.metadata["ema_mu"] == pytest.approx(0.7)
    assert state[PREVIOUS].tolist() == [5.0, 5.0]


def test_the_start_agrees_with_the_official_codes_ema_of_the_global_model():
    # The official code (EasyFL's fedssl, DYNAMIC_EMA_ONLINE) moves the received global encoder towards the
    # client's last one: beta = 1 - min(1, lambda d), new = beta * global + (1 - beta) * local.
    generator = torch.Generator().manual_seed(0)
    previous, global_model = torch.randn(50, generator=generator), torch.randn(50, generator=generator)
    scaler = 0.3
    divergence = float(torch.linalg.vector_norm(global_model - previous))
    beta = 1.0 - min(1.0, scaler * divergence)
    official = beta * global_model + (1.0 - beta) * previous
    assert torch.allclose(ema_start(previous, global_model, ema_decay(scaler, divergence)), official, atol=1e-6)


def test_the_server_logs_the_clients_mean_decay():
    from geofm.fl.aggregation.uploads import ClientUpload
    from geofm.fl.communication.codec import Codec

    server = build_algorithm(AlgorithmConfig(name="fedema"), 1, num_clients=2)
    encode = Codec(bits=32).encode
    uploads = [
        ClientUpload("a", {"update": encode(torch.tensor([1.0]))}, 1, {"ema_mu": 0.2}),
        ClientUpload("b", {"update": encode(torch.tensor([3.0]))}, 3, {"ema_mu": 0.6}),
    ]
    outcome = server.server_update(torch.zeros(1), server.aggregate(uploads))
    assert outcome.model.tolist() == [2.5] and outcome.metrics == pytest.approx({"ema_mu": 0.5})
