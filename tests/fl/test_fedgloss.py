"""FedGloSS against Algorithm 1 of the paper worked by hand: two server rounds, a client's step and its dual."""

import numpy as np
import pytest
import torch
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.algorithms.fedgloss import FedGloSSOptions, scheduled_radius
from geofm.fl.algorithms.rounds import LocalUpdate, payload_arrays
from geofm.fl.communication.codec import Packet, decode
from geofm.fl.parameter_vectors import ParameterLayout
from geofm.tasks import StepOutput
from geofm.training.loop import micro_step


def _sent_model(algorithm, model: torch.Tensor, rnd: int) -> list[float]:
    algorithm.begin_round(rnd)
    arrays, _ = algorithm.send(model, rnd, ["a"], torch.Generator())["a"]
    return decode(Packet.from_arrays(payload_arrays(arrays)["model"])).tolist()


def _uploads(algorithm, updates: dict[str, tuple[list[float], int]]) -> list[ClientUpload]:
    return [
        ClientUpload(name, payload_arrays(algorithm.upload(LocalUpdate({"update": torch.tensor(u)}), {}, None)[0]), n)
        for name, (u, n) in updates.items()
    ]


def test_two_server_rounds_give_the_papers_numbers():
    # N = 2 clients, beta = 2, rho = 0.5, w^0 = (1, 1).
    # Round 1: D^0 = 0, so w~ = w = (1, 1). Uploads w_k - w~: a = (0.6, -0.8) (1 example), b = (0.2, 0.8) (3).
    #   sigma^1 = 0 - (a + b) / (beta N) = -(0.8, 0) / 4 = (-0.2, 0)
    #   mean update = (1 a + 3 b) / 4 = (1.2, 1.6) / 4 = (0.3, 0.4); D^1 = -(0.3, 0.4), ||D^1|| = 0.5
    #   w^1 = w^0 - D^1 - beta sigma^1 = (1.3, 1.4) + (0.4, 0) = (1.7, 1.4)
    # Round 2: w~ = w^1 + rho D^1 / ||D^1|| = (1.7, 1.4) - (0.3, 0.4) = (1.4, 1.0). Only a: (0.2, 0.1).
    #   sigma^2 = (-0.2, 0) - (0.2, 0.1) / 4 = (-0.25, -0.025)
    #   w^2 = w^1 + (0.2, 0.1) - beta sigma^2 = (1.9, 1.5) + (0.5, 0.05) = (2.4, 1.55)  (at the unperturbed w^1)
    server = build_algorithm(AlgorithmConfig(name="fedgloss", options={"rho": 0.5, "beta": 2.0}), 2, num_clients=2)
    w0 = torch.tensor([1.0, 1.0])
    assert _sent_model(server, w0, 1) == [1.0, 1.0]
    payloads = server.aggregate(_uploads(server, {"a": ([0.6, -0.8], 1), "b": ([0.2, 0.8], 3)}))
    outcome = server.server_update(w0, payloads)
    assert outcome.state["sigma"].tolist() == pytest.approx([-0.2, 0.0])
    assert outcome.state["pseudo_gradient"].tolist() == pytest.approx([-0.3, -0.4])
    assert outcome.model.tolist() == pytest.approx([1.7, 1.4])
    server.commit(outcome, payloads)

    w1 = outcome.model
    assert _sent_model(server, w1, 2) == pytest.approx([1.4, 1.0]), "the perturbed model travels"
    assert server.evaluated_model(w1) is w1, "the server validates and exports the unperturbed one"
    payloads = server.aggregate(_uploads(server, {"a": ([0.2, 0.1], 1)}))
    outcome = server.server_update(w1, payloads)
    assert outcome.state["sigma"].tolist() == pytest.approx([-0.25, -0.025])
    assert outcome.model.tolist() == pytest.approx([2.4, 1.55])
    assert outcome.metrics["sigma_norm"] == pytest.approx(np.hypot(0.25, 0.025))

    restored = build_algorithm(server.cfg, 2, num_clients=2)
    restored.load_state_dict(server.state_dict())
    assert _sent_model(restored, w1, 2) == pytest.approx([1.4, 1.0]), "the pseudo-gradient is checkpointed"


class Point(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))


class Engine:
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass


def test_a_client_step_adds_the_admm_terms_at_the_unperturbed_point_and_keeps_its_dual():
    # w~ = (1, 2), sigma_k = (0.5, -0.5), beta = 2, local SAM rho_l = 0.5; the client is at w = (2, 2).
    # f(w) = ||w - (-1, -2)||^2 / 2: g = (3, 4), e = 0.5 (3, 4) / 5 = (0.3, 0.4), g(w + e) = (3.3, 4.4).
    # ADMM (line 15): - sigma_k + (w - w~) / beta = (-0.5, 0.5) + (0.5, 0) = (0, 0.5), at w, not at w + e.
    # Gradient: (3.3, 4.9). Dual (line 19) after the round ends at (1.6, 2.4):
    # sigma_k - (w_E - w~) / beta = (0.5, -0.5) - (0.6, 0.4) / 2 = (0.2, -0.7); upload (0.6, 0.4).
    cfg = AlgorithmConfig(name="fedgloss", sam={"rho": 0.5}, options={"beta": 2.0})
    model = Point()
    client = build_algorithm(cfg, ParameterLayout.of(model))
    arrays, how = build_algorithm(cfg, 2).send(torch.tensor([1.0, 2.0]), 1, ["a"], torch.Generator())["a"]
    state = {"dual": np.array([0.5, -0.5], np.float32)}
    received, state = client.receive("a", arrays, {**how, "round": 1}, state)
    client.shared.assign(model, received["model"])
    local = client.local_round("a", received, model, state, 0.1)
    hooks = client.hooks(local)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([2.0, 2.0]))

    def forward(batch):
        return StepOutput({"loss": 0.5 * ((model.weight - torch.tensor([-1.0, -2.0])) ** 2).sum()})

    output = micro_step(Engine(), forward, None, hooks.around_gradient, hooks.regulariser, hooks.ascent)
    assert model.weight.grad.tolist() == pytest.approx([3.3, 4.9])
    # The logged loss is the task's at w + e (the real pass), without the ADMM term: (3.3^2 + 4.4^2) / 2.
    assert output.losses["loss"].item() == pytest.approx(15.125)
    update = client.finish_local(local, torch.tensor([1.6, 2.4]), 1)
    assert update.payloads["update"].tolist() == pytest.approx([0.6, 0.4])
    assert state["dual"].tolist() == pytest.approx([0.2, -0.7])


def test_both_radii_warm_up_linearly_from_rho0():
    # T_s = 4, rho0 = 0.1: round t has rho0 + min(t - 1, 4) (rho - rho0) / 4.
    options = FedGloSSOptions(rho=0.5, warmup_rounds=4, rho0=0.1)
    assert [scheduled_radius(0.5, options, t) for t in (1, 3, 5, 9)] == pytest.approx([0.1, 0.3, 0.5, 0.5])
    assert scheduled_radius(0.5, FedGloSSOptions(rho=0.5), 1) == 0.5, "no warm-up: the radius from round 1"
    cfg = AlgorithmConfig(name="fedgloss", sam={"rho": 0.9}, options={"warmup_rounds": 4, "rho0": 0.1})
    client = build_algorithm(cfg, 2)
    arrays, how = client.send(torch.zeros(2), 3, ["a"], torch.Generator())["a"]
    client.receive("a", arrays, {**how, "round": 3}, {})
    assert client.local_sam().rho == pytest.approx(0.5), "the local radius follows the round's schedule"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"beta": 0}, r"options\.beta: .*greater than 0"),
        ({"rho_s": 0.1}, r"options\.rho_s: unknown key \(did you mean rho or rho0\?\)"),
    ],
)
def test_bad_fedgloss_options_name_the_field(options, match):
    with pytest.raises(ConfigError, match=match):
        build_algorithm(AlgorithmConfig(name="fedgloss", options=options), 2, num_clients=2)


def test_the_server_update_needs_the_number_of_clients():
    server = build_algorithm(AlgorithmConfig(name="fedgloss"), 2)
    payloads = server.aggregate(_uploads(server, {"a": ([0.1, 0.2], 1)}))
    with pytest.raises(ConfigError, match="number of clients"):
        server.server_update(torch.zeros(2), payloads)


def test_fedgloss_refuses_central_privacy_whose_mean_its_dual_would_bypass():
    """sigma sums the raw accepted updates: under central privacy that sum would leave the accountant's mechanism."""
    privacy = {"clip": 1.0, "noise_multiplier": 1.0, "seed": 0}
    with pytest.raises(ConfigError, match="privacy: fedgloss's dual"):
        build_algorithm(
            AlgorithmConfig.model_validate({"name": "fedgloss", "privacy": {"mode": "central", **privacy}}), 4
        )
    build_algorithm(AlgorithmConfig.model_validate({"name": "fedgloss", "privacy": {"mode": "local", **privacy}}), 4)
