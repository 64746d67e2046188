"""FedNova against the paper's equations worked by hand, its screening of step counts, and a 1-bit uplink."""

import numpy as np
import pytest
import torch

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError, FederatedRunError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.rounds import LocalUpdate, payload_arrays
from geofm.fl.communication.codec import Codec, Packet, decode
from geofm.fl.parameter_vectors import ParameterLayout
from tests.fl.point_round import Point, point_round


def test_two_clients_with_different_step_counts_give_the_papers_numbers():
    # x = 0; SGD at eta = 0.5. Client 1: b = (1, 2), tau_1 = 1, 30 examples; client 2: b = (-2, 0),
    # tau_2 = 4, 10 examples: p = (0.75, 0.25).
    cfg = AlgorithmConfig(name="fednova")
    layout = ParameterLayout.of(Point())
    server = build_algorithm(cfg, layout, num_clients=2)
    sent = server.send(torch.zeros(2), 1, ["one", "two"], torch.Generator())
    uploads = []
    for name, target, steps, examples in (("one", [1.0, 2.0], 1, 30), ("two", [-2.0, 0.0], 4, 10)):
        arrays, how = sent[name]
        result = point_round(cfg, name, arrays, {**how, "round": 1}, {}, torch.tensor(target), steps, lr=0.5)
        metadata = result.update.metadata
        assert metadata == {"local_steps": steps, "a_norm": steps}  # plain SGD: ||a_i||_1 = tau_i
        uploads.append(ClientUpload(name, payload_arrays(result.upload), examples, metadata))

    # Client 1: y = 0 - 0.5 (0 - b) = (0.5, 1). Client 2: y_k = y_k-1 - 0.5 (y_k-1 - b) halves the way
    # to b each step: (-1, 0), (-1.5, 0), (-1.75, 0), (-1.875, 0); y_2 - x = (-1.875, 0).
    # tau_eff = 0.75 * 1 + 0.25 * 4 = 1.75;
    # sum_i p_i (y_i - x) / tau_i = 0.75 (0.5, 1) / 1 + 0.25 (-1.875, 0) / 4 = (0.375 - 0.1171875, 0.75)
    # = (0.2578125, 0.75); x <- 0 + 1.75 (0.2578125, 0.75) = (0.451171875, 1.3125).
    # (FedAvg's 0.75 (0.5, 1) + 0.25 (-1.875, 0) = (-0.09375, 0.75) follows the long-running client 2.)
    outcome = server.server_update(torch.zeros(2), server.aggregate(uploads))
    assert outcome.model.tolist() == [0.451171875, 1.3125]
    assert outcome.metrics == {"tau_eff": 1.75}


def test_equal_step_counts_make_it_fedavg():
    # tau_i = 3 for both: tau_eff = 3 and x + 3 sum_i p_i delta_i / 3 = x + sum_i p_i delta_i.
    server = build_algorithm(AlgorithmConfig(name="fednova"), 1, num_clients=2)
    encode = Codec(bits=32).encode
    uploads = [
        ClientUpload("a", {"update": encode(torch.tensor([1.0]))}, 1, {"local_steps": 3}),
        ClientUpload("b", {"update": encode(torch.tensor([3.0]))}, 3, {"local_steps": 3}),
    ]
    assert server.server_update(torch.ones(1), server.aggregate(uploads)).model.tolist() == [3.5]


@pytest.mark.parametrize("metadata", [{}, {"local_steps": 0}, {"local_steps": -2}, {"local_steps": "many"}])
def test_a_missing_or_non_positive_step_count_is_an_error_naming_the_client(metadata):
    server = build_algorithm(AlgorithmConfig(name="fednova"), 1, num_clients=2)
    encode = Codec(bits=32).encode
    uploads = [
        ClientUpload("fine", {"update": encode(torch.tensor([1.0]))}, 1, {"local_steps": 2}),
        ClientUpload("broken", {"update": encode(torch.tensor([2.0]))}, 1, metadata),
    ]
    with pytest.raises(FederatedRunError, match=r"fednova: client broken reported local_steps="):
        server.server_update(torch.zeros(1), server.aggregate(uploads))


def test_fednova_refuses_another_aggregator_or_server_optimiser():
    with pytest.raises(ConfigError, match=r"algorithm\.server_optimizer: fednova normalises"):
        build_algorithm(AlgorithmConfig(name="fednova", server_optimizer={"name": "fedadam", "lr": 0.01}), 4)
    with pytest.raises(ConfigError, match=r"fednova takes no options"):
        build_algorithm(AlgorithmConfig(name="fednova", options={"server_lr": 2.0}), 4)


def test_the_update_keeps_its_residual_under_a_1bit_uplink_and_the_server_normalises_what_it_decoded():
    cfg = AlgorithmConfig(name="fednova", uplink={"bits": 1, "bucket_size": 4, "error_feedback": True})
    client, server = build_algorithm(cfg, 8), build_algorithm(cfg, 8, num_clients=1)
    generator = torch.Generator().manual_seed(0)
    first, second = torch.linspace(-1, 1, 8), torch.linspace(1, -1, 8) ** 3
    state = {}
    up, _ = client.upload(LocalUpdate({"update": first}, {"local_steps": 4}), state, generator)
    sent = decode(Packet.from_arrays(payload_arrays(up)["update"]))
    np.testing.assert_allclose(state["feedback.update.error"], (first - sent).numpy())
    up, _ = client.upload(LocalUpdate({"update": second}, {"local_steps": 4}), state, generator)
    packet = Packet.from_arrays(payload_arrays(up)["update"])
    assert packet.bits == 1
    expected = Codec(bits=1, bucket_size=4).encode(second + (first - sent))
    assert torch.equal(decode(packet), decode(expected)), "the second update carries the first's residual"
    # One client: tau_eff = 4 and x + 4 * (delta / 4) = x + delta, the decoded 1-bit update.
    payloads = server.aggregate([ClientUpload("a", payload_arrays(up), 3, {"local_steps": 4})])
    assert torch.equal(server.server_update(torch.zeros(8), payloads).model, decode(packet))
