"""SCAFFOLD (option II) against the paper's equations worked by hand, and its payloads with a 1-bit uplink."""

import numpy as np
import pytest
import torch

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.rounds import LocalUpdate, payload_arrays
from geofm.fl.communication.codec import Codec, Packet, decode
from geofm.fl.parameter_vectors import ParameterLayout
from geofm.tasks import StepOutput
from tests.fl.point_round import Point, point_round


def test_two_clients_give_the_papers_numbers():
    # x = 0, c = (0.5, -1); client 1: b = (1, 2), c_1 = (0.5, 0); client 2: b = (-1, 0), c_2 = 0 (new).
    # K = 2 steps of SGD at eta_l = 0.5 on g(y) - c_i + c; 2 of N = 4 clients; eta_g = 0.5.
    cfg = AlgorithmConfig(name="scaffold", options={"server_lr": 0.5})
    layout = ParameterLayout.of(Point())
    server = build_algorithm(cfg, layout, num_clients=4)
    server.state["control"] = torch.tensor([0.5, -1.0])
    sent = server.send(torch.zeros(2), 1, ["one", "two"], torch.Generator())
    states = {"one": {"control": np.array([0.5, 0.0], np.float32)}, "two": {}}
    targets = {"one": torch.tensor([1.0, 2.0]), "two": torch.tensor([-1.0, 0.0])}
    uploads = []
    for name in ("one", "two"):
        arrays, how = sent[name]
        result = point_round(cfg, name, arrays, {**how, "round": 1}, states[name], targets[name], steps=2, lr=0.5)
        states[name] = result.state
        uploads.append(ClientUpload(name, payload_arrays(result.upload), 10))

    # Client 1: g = y - (1, 3): y_1 = (0.5, 1.5), y_2 = (0.75, 2.25); c_1+ = c_1 - c + (x - y_2) / (K eta_l)
    # = (0, 1) - (0.75, 2.25) = (-0.75, -1.25). Client 2: g = y - (-1.5, 1): y_1 = (-0.75, 0.5),
    # y_2 = (-1.125, 0.75); c_2+ = (-0.5, 1) - (-1.125, 0.75) = (0.625, 0.25).
    np.testing.assert_array_equal(states["one"]["control"], [-0.75, -1.25])
    np.testing.assert_array_equal(states["two"]["control"], [0.625, 0.25])
    sent_up = {u.client: {p: decode(Packet.from_arrays(a)) for p, a in u.payloads.items()} for u in uploads}
    assert sent_up["one"]["delta_y"].tolist() == [0.75, 2.25] and sent_up["one"]["delta_c"].tolist() == [-1.25, -1.25]
    assert sent_up["two"]["delta_y"].tolist() == [-1.125, 0.75] and sent_up["two"]["delta_c"].tolist() == [0.625, 0.25]

    # Server: x = 0 + 0.5 * mean(delta_y) = 0.5 * (-0.1875, 1.5); c = c + 2/4 * mean(delta_c) = c + 0.5 * (-0.3125, -0.5).
    payloads = server.aggregate(uploads)
    outcome = server.server_update(torch.zeros(2), payloads)
    assert outcome.model.tolist() == [-0.09375, 0.75]
    assert outcome.state["control"].tolist() == [0.34375, -1.25]
    server.commit(outcome, payloads)
    arrays, _ = server.send(outcome.model, 2, ["one"], torch.Generator())["one"]
    assert decode(Packet.from_arrays(payload_arrays(arrays)["control"])).tolist() == [0.34375, -1.25]


def test_the_server_weighs_clients_equally_whatever_their_examples():
    server = build_algorithm(AlgorithmConfig(name="scaffold"), 1, num_clients=2)
    encode = Codec(bits=32).encode
    uploads = [
        ClientUpload("a", {"delta_y": encode(torch.tensor([1.0])), "delta_c": encode(torch.tensor([2.0]))}, 1),
        ClientUpload("b", {"delta_y": encode(torch.tensor([3.0])), "delta_c": encode(torch.tensor([4.0]))}, 9),
    ]
    outcome = server.server_update(torch.zeros(1), server.aggregate(uploads))
    assert outcome.model.tolist() == [2.0] and outcome.state["control"].tolist() == [3.0]


@pytest.mark.parametrize("delta_c_bits", [1, 8])
def test_each_payload_keeps_its_own_residual_under_a_1bit_uplink(delta_c_bits):
    cfg = AlgorithmConfig(
        name="scaffold",
        uplink={"bits": 1, "bucket_size": 4, "error_feedback": True},
        uplink_payloads={"delta_c": {"bits": delta_c_bits}},
    )
    client, server = build_algorithm(cfg, 8), build_algorithm(cfg, 8, num_clients=1)
    generator = torch.Generator().manual_seed(0)
    first = {"delta_y": torch.linspace(-1, 1, 8), "delta_c": torch.arange(8.0) - 2}
    second = {"delta_y": torch.linspace(1, -1, 8) ** 3, "delta_c": torch.ones(8)}
    state = {}
    up, _ = client.upload(LocalUpdate(dict(first)), state, generator)
    packets = {p: Packet.from_arrays(a) for p, a in payload_arrays(up).items()}
    assert packets["delta_y"].bits == 1 and packets["delta_c"].bits == delta_c_bits
    for p in ("delta_y", "delta_c"):
        np.testing.assert_allclose(state[f"feedback.{p}.error"], (first[p] - decode(packets[p])).numpy())
    residuals = {p: torch.from_numpy(state[f"feedback.{p}.error"].copy()) for p in first}
    up, _ = client.upload(LocalUpdate(dict(second)), state, generator)
    decoded = {p: decode(Packet.from_arrays(a)) for p, a in payload_arrays(up).items()}
    expected = Codec(bits=1, bucket_size=4).encode(second["delta_y"] + residuals["delta_y"])
    assert torch.equal(decoded["delta_y"], decode(expected)), "the second delta_y carries its own residual"
    np.testing.assert_allclose(
        state["feedback.delta_c.error"], (second["delta_c"] + residuals["delta_c"] - decoded["delta_c"]).numpy()
    )
    payloads = server.aggregate([ClientUpload("a", payload_arrays(up), 3)])
    assert [a.client for a in payloads["delta_c"].accepted] == ["a"]
    assert torch.equal(payloads["delta_y"].update, decoded["delta_y"])


def test_scaffold_refuses_another_aggregator_or_server_optimiser():
    with pytest.raises(
        ConfigError, match=r"algorithm\.aggregator: scaffold combines the uploads by the paper's plain means"
    ):
        build_algorithm(AlgorithmConfig(name="scaffold", aggregator={"name": "median"}), 4)


def test_the_correction_moves_the_gradient_by_c_minus_c_i_and_leaves_the_loss_value_alone():
    algorithm = build_algorithm(AlgorithmConfig(name="scaffold"), ParameterLayout.of(Point()))
    model = Point()
    received = {"model": torch.zeros(2), "control": torch.tensor([0.5, -1.0])}
    local = algorithm.local_round("one", received, model, {"control": np.array([0.25, 0.0], np.float32)}, 0.5)
    output = StepOutput({"loss": model(torch.tensor([1.0, 2.0]))})
    correction = algorithm.local_hooks(local).regulariser(None, output)
    assert correction.item() == 0.0
    correction.backward()
    assert model.y.grad.tolist() == [0.25, -1.0]
