"""FedDC against the paper's and official code's rules worked by hand, its options, and a 1-bit uplink."""

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
from tests.fl.point_round import Point, point_round


def test_two_of_four_clients_give_the_papers_numbers():
    # w = 0, c = (0.5, -1), alpha = 0.5; N = 4 clients, 2 selected; K = 2 SGD steps at eta = 0.5.
    # Client 1: b = (1, 2), h_1 = (0.5, 0), c_1 = (0.5, 0); client 2: b = (-1, 0), new (h_2 = c_2 = 0).
    # The server's mean drift is then hbar = (h_1 + 0 + 0 + 0) / 4 = (0.125, 0).
    cfg = AlgorithmConfig(name="feddc", options={"alpha": 0.5})
    layout = ParameterLayout.of(Point())
    server = build_algorithm(cfg, layout, num_clients=4)
    server.state.update(control=torch.tensor([0.5, -1.0]), drift=torch.tensor([0.125, 0.0]))
    sent = server.send(torch.zeros(2), 1, ["one", "two"], torch.Generator())
    states = {
        "one": {"drift": np.array([0.5, 0.0], np.float32), "control": np.array([0.5, 0.0], np.float32)},
        "two": {},
    }
    targets = {"one": torch.tensor([1.0, 2.0]), "two": torch.tensor([-1.0, 0.0])}
    uploads = []
    for name in ("one", "two"):
        arrays, how = sent[name]
        result = point_round(cfg, name, arrays, {**how, "round": 1}, states[name], targets[name], steps=2, lr=0.5)
        states[name] = result.state
        uploads.append(ClientUpload(name, payload_arrays(result.upload), 10))

    # The gradient of F_i is (y - b) + alpha (y + h_i - w) + (c - c_i).
    # Client 1: (y - (1, 2)) + 0.5 (y + (0.5, 0)) + (0, -1) = 1.5 y - (0.75, 3).
    #   y_1 = 0 + 0.5 (0.75, 3) = (0.375, 1.5); gradient 1.5 y_1 - (0.75, 3) = (-0.1875, -0.75);
    #   y_2 = (0.375, 1.5) + 0.5 (0.1875, 0.75) = (0.46875, 1.875) = Delta_1.
    #   h_1 <- (0.5, 0) + Delta_1 = (0.96875, 1.875);
    #   c_1+ = c_1 - c - Delta_1 / (K eta) = (0.5, 0) - (0.5, -1) - (0.46875, 1.875) = (-0.46875, -0.875);
    #   delta_c = c_1+ - c_1 = (-0.96875, -0.875).
    # Client 2: (y + (1, 0)) + 0.5 y + (0.5, -1) = 1.5 y + (1.5, -1).
    #   y_1 = -0.5 (1.5, -1) = (-0.75, 0.5); gradient (-1.125, 0.75) + (1.5, -1) = (0.375, -0.25);
    #   y_2 = (-0.75, 0.5) - 0.5 (0.375, -0.25) = (-0.9375, 0.625) = Delta_2 = h_2;
    #   c_2+ = 0 - (0.5, -1) - (-0.9375, 0.625) = (0.4375, 0.375) = delta_c.
    np.testing.assert_array_equal(states["one"]["drift"], [0.96875, 1.875])
    np.testing.assert_array_equal(states["one"]["control"], [-0.46875, -0.875])
    np.testing.assert_array_equal(states["two"]["drift"], [-0.9375, 0.625])
    np.testing.assert_array_equal(states["two"]["control"], [0.4375, 0.375])
    sent_up = {u.client: {p: decode(Packet.from_arrays(a)) for p, a in u.payloads.items()} for u in uploads}
    assert sent_up["one"]["update"].tolist() == [0.46875, 1.875]
    assert sent_up["one"]["delta_c"].tolist() == [-0.96875, -0.875]
    assert sent_up["two"]["update"].tolist() == [-0.9375, 0.625]
    assert sent_up["two"]["delta_c"].tolist() == [0.4375, 0.375]

    # Server: mean_S Delta = (-0.234375, 1.25); hbar <- (0.125, 0) + 2/4 (-0.234375, 1.25) = (0.0078125, 0.625),
    # which is (h_1 + h_2 + 0 + 0) / 4 = (0.96875 - 0.9375, 1.875 + 0.625) / 4.
    # w <- mean_S(theta_i) + hbar = (-0.234375, 1.25) + (0.0078125, 0.625) = (-0.2265625, 1.875).
    # c <- c + 2/4 mean_S(delta_c) = (0.5, -1) + 0.5 (-0.265625, -0.25) = (0.3671875, -1.125).
    payloads = server.aggregate(uploads)
    outcome = server.server_update(torch.zeros(2), payloads)
    assert outcome.model.tolist() == [-0.2265625, 1.875]
    assert outcome.state["drift"].tolist() == [0.0078125, 0.625]
    assert outcome.state["control"].tolist() == [0.3671875, -1.125]
    server.commit(outcome, payloads)
    arrays, _ = server.send(outcome.model, 2, ["one"], torch.Generator())["one"]
    assert decode(Packet.from_arrays(payload_arrays(arrays)["control"])).tolist() == [0.3671875, -1.125]


def test_with_every_client_selected_the_model_is_the_mean_of_the_corrected_models():
    # N = 2, hbar = 0, c = 0: w <- mean(theta_i) + mean(h_i) = mean(theta_i + h_i), h_i = Delta_i.
    # Deltas (1, -2) and (3, 0), w = (1, 1): theta = (2, -1), (4, 1); h = (1, -2), (3, 0);
    # mean(theta + h) = ((3 + 7) / 2, (-3 + 1) / 2) = (5, -1).
    server = build_algorithm(AlgorithmConfig(name="feddc"), 2, num_clients=2)
    encode = Codec(bits=32).encode
    uploads = [
        ClientUpload(c, {"update": encode(torch.tensor(d)), "delta_c": encode(torch.zeros(2))}, n)
        for c, d, n in (("a", [1.0, -2.0], 1), ("b", [3.0, 0.0], 9))
    ]
    outcome = server.server_update(torch.ones(2), server.aggregate(uploads))
    assert outcome.model.tolist() == [5.0, -1.0], "plain means: the official code weighs clients equally"


def test_alpha_defaults_to_the_papers_value_and_unknown_options_are_refused():
    assert build_algorithm(AlgorithmConfig(name="feddc"), 4).options.alpha == 0.01
    with pytest.raises(ConfigError, match=r"algorithm\.options\.alpah"):
        build_algorithm(AlgorithmConfig(name="feddc", options={"alpah": 0.1}), 4)
    with pytest.raises(ConfigError, match=r"algorithm\.options\.alpha"):
        build_algorithm(AlgorithmConfig(name="feddc", options={"alpha": -1}), 4)
    with pytest.raises(ConfigError, match=r"algorithm\.aggregator: feddc combines"):
        build_algorithm(AlgorithmConfig(name="feddc", aggregator={"name": "median"}), 4)


def test_each_payload_keeps_its_own_residual_under_a_1bit_uplink():
    cfg = AlgorithmConfig(name="feddc", uplink={"bits": 1, "bucket_size": 4, "error_feedback": True})
    client, server = build_algorithm(cfg, 8), build_algorithm(cfg, 8, num_clients=1)
    generator = torch.Generator().manual_seed(0)
    first = {"update": torch.linspace(-1, 1, 8), "delta_c": torch.arange(8.0) - 2}
    second = {"update": torch.linspace(1, -1, 8) ** 3, "delta_c": torch.ones(8)}
    state = {}
    up, _ = client.upload(LocalUpdate(dict(first)), state, generator)
    residuals = {}
    for p, arrays in payload_arrays(up).items():
        packet = Packet.from_arrays(arrays)
        assert packet.bits == 1
        residuals[p] = first[p] - decode(packet)
        np.testing.assert_allclose(state[f"feedback.{p}.error"], residuals[p].numpy())
    up, _ = client.upload(LocalUpdate(dict(second)), state, generator)
    decoded = {p: decode(Packet.from_arrays(a)) for p, a in payload_arrays(up).items()}
    for p in first:
        expected = Codec(bits=1, bucket_size=4).encode(second[p] + residuals[p])
        assert torch.equal(decoded[p], decode(expected)), f"the second {p} carries its own residual"
    # One client of one: hbar = Delta, w = 0 + Delta + hbar = 2 Delta, c = delta_c, all as decoded.
    outcome = server.server_update(torch.zeros(8), server.aggregate([ClientUpload("a", payload_arrays(up), 3)]))
    assert torch.equal(outcome.model, 2 * decoded["update"]) and torch.equal(
        outcome.state["control"], decoded["delta_c"]
    )


def test_the_correction_state_needs_a_step_at_a_positive_learning_rate():
    algorithm = build_algorithm(AlgorithmConfig(name="feddc"), ParameterLayout.of(Point()))
    received = {"model": torch.zeros(2), "control": torch.zeros(2)}
    local = algorithm.local_round("one", received, Point(), {}, lr=0.0)
    with pytest.raises(ValueError, match=r"client one: FedDC's correction state needs .* got 2 steps at 0.0"):
        algorithm.finish_local(local, torch.ones(2), 2)
