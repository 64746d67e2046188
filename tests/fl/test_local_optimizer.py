"""Each algorithm's local optimiser: its paper's by default, the config's with a warning, and why it matters
for SCAFFOLD (the control variates of option II under SGD and under AdamW)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.config.federated import LocalOptimizerConfig, LocalTrainConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm, local_optimizer
from geofm.fl.algorithms.fednova import aggregation_norm
from geofm.fl.algorithms.rounds import payload_arrays
from geofm.fl.algorithms.scaffold import SGD_BASE_LR
from geofm.fl.parameter_vectors import ParameterLayout
from geofm.tasks import StepOutput
from geofm.training import engine as ds
from geofm.training.engine_config import deepspeed_config


def _train(**fields) -> LocalTrainConfig:
    return LocalTrainConfig(micro_batch_size=4, base_lr=5e-4, weight_decay=0.05, **fields)


@pytest.mark.parametrize("name", ["scaffold", "feddc", "fednova", "fedgloss"])
def test_an_algorithm_analysed_for_sgd_trains_with_sgd_unless_told_otherwise(name):
    chosen = local_optimizer.resolve(_train(), name)
    assert chosen.name == "sgd" and chosen.base_lr == SGD_BASE_LR and chosen.momentum == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        local_optimizer.warn_override(_train(), name)


def test_an_algorithm_that_assumes_no_optimiser_keeps_adamw_with_the_train_sections_settings():
    assert local_optimizer.resolve(_train(), "fedavg") == LocalOptimizerConfig(
        name="adamw", base_lr=5e-4, weight_decay=0.05
    )
    # an SGD chosen for it is the config's own choice: no paper to depart from, so no warning
    train = _train(optimizer={"name": "sgd", "base_lr": 0.1, "momentum": 0.9})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        local_optimizer.warn_override(train, "fedavg")
    assert local_optimizer.resolve(train, "fedavg") == LocalOptimizerConfig(
        name="sgd", base_lr=0.1, momentum=0.9, weight_decay=0.05
    )


def test_an_explicit_optimiser_wins_and_the_warning_names_the_algorithm_its_assumption_and_the_choice():
    train = _train(optimizer={"name": "adamw"})
    assert local_optimizer.resolve(train, "scaffold") == LocalOptimizerConfig(
        name="adamw", base_lr=5e-4, weight_decay=0.05
    )
    with pytest.warns(local_optimizer.LocalOptimizerWarning) as caught:
        local_optimizer.warn_override(train, "scaffold")
    message = str(caught[0].message)
    assert "algorithm scaffold" in message and "Karimireddy" in message
    assert "assumes local sgd base_lr 0.05 momentum 0" in message and "chooses adamw base_lr 0.0005" in message


def test_fields_left_out_of_the_same_optimiser_come_from_the_declaration():
    train = _train(optimizer={"name": "sgd", "momentum": 0.9})
    chosen = local_optimizer.resolve(train, "fednova")
    assert (chosen.base_lr, chosen.momentum, chosen.weight_decay) == (SGD_BASE_LR, 0.9, 0.0)
    with pytest.warns(local_optimizer.LocalOptimizerWarning, match="fednova.*chooses sgd base_lr 0.05 momentum 0.9"):
        local_optimizer.warn_override(train, "fednova")
    # the declared optimiser written out in full is no override
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        local_optimizer.warn_override(_train(optimizer={"name": "sgd"}), "fednova")


def test_sgd_needs_a_learning_rate_of_its_own():
    with pytest.raises(ConfigError, match=r"train\.optimizer: sgd needs base_lr"):
        local_optimizer.resolve(_train(optimizer={"name": "sgd"}), "fedavg")
    with pytest.raises(ValueError, match="momentum is SGD's"):
        LocalOptimizerConfig(name="adamw", momentum=0.9)


def test_the_engine_builds_the_chosen_optimiser_with_its_weight_decay():
    sgd = LocalOptimizerConfig(name="sgd", base_lr=0.05, momentum=0.5, weight_decay=1e-3)
    model = nn.Linear(3, 2)
    groups = local_optimizer.with_weight_decay(
        [{"params": [model.weight], "weight_decay": 0.05}, {"params": [model.bias], "weight_decay": 0.0}], 1e-3
    )
    engine = ds.initialize(model, _train(), 1, None, 0.2, param_groups=groups, optimizer=sgd)
    optimizer = engine.optimizer
    assert isinstance(optimizer, torch.optim.SGD)
    assert [(g["lr"], g["momentum"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.2, 0.5, 1e-3),
        (0.2, 0.5, 0.0),
    ]
    adamw = LocalOptimizerConfig(name="adamw", base_lr=1, weight_decay=0)
    config = deepspeed_config(_train(), 1, None, 0.2, adamw, bf16=False, fused=True)
    assert config["optimizer"]["type"] == "AdamW" and config["optimizer"]["params"]["weight_decay"] == 0


def test_fednova_normalises_by_the_momentum_aware_length():
    assert aggregation_norm(4, 0.0) == 4
    # heavy ball: a = sum_k (1 - rho^(tau - k)) / (1 - rho) over the tau steps
    rho, tau = 0.9, 5
    assert aggregation_norm(tau, rho) == pytest.approx(sum((1 - rho ** (tau - k)) / (1 - rho) for k in range(tau)))


# ---- why SCAFFOLD needs SGD ------------------------------------------------------------------------------


class _Point(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.y = nn.Parameter(torch.zeros(size))


def _quadratic_federation(
    name: str, optimizer, lr: float, scale: float, rounds: int = 30, steps: int = 10, trace: list | None = None, **cfg
):
    """Two clients with far-apart minima and opposite curvatures, f_i(y) = scale/2 sum_j h_ij (y_j - b_ij)^2:
    ``rounds`` of ``steps`` local steps; returns the global model's distance to the federation's optimum and
    the clients' largest control variate's norm (None for FedAvg); ``trace`` gets the distance of each round."""
    size = 8
    generator = torch.Generator().manual_seed(0)
    minima = {"a": torch.randn(size, generator=generator) * 3 + 2, "b": torch.randn(size, generator=generator) * 3 - 2}
    curvature = {"a": torch.linspace(0.5, 2, size), "b": torch.linspace(2, 0.5, size)}
    optimum = sum(curvature[k] * minima[k] for k in minima) / sum(curvature.values())
    cfg = AlgorithmConfig(name=name, **cfg)
    layout = ParameterLayout.of(_Point(size))
    server, client = build_algorithm(cfg, layout, num_clients=2), build_algorithm(cfg, layout)
    x, states = torch.zeros(size), {"a": {}, "b": {}}
    for rnd in range(1, rounds + 1):
        sent = server.send(x, rnd, list(states), torch.Generator())
        uploads = []
        for name_, state in states.items():
            arrays, how = sent[name_]
            received, states[name_] = client.receive(name_, arrays, {"round": rnd, **how}, state)
            model = _Point(size)
            client.shared.assign(model, received["model"])
            local = client.local_round(name_, received, model, states[name_], lr)
            hooks = client.local_hooks(local)
            step = optimizer(model.parameters(), lr)
            for _ in range(steps):
                step.zero_grad()
                with hooks.around_gradient():
                    output = StepOutput({"loss": scale / 2 * (curvature[name_] * (model.y - minima[name_]) ** 2).sum()})
                    loss = output.losses["loss"]
                    if hooks.regulariser is not None:
                        loss = loss + hooks.regulariser(None, output)
                    loss.backward()
                step.step()
            update = client.finish_local(local, client.shared.flatten_module(model), steps)
            upload, _ = client.upload(update, states[name_], torch.Generator())
            uploads.append(ClientUpload(name_, payload_arrays(upload), 10))
        payloads = server.aggregate(uploads)
        outcome = server.server_update(x, payloads)
        server.commit(outcome, payloads)
        x = outcome.model
        if trace is not None:
            trace.append((x - optimum).norm().item())
    controls = [torch.as_tensor(s["control"]).norm().item() for s in states.values() if "control" in s]
    return (x - optimum).norm().item(), max(controls, default=None)


def _sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


def _adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_with_sgd_scaffolds_correction_removes_the_client_drift_at_any_loss_scale(scale):
    # SGD at lr 0.1 / scale takes the same steps at every scale; so do SCAFFOLD's control variates,
    # which are gradients: the correction cancels the drift that leaves FedAvg 1.6 from the optimum.
    fedavg, _ = _quadratic_federation("fedavg", _sgd, 0.1 / scale, scale)
    scaffold, control = _quadratic_federation("scaffold", _sgd, 0.1 / scale, scale)
    assert fedavg > 1.0 and scaffold < 1e-4
    assert control == pytest.approx(_quadratic_federation("scaffold", _sgd, 0.1, 1.0)[1] * scale, rel=1e-3)


def test_with_adamw_scaffolds_control_variates_ignore_the_gradients_scale_and_the_correction_swamps_it():
    # AdamW moves each coordinate by about lr whatever its gradient: option II's (x - y_i) / (K lr) is
    # the mean normalised step, O(1) per coordinate, at a loss of any scale. At the scale of a network's
    # loss (gradients ~1e-3 per coordinate, like the demo's Swin) the correction c - c_i, built from those
    # O(1) variates, outweighs the loss's gradient, and SCAFFOLD ends farther from the optimum than FedAvg
    # with the same AdamW: the demo's rising SCAFFOLD loss, and its control_norm near sqrt(parameters).
    unit, _ = _quadratic_federation("scaffold", _adamw, 0.1, 1.0)
    small, control = _quadratic_federation("scaffold", _adamw, 0.1, 1e-3)
    fedavg_small, _ = _quadratic_federation("fedavg", _adamw, 0.1, 1e-3)
    # under SGD a client's control variate converges to its gradient at the optimum: the correct size
    _, gradient = _quadratic_federation("scaffold", _sgd, 100.0, 1e-3)
    assert unit < 0.1  # at a unit scale AdamW's normalised steps happen to match the gradients' size
    assert control > 100 * gradient
    assert small > fedavg_small > 1.0


@pytest.mark.parametrize(
    ("name", "paper", "strong"),
    [
        # FedGloSS with both SAM radii all but off: beta sigma; the clients' pull is 1/beta
        ("fedgloss", {"options": {"rho": 1e-6}, "sam": {"rho": 1e-6}}, {"options": {"rho": 1e-6, "beta": 1.0}}),
        # FedDC: hbar, the mean of the clients' summed drifts; the clients' pull is alpha
        ("feddc", {}, {"options": {"alpha": 1.0}}),
    ],
)
def test_a_server_that_adds_every_past_update_overshoots_in_the_first_rounds(name, paper, strong):
    # Why FedGloSS, and FedDC on IID clients, fall below FedAvg on the demo's 8 rounds: FedGloSS's server
    # steps w - D - beta sigma with beta sigma = -(1/N) the sum of every accepted update so far, and FedDC's
    # adds hbar, the same sum: a server momentum of coefficient 1 whose size does not depend on beta or
    # alpha, while the clients' pull back is 1/beta = 0.1 (FedGloSS) or alpha = 0.01 (FedDC) of their drift.
    # With the papers' settings the global model overshoots and swings in the first rounds where FedAvg's
    # approaches the optimum every round; a stronger pull damps the swing, and the correction then removes
    # the drift FedAvg keeps.
    strong = {**paper, **strong}
    fedavg, papers, damped = [], [], []
    _quadratic_federation("fedavg", _sgd, 0.1, 1.0, rounds=30, steps=4, trace=fedavg)
    _quadratic_federation(name, _sgd, 0.1, 1.0, rounds=30, steps=4, trace=papers, **paper)
    _quadratic_federation(name, _sgd, 0.1, 1.0, rounds=30, steps=4, trace=damped, **strong)
    assert all(later < earlier for earlier, later in itertools.pairwise(fedavg[:8]))
    assert max(papers[1:4]) > 1.5 * papers[0]  # overshoot: farther from the optimum after the second round
    assert papers[7] > fedavg[7]  # the demo's 8 rounds end worse than FedAvg
    assert damped[-1] < 1e-2 < fedavg[-1]


def test_a_run_begun_under_adamw_resumes_only_if_the_config_keeps_adamw() -> None:
    sgd = {"name": "sgd", "base_lr": 0.05, "momentum": 0.0, "weight_decay": 0.0}
    local_optimizer.check_resumed(None, sgd, "scaffold", "rounds.jsonl")  # no round yet: nothing to keep
    local_optimizer.check_resumed({"round": 3, "local_optimizer": sgd}, sgd, "scaffold", "rounds.jsonl")
    # a record from before the declarations: its clients trained with AdamW
    with pytest.raises(ConfigError, match=r"trained with local adamw.*train.optimizer: \{name: adamw\}"):
        local_optimizer.check_resumed({"round": 3, "loss": 0.5}, sgd, "scaffold", "run/rounds.jsonl")
    local_optimizer.check_resumed(
        {"round": 3, "loss": 0.5}, {"name": "adamw", "base_lr": 5e-4}, "scaffold", "rounds.jsonl"
    )
