"""The algorithm interface: registry, options, named payloads, states, metadata and local parameters."""

import numpy as np
import pytest
import torch
from pydantic import BaseModel, Field
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import ALGORITHMS, build_algorithm
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.rounds import LocalUpdate, ServerRound, payload_arrays
from geofm.fl.communication.codec import Codec, Packet, decode
from geofm.fl.parameter_vectors import ParameterLayout


class FedNormLocal(FedAvg):
    """FedBN-like: the normalisation layers stay on each client; reports how many values it kept."""

    name = "fednormlocal"

    class Options(BaseModel):
        keep: str = "norm"
        weight: float = Field(default=1.0, gt=0)

    def is_local(self, name: str) -> bool:
        return self.options.keep in name

    def finish_local(self, local, trained, steps):
        update = super().finish_local(local, trained, steps)
        update.metadata["local_values"] = int(local.state["local"].size) if "local" in local.state else 0
        return update


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.norm = nn.LayerNorm(2)

    def forward(self, x):
        return self.norm(self.linear(x))


@pytest.fixture
def registered():
    ALGORITHMS.register("fednormlocal", FedNormLocal)
    yield
    ALGORITHMS._entries.pop("fednormlocal")


def _packet(arrays: dict, payload: str) -> Packet:
    return Packet.from_arrays(payload_arrays(arrays)[payload])


def test_a_misspelt_algorithm_names_the_nearest_ones():
    with pytest.raises(ValueError, match=r"unknown algorithm 'scafold'; did you mean 'scaffold'\?"):
        AlgorithmConfig(name="scafold")


def test_a_plugin_checks_its_own_options(registered):
    algorithm = build_algorithm(AlgorithmConfig(name="fednormlocal", options={"keep": "bias"}), 4)
    assert algorithm.options.keep == "bias" and algorithm.options.weight == 1.0
    with pytest.raises(ConfigError, match=r"algorithm\.options\.weight: Input should be greater than 0"):
        build_algorithm(AlgorithmConfig(name="fednormlocal", options={"weight": -1}), 4)
    with pytest.raises(ConfigError, match=r"algorithm\.options: fedavg takes no options, got \['keep'\]"):
        build_algorithm(AlgorithmConfig(name="fedavg", options={"keep": "norm"}), 4)
    with pytest.raises(ConfigError, match=r"algorithm\.uplink_payloads names \['delta_c'\]; fedavg sends \['update'\]"):
        build_algorithm(AlgorithmConfig(name="fedavg", uplink_payloads={"delta_c": {"bits": 8}}), 4)


def test_a_payload_changes_only_the_fields_it_names():
    cfg = AlgorithmConfig(
        name="scaffold", uplink={"bits": 1, "error_feedback": True}, uplink_payloads={"delta_c": {"bits": 8}}
    )
    assert cfg.uplink_for("delta_y").bits == 1 and cfg.uplink_for("delta_c").bits == 8
    assert cfg.uplink_for("delta_c").error_feedback, "unnamed fields come from algorithm.uplink"
    with pytest.raises(ValueError, match=r"uplink_payloads\.delta_c\.bits: Input should be 1, 2, 4, 8 or 32"):
        AlgorithmConfig(name="scaffold", uplink_payloads={"delta_c": {"bits": 3}})


def test_local_parameters_stay_on_the_client_and_never_travel(registered):
    torch.manual_seed(0)
    cfg = AlgorithmConfig(name="fednormlocal")
    server_model, client_model = Tiny(), Tiny()
    layout = ParameterLayout.of(server_model)
    server = build_algorithm(cfg, layout, num_clients=1)
    client = build_algorithm(cfg, layout)
    assert server.local.names == ("norm.weight", "norm.bias") and server.num_values == 3 * 2 + 2
    global_model = server.shared.flatten_module(server_model)
    arrays, config = server.send(global_model, 1, ["a"], torch.Generator())["a"]
    assert _packet(arrays, "model").n == 8, "the downlink holds the shared parameters only"

    state = {}
    for rnd in (1, 2):
        received, state = client.receive("a", arrays, config, state)
        client.shared.assign(client_model, received["model"])
        client.restore_local(client_model, state)
        if rnd == 2:
            assert torch.equal(client_model.norm.weight.detach(), torch.tensor([3.0, 3.0])), "kept from round 1"
        local = client.local_round("a", received, client_model, state, lr=0.1)
        assert [p.shape for p in local.params] == [(2, 3), (2,)]
        with torch.no_grad():
            client_model.norm.weight.fill_(3.0)
            client_model.linear.bias.add_(1.0)
        update = client.finish_local(local, client.shared.flatten_module(client_model), steps=1)
        client.keep_local(client_model, state)
        up, _ = client.upload(update, state, torch.Generator())
        assert _packet(up, "update").n == 8 and np.array_equal(state["local"], [3.0, 3.0, 0.0, 0.0])

    assert update.metadata == {"local_values": 4}
    payloads = server.aggregate([ClientUpload("a", payload_arrays(up), 10, update.metadata)])
    assert payloads["update"].accepted[0].metadata == {"local_values": 4}, "the server sees the client's metadata"
    outcome = server.server_update(global_model, payloads)
    assert torch.allclose(outcome.model - global_model, torch.tensor([0.0] * 6 + [1.0, 1.0]))


def test_every_payload_is_screened_on_its_own_and_a_client_counts_only_whole():
    server = build_algorithm(AlgorithmConfig(name="scaffold"), 4, num_clients=3)
    encode = Codec(bits=32).encode
    good = {"delta_y": encode(torch.ones(4)), "delta_c": encode(torch.ones(4))}
    nan = {**encode(torch.ones(4)).to_arrays(), "payload": np.array([1, np.nan, 0, 0], np.float32).view(np.uint8)}
    bad = {"delta_y": encode(torch.ones(4)), "delta_c": nan}
    payloads = server.aggregate([ClientUpload("a", good, 10), ClientUpload("b", bad, 10), ClientUpload("c", {}, 5)])
    assert [a.client for a in payloads["delta_y"].accepted] == ["a"] == [a.client for a in payloads["delta_c"].accepted]
    reasons = {r.client: r.reason for r in payloads["delta_y"].rejected}
    assert reasons["b"].startswith("delta_c: update decodes to 1 NaN or Inf values")
    assert reasons["c"] == "sent no 'delta_y' payload"


def test_the_server_state_travels_through_a_checkpoint_and_old_checkpoints_load():
    cfg = AlgorithmConfig(name="fedavg", downlink={"bits": 8}, norm_history_rounds=2)
    server = build_algorithm(cfg, 4)
    server.send(torch.ones(4), 1, ["a"], torch.Generator())
    server.note_replies(1, ["a"])
    payloads = server.aggregate([ClientUpload("a", {"update": Codec(bits=32).encode(torch.ones(4))}, 1)])
    for _ in range(3):
        outcome = ServerRound(
            torch.ones(4), state={"extra": torch.zeros(1)}, client_state={"a": {"seen": torch.ones(1)}}
        )
        server.commit(outcome, payloads)
    assert server.recent_norms == {"update": [[2.0], [2.0]]}, "the history keeps norm_history_rounds rounds"
    restored = build_algorithm(cfg, 4)
    restored.load_state_dict(server.state_dict())
    assert restored.state_dict().keys() == server.state_dict().keys() and restored.synced == {"a": 1}
    assert torch.equal(restored.references["model"], torch.ones(4)) and "extra" in restored.state
    assert torch.equal(restored.client_state["a"]["seen"], torch.ones(1)), "per-client server state"

    old = build_algorithm(cfg, 4)
    old.load_state_dict({"round": 3, "reference": torch.zeros(4), "synced": {"a": 3}, "recent_norms": [[1.5]]})
    assert old.recent_norms == {"update": [[1.5]]} and old.synced == {"a": 3}
    assert torch.equal(old.references["model"], torch.zeros(4))
    scaffold = build_algorithm(AlgorithmConfig(name="scaffold"), 4)
    with pytest.raises(
        ConfigError, match=r"an algorithm with uplink \['update'\].*scaffold has \['delta_y', 'delta_c'\]"
    ):
        scaffold.load_state_dict({"reference": None, "synced": {}, "recent_norms": []})


def test_old_client_states_read_as_the_named_payloads():
    client = build_algorithm(AlgorithmConfig(name="fedavg", uplink={"bits": 32, "error_feedback": True}), 4)
    server = build_algorithm(AlgorithmConfig(name="fedavg"), 4)
    arrays, config = server.send(torch.zeros(4), 2, ["a"], torch.Generator())["a"]
    old = {"feedback.error": np.full(4, 0.5, np.float32), "feedback.rounds": np.array([1]), "round": np.array([1])}
    _, state = client.receive("a", arrays, config, old)
    assert set(state) == {"feedback.update.error", "feedback.update.rounds", "round"}
    up, _ = client.upload(LocalUpdate({"update": torch.tensor([1.0, -1.0, 1.0, -1.0])}), state, torch.Generator())
    assert torch.equal(decode(_packet(up, "update")), torch.tensor([1.5, -0.5, 1.5, -0.5])), "delta + old residual"
