"""FedBN against the paper's rule worked by hand: shared layers FedAvg'd, normalisation layers kept by each
client; and its two payloads under a 1-bit uplink with error feedback."""

import numpy as np
import pytest
import torch
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.rounds import payload_arrays
from geofm.fl.communication.codec import Codec, Packet, decode
from geofm.fl.parameter_vectors import ParameterLayout


class LinearNorm(nn.Module):
    """A shared Linear(1, 1) (w, b) and a normalisation layer (gamma, beta) that FedBN keeps local."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)
        self.norm = norm
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.zero_()


def _params(model: LinearNorm) -> torch.Tensor:
    """(w, b, gamma, beta)."""
    return torch.cat([model.linear.weight.flatten(), model.linear.bias, model.norm.weight, model.norm.bias])


def _client_round(algorithm, name, arrays, config, state, target, make_norm, lr=0.5):
    """As the runtime's client: one SGD step on f_k = ||(w, b, gamma, beta) - target||^2 / 2 (gradient theta -
    target), so theta' = theta - lr (theta - target); returns the uplink arrays and the state."""
    received, state = algorithm.receive(name, arrays, config, state)
    model = LinearNorm(make_norm())
    algorithm.shared.assign(model, received["model"])
    algorithm.restore_local(model, state)
    local = algorithm.local_round(name, received, model, state, lr)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = 0.5 * ((_params(model) - target) ** 2).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    update = algorithm.finish_local(local, algorithm.shared.flatten_module(model), 1)
    algorithm.keep_local(model, state)
    up, _ = algorithm.upload(update, state, torch.Generator())
    return up, state


def _federation(cfg, make_norm):
    layout = ParameterLayout.of(LinearNorm(make_norm()))
    server, client = build_algorithm(cfg, layout, num_clients=2), build_algorithm(cfg, layout)
    server.start_local(server.local.flatten_module(LinearNorm(make_norm())))
    return server, client


def _decoded(arrays) -> dict[str, torch.Tensor]:
    return {p: decode(Packet.from_arrays(a)) for p, a in payload_arrays(arrays).items()}


TARGETS = {"one": torch.tensor([2.0, 4.0, 3.0, -2.0]), "two": torch.tensor([-2.0, 0.0, -1.0, 2.0])}
EXAMPLES = {"one": 10, "two": 30}  # FedAvg's weights p_k: 1/4 and 3/4


@pytest.mark.parametrize(
    ("make_norm", "layers"),
    [(lambda: nn.BatchNorm1d(1), "batchnorm"), (lambda: nn.BatchNorm1d(1), "all"), (lambda: nn.LayerNorm(1), "all")],
    ids=["batchnorm-paper", "batchnorm-all", "layernorm-all"],
)
def test_two_rounds_keep_each_clients_norms_and_fedavg_the_rest(make_norm, layers):
    server, client = _federation(AlgorithmConfig(name="fedbn", options={"layers": layers}), make_norm)
    assert server.shared.names == ("linear.weight", "linear.bias")
    assert server.local.names == ("norm.weight", "norm.bias")
    assert server.personalised and server.keeps_local_statistics
    states: dict[str, dict] = {"one": {}, "two": {}}
    model = torch.zeros(2)  # Theta^0 = (w, b) = (0, 0); the start norms nu^0 = (gamma, beta) = (1, 0)
    for rnd in (1, 2):
        sent = server.send(model, rnd, ["one", "two"], torch.Generator())
        uploads = []
        for name in ("one", "two"):
            arrays, config = sent[name]
            assert _decoded(arrays)["norms"].tolist() == [1.0, 0.0], "only the start norms ever travel down"
            up, states[name] = _client_round(client, name, arrays, config, states[name], TARGETS[name], make_norm)
            uploads.append(ClientUpload(name, payload_arrays(up), EXAMPLES[name]))
        payloads = server.aggregate(uploads)
        outcome = server.server_update(model, payloads)
        server.commit(outcome, payloads)
        model = outcome.model

    # Round 1, theta' = (theta + target) / 2 from (0, 0, 1, 0):
    #   client one: (1, 2, 2, -1): Delta_1 = (1, 2), nu_1 = (2, -1);
    #   client two: (-1, 0, 0, 1): Delta_2 = (-1, 0), nu_2 = (0, 1).
    #   Theta^1 = 0 + 1/4 (1, 2) + 3/4 (-1, 0) = (-0.5, 0.5).
    # Round 2, each from (Theta^1, its own nu_k):
    #   client one from (-0.5, 0.5, 2, -1): (0.75, 2.25, 2.5, -1.5): Delta_1 = (1.25, 1.75), nu_1 = (2.5, -1.5);
    #   client two from (-0.5, 0.5, 0, 1): (-1.25, 0.25, -0.5, 1.5): Delta_2 = (-0.75, -0.25), nu_2 = (-0.5, 1.5).
    #   Theta^2 = (-0.5, 0.5) + 1/4 (1.25, 1.75) + 3/4 (-0.75, -0.25) = (-0.75, 0.75).
    # The server's own model (validation, export): nu-bar = 1/4 (2.5, -1.5) + 3/4 (-0.5, 1.5) = (0.25, 0.75).
    assert model.tolist() == [-0.75, 0.75]
    assert states["one"]["local"].tolist() == [2.5, -1.5] and states["two"]["local"].tolist() == [-0.5, 1.5]
    sent_up = {u.client: _decoded_upload(u) for u in uploads}
    assert sent_up["one"]["update"].tolist() == [1.25, 1.75] and sent_up["one"]["norms"].tolist() == [2.5, -1.5]
    assert sent_up["two"]["update"].tolist() == [-0.75, -0.25] and sent_up["two"]["norms"].tolist() == [-0.5, 1.5]
    assert server.server_local().tolist() == [0.25, 0.75]

    # A client first selected in round 3 starts from the start norms nu^0, not from the clients' mean.
    arrays, config = server.send(model, 3, ["three"], torch.Generator())["three"]
    _, state = client.receive("three", arrays, config, {})
    assert state["local"].tolist() == [1.0, 0.0]


def _decoded_upload(upload: ClientUpload) -> dict[str, torch.Tensor]:
    return {p: decode(Packet.from_arrays(a)) for p, a in upload.payloads.items()}


def test_the_server_state_round_trips_through_its_checkpoint():
    server, _ = _federation(AlgorithmConfig(name="fedbn"), lambda: nn.LayerNorm(1))
    assert server.server_local() is None, "before any round the server's model keeps its start norms"
    server.state["norms"] = torch.tensor([0.5, 0.25])
    restored, _ = _federation(AlgorithmConfig(name="fedbn"), lambda: nn.LayerNorm(1))
    restored.load_state_dict(server.state_dict())
    assert restored.server_local().tolist() == [0.5, 0.25]


def test_each_payload_keeps_its_own_residual_under_a_1bit_uplink():
    cfg = AlgorithmConfig(name="fedbn", uplink={"bits": 1, "error_feedback": True})
    server, client = _federation(cfg, lambda: nn.BatchNorm1d(1))
    state: dict = {}
    arrays, config = server.send(torch.zeros(2), 1, ["one"], torch.Generator())["one"]
    up, state = _client_round(client, "one", arrays, config, state, TARGETS["one"], lambda: nn.BatchNorm1d(1))
    first = _decoded(up)
    assert {Packet.from_arrays(a).bits for a in payload_arrays(up).values()} == {1}
    # Exact values (hand, as above): Delta_1 = (1, 2), nu_1 = (2, -1); each residual is its own payload's
    # value minus what travelled, and the client keeps its exact norms, not their 1-bit image.
    exact = {"update": torch.tensor([1.0, 2.0]), "norms": torch.tensor([2.0, -1.0])}
    for p in ("update", "norms"):
        np.testing.assert_allclose(state[f"feedback.{p}.error"], (exact[p] - first[p]).numpy())
    assert state["local"].tolist() == [2.0, -1.0]
    payloads = server.aggregate([ClientUpload("one", payload_arrays(up), 10)])
    outcome = server.server_update(torch.zeros(2), payloads)
    server.commit(outcome, payloads)
    assert torch.equal(server.server_local(), first["norms"]), "the server averages what arrived"

    residual = torch.from_numpy(state["feedback.norms.error"].copy())
    arrays, config = server.send(outcome.model, 2, ["one"], torch.Generator())["one"]
    up, state = _client_round(client, "one", arrays, config, state, TARGETS["one"], lambda: nn.BatchNorm1d(1))
    # Round 2 from (Theta^1, (2, -1)): nu_1 = ((2, -1) + (3, -2)) / 2 = (2.5, -1.5), sent with the residual.
    expected = Codec(bits=1, bucket_size=cfg.uplink.bucket_size).encode(torch.tensor([2.5, -1.5]) + residual)
    assert torch.equal(_decoded(up)["norms"], decode(expected)), "the second norms carry their own residual"
    assert state["local"].tolist() == [2.5, -1.5]


def test_layers_batchnorm_refuses_a_model_without_batchnorm():
    layout = ParameterLayout.of(LinearNorm(nn.LayerNorm(1)))
    with pytest.raises(ConfigError, match=r"algorithm\.options\.layers: batchnorm: the model has no such"):
        build_algorithm(AlgorithmConfig(name="fedbn", options={"layers": "batchnorm"}), layout)
    with pytest.raises(ConfigError, match=r"options\.layers"):
        build_algorithm(AlgorithmConfig(name="fedbn", options={"layers": "layernorm"}), layout)
