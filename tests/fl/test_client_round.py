"""The client's local round (:class:`~geofm.fl.client_round.ClientRound`) on the engine: every hook of
the algorithm, SAM's ascent included, and what it returns."""

import torch

from geofm.config.algorithm import AlgorithmConfig
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.rounds import payload_arrays
from geofm.fl.communication.codec import Packet, decode
from geofm.fl.parameter_vectors import ParameterLayout
from tests.fl.point_round import Point, point_round


def test_a_fedsam_round_steps_on_the_gradient_at_the_ascended_point():
    # y = 0, b = (0.6, 0.8): g = (-0.6, -0.8), ||g|| = 1; rho = 0.5: e = (-0.3, -0.4); the gradient at y + e
    # is (-0.9, -1.2), so one SGD step at 0.5 ends at (0.45, 0.6): the update. Without the ascent: (0.3, 0.4).
    cfg = AlgorithmConfig(name="fedsam", sam={"rho": 0.5})
    server = build_algorithm(cfg, ParameterLayout.of(Point()), num_clients=1)
    arrays, how = server.send(torch.zeros(2), 1, ["one"], torch.Generator())["one"]
    result = point_round(cfg, "one", arrays, {**how, "round": 1}, {}, torch.tensor([0.6, 0.8]), steps=1, lr=0.5)
    update = decode(Packet.from_arrays(payload_arrays(result.upload)["update"]))
    torch.testing.assert_close(update, torch.tensor([0.45, 0.6]))
    assert torch.equal(result.update.payloads["update"], update), "a 32-bit upload is the update itself"
    assert result.metrics["steps"] == 1 and result.metrics["local_world_size"] == 1
    assert abs(result.metrics["loss"] - 1.125) < 1e-6, "the logged loss is the one at y + e: (0.9^2 + 1.2^2) / 2"
    assert int(result.state["round"][0]) == 1 and result.metrics["update_norm"] > 0
