"""pFedLA against the paper's equations worked by hand, its layers, its config rules, and a 1-bit uplink."""

import numpy as np
import pytest
import torch
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.pfedla import layer_names
from geofm.fl.algorithms.rounds import LocalRound, payload_arrays
from geofm.fl.communication.codec import Codec, Packet, decode
from geofm.fl.parameter_vectors import ParameterLayout


class TwoLayers(nn.Module):
    """Two one-value layers, ``first`` and ``second``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.zeros(1))
        self.second = nn.Parameter(torch.zeros(1))


def _hypernetwork(index, embedding, w1, head_weight, head_bias):
    """A 1-wide hypernetwork: v -> ReLU(w1 v) -> ReLU(1 .) -> ReLU(1 .) -> heads, every MLP bias 0."""
    one, zero = torch.tensor([[1.0]]), torch.tensor([0.0])
    return {
        "index": torch.tensor([index]),
        "hn.embedding": torch.tensor([embedding]),
        "hn.mlp.0.weight": torch.tensor([[w1]]),
        "hn.mlp.0.bias": zero,
        "hn.mlp.1.weight": one,
        "hn.mlp.1.bias": zero,
        "hn.mlp.2.weight": one,
        "hn.mlp.2.bias": zero,
        "hn.head.weight": torch.tensor(head_weight).view(4, 1),
        "hn.head.bias": torch.tensor(head_bias),
    }


def _client_round(client, name, arrays, config, trained):
    """The client's side: receive theta_bar, 'train' to ``trained``, upload delta = trained - theta_bar."""
    received, state = client.receive(name, arrays, config, {})
    local = LocalRound(name, received, [], [], state, 0.1)
    update = client.finish_local(local, torch.tensor(trained), 1)
    up, _ = client.upload(update, state, torch.Generator())
    return received["model"], up


def test_two_clients_give_the_papers_numbers():
    # N = 2 clients, L = 2 layers (one per tensor); embedding and hidden width 1; hn_lr eta = 0.125.
    options = {"hn_lr": 0.125, "embedding_dim": 1, "hidden_dim": 1, "layers": "tensor"}
    cfg = AlgorithmConfig(name="pfedla", options=options)
    layout = ParameterLayout.of(TwoLayers())
    server = build_algorithm(cfg, layout, num_clients=2)
    server.state["initial"] = torch.zeros(2)
    # theta_one = (first 2, second 4), theta_two = (6, 0).
    # HN_one: v = 0.5, w1 = 2: f = ReLU(1 * ReLU(1 * ReLU(2 * 0.5))) = 1; head rows l * N + j:
    #   a^first = ReLU((2, 1) * 1 + (1, 0)) = (3, 1) -> alpha = (0.75, 0.25); a^second = (1, 1) -> (0.5, 0.5).
    # HN_two: v = 1, w1 = 1: f = 1; a^first = (1, 1) -> (0.5, 0.5); a^second = (0, 2) -> (0, 1).
    server.client_state = {
        "one": {
            **_hypernetwork(0, 0.5, 2.0, [2.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]),
            "model": torch.tensor([2.0, 4.0]),
        },
        "two": {**_hypernetwork(1, 1.0, 1.0, [1.0, 1.0, 0.0, 2.0], [0.0] * 4), "model": torch.tensor([6.0, 0.0])},
    }
    sent = server.send(torch.zeros(2), 3, ["one", "two"], torch.Generator())
    client = build_algorithm(cfg, layout)
    # Client one trains to (4, 0), client two to (4.5, 0.5).
    bar_one, up_one = _client_round(client, "one", *sent["one"], [4.0, 0.0])
    bar_two, up_two = _client_round(client, "two", *sent["two"], [4.5, 0.5])

    # theta_bar_one = (0.75 * 2 + 0.25 * 6, 0.5 * 4 + 0.5 * 0) = (3, 2); theta_bar_two = (0.5 * 2 + 0.5 * 6, 1 * 0) = (4, 0).
    assert bar_one.tolist() == [3.0, 2.0] and bar_two.tolist() == [4.0, 0.0]
    # delta_one = (4, 0) - (3, 2) = (1, -2); delta_two = (0.5, 0.5).
    assert decode(Packet.from_arrays(payload_arrays(up_one)["update"])).tolist() == [1.0, -2.0]

    uploads = [ClientUpload("one", payload_arrays(up_one), 30), ClientUpload("two", payload_arrays(up_two), 10)]
    payloads = server.aggregate(uploads)
    outcome = server.server_update(torch.zeros(2), payloads)
    one, two = outcome.client_state["one"], outcome.client_state["two"]
    # theta_i <- theta_bar_i + delta_i: (3, 2) + (1, -2) = (4, 0) and (4, 0) + (0.5, 0.5) = (4.5, 0.5).
    assert one["model"].tolist() == [4.0, 0.0] and two["model"].tolist() == [4.5, 0.5]
    # Global model, weighted by examples 30 : 10: 0.75 (4, 0) + 0.25 (4.5, 0.5) = (4.125, 0.125).
    assert outcome.model.tolist() == [4.125, 0.125]
    # Mean own weight alpha_ii over layers: one (0.75 + 0.5) / 2 = 0.625, two (0.5 + 1) / 2 = 0.75; mean 0.6875.
    assert outcome.metrics["self_weight"] == 0.6875

    # HN_one's step. The gradient of theta_bar_one is -delta_one = (-1, 2). With s = sum_j a_j,
    # d theta_bar^l / d a_k = (theta_k^l - theta_bar^l) / s^l:
    #   first: ((2 - 3) / 4, (6 - 3) / 4) = (-0.25, 0.75);   second: ((4 - 2) / 2, (0 - 2) / 2) = (1, -1).
    # dL/da = -1 * (-0.25, 0.75) = (0.25, -0.75) and 2 * (1, -1) = (2, -2); every ReLU is on, so these are
    # the heads' pre-activation gradients g, and with f = 1: dL/dW_head = dL/db_head = g = (0.25, -0.75, 2, -2).
    #   W_head <- (2, 1, 1, 1) - 0.125 g = (1.96875, 1.09375, 0.75, 1.25)
    #   b_head <- (1, 0, 0, 0) - 0.125 g = (0.96875, 0.09375, -0.25, 0.25)
    torch.testing.assert_close(one["hn.head.weight"].view(-1), torch.tensor([1.96875, 1.09375, 0.75, 1.25]))
    torch.testing.assert_close(one["hn.head.bias"], torch.tensor([0.96875, 0.09375, -0.25, 0.25]))
    # dL/df = sum_k W_k g_k = 2 * 0.25 + 1 * (-0.75) + 1 * 2 + 1 * (-2) = -0.25. Back through the MLP
    # (every pre-activation is 1, every hidden value 1): dL/dz3 = dL/dz2 = dL/dz1 = -0.25, so
    #   W3, b3, W2, b2, b1 <- 1, 0, 1, 0, 0 + 0.125 * 0.25 = 1.03125, 0.03125, 1.03125, 0.03125, 0.03125
    #   W1 <- 2 - 0.125 * (-0.25 * v = -0.125) = 2.015625;  v <- 0.5 - 0.125 * (-0.25 * W1 = -0.5) = 0.5625.
    expected = {
        "hn.mlp.2.weight": 1.03125,
        "hn.mlp.2.bias": 0.03125,
        "hn.mlp.1.weight": 1.03125,
        "hn.mlp.1.bias": 0.03125,
        "hn.mlp.0.weight": 2.015625,
        "hn.mlp.0.bias": 0.03125,
        "hn.embedding": 0.5625,
    }
    for key, value in expected.items():
        torch.testing.assert_close(one[key].view(-1), torch.tensor([value]), msg=key)

    server.commit(outcome, payloads)
    assert server.client_state["one"]["model"].tolist() == [4.0, 0.0]
    assert int(server.client_state["one"]["examples"][0]) == 30


def test_a_new_client_starts_from_the_initial_model_and_indices_follow_first_contact():
    cfg = AlgorithmConfig(name="pfedla", options={"embedding_dim": 4, "hidden_dim": 8})
    server = build_algorithm(cfg, 6, num_clients=3)
    initial = torch.linspace(-1, 1, 6)
    sent = server.send(initial, 1, ["b", "a"], torch.Generator())
    assert [int(server.client_state[c]["index"][0]) for c in ("a", "b")] == [0, 1]
    for name in ("a", "b"):  # every client still holds the initial model, so any mix of them is that model
        torch.testing.assert_close(decode(Packet.from_arrays(payload_arrays(sent[name][0])["model"])), initial)
    with pytest.raises(ConfigError, match="would be client 4 of a federation of 3"):
        server.send(initial, 2, ["c", "d"], torch.Generator())


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("tensor", 6),
        (
            "module",
            ["embed.proj", "layers.0.blocks.0.attn", "layers.0.blocks.1.mlp.fc1", "layers.1.downsample", "head"],
        ),
        ("block", ["embed.proj", "layers.0.blocks.0", "layers.0.blocks.1", "layers.1", "head"]),
        ("stage", ["embed.proj", "layers.0", "layers.1", "head"]),
    ],
)
def test_layers_group_parameter_names(rule, expected):
    names = [
        "embed.proj.weight",
        "layers.0.blocks.0.attn.qkv",
        "layers.0.blocks.1.mlp.fc1.weight",
        "layers.0.blocks.1.mlp.fc1.bias",
        "layers.1.downsample.weight",
        "head.weight",
    ]
    groups = list(dict.fromkeys(layer_names(names, rule)))
    assert groups == (names if rule == "tensor" else expected)


def test_pfedla_refuses_a_compressed_downlink_and_a_server_optimiser():
    with pytest.raises(ConfigError, match=r"algorithm\.downlink\.bits: pfedla sends each client its own"):
        build_algorithm(AlgorithmConfig(name="pfedla", downlink={"bits": 8}), 4, num_clients=2)
    with pytest.raises(ConfigError, match=r"algorithm\.downlink\.bits"):
        build_algorithm(AlgorithmConfig(name="pfedla", downlink_payloads={"model": {"bits": 4}}), 4, num_clients=2)
    with pytest.raises(ConfigError, match=r"algorithm\.server_optimizer: pfedla mixes"):
        build_algorithm(AlgorithmConfig(name="pfedla", server_optimizer={"name": "fedavgm"}), 4, num_clients=2)
    with pytest.raises(ConfigError, match=r"algorithm\.options\.hn_lr"):
        build_algorithm(AlgorithmConfig(name="pfedla", options={"hn_lr": 0}), 4, num_clients=2)


def test_a_1bit_uplink_with_error_feedback_carries_its_residual_into_the_clients_model():
    cfg = AlgorithmConfig(
        name="pfedla",
        options={"embedding_dim": 4, "hidden_dim": 8},
        uplink={"bits": 1, "bucket_size": 4, "error_feedback": True},
    )
    server, client = build_algorithm(cfg, 8, num_clients=2), build_algorithm(cfg, 8)
    generator = torch.Generator().manual_seed(0)
    model, state = torch.linspace(-1, 1, 8), {}
    residual = torch.zeros(8)
    for rnd, delta in enumerate((torch.linspace(-1, 1, 8) ** 3, torch.arange(8.0) / 8 - 0.25), start=1):
        arrays, config = server.send(model, rnd, ["a"], generator)["a"]
        received, state = client.receive("a", arrays, config, state)
        update = client.finish_local(LocalRound("a", received, [], [], state, 0.1), received["model"] + delta, 1)
        up, _ = client.upload(update, state, generator)
        packet = Packet.from_arrays(payload_arrays(up)["update"])
        assert packet.bits == 1
        torch.testing.assert_close(decode(packet), decode(Codec(bits=1, bucket_size=4).encode(delta + residual)))
        residual = delta + residual - decode(packet)
        np.testing.assert_allclose(state["feedback.update.error"], residual.numpy(), atol=1e-6)
        payloads = server.aggregate([ClientUpload("a", payload_arrays(up), 5)])
        outcome = server.server_update(model, payloads)
        # The server adds what arrived (the decoded 1-bit update) to the model it sent.
        torch.testing.assert_close(outcome.client_state["a"]["model"], received["model"] + decode(packet))
        torch.testing.assert_close(outcome.model, outcome.client_state["a"]["model"])  # the only client with data
        server.commit(outcome, payloads)
        model = outcome.model
