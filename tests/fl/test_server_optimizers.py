"""Server optimisers against values worked out by hand from Reddi et al. 2021, Algorithm 2."""

from __future__ import annotations

import math

import pytest
import torch

from geofm.config.algorithm import ServerOptimizerConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.server_optimizers import SERVER_OPTIMIZERS, build_server_optimizer


def _run(cfg: dict, updates: list[list[float]], model: list[float]) -> list[list[float]]:
    options = {key: value for key, value in cfg.items() if key not in ("name", "lr")}
    shared = {key: value for key, value in cfg.items() if key in ("name", "lr")}
    optimizer = build_server_optimizer(ServerOptimizerConfig(**shared, options=options), len(model))
    x, models = torch.tensor(model), []
    for update in updates:
        x = optimizer.step(x, torch.tensor(update))
        models.append(x.tolist())
    return models


def test_sgd_at_lr_1_is_exactly_the_fedavg_step() -> None:
    generator = torch.Generator().manual_seed(0)
    model, update = torch.randn(1000, generator=generator), 1e-3 * torch.randn(1000, generator=generator)
    optimizer = build_server_optimizer(ServerOptimizerConfig(), 1000)
    assert torch.equal(optimizer.step(model, update), model + update)
    assert _run({"lr": 0.5}, [[2.0, -4.0]], [1.0, 2.0]) == [[2.0, 0.0]]


def test_fedavgm_accumulates_momentum() -> None:
    # v1 = 1, x1 = 0 + 2 * 1 = 2; v2 = 0.5 + 1 = 1.5, x2 = 2 + 3 = 5; v3 = 0.75 - 2 = -1.25, x3 = 5 - 2.5 = 2.5
    models = _run({"name": "fedavgm", "lr": 2.0, "momentum": 0.5}, [[1.0], [1.0], [-2.0]], [0.0])
    assert models == [[2.0], [5.0], [2.5]]


ADAPTIVE = {"lr": 0.1, "beta1": 0.5, "beta2": 0.75, "tau": 0.5}
UPDATES = [[2.0, 0.25], [2.0, 0.25], [-1.0, 0.0]]


def _expected(yogi: bool) -> list[list[float]]:
    """Algorithm 2 by hand, coordinate by coordinate: m starts at 0, v at tau^2 = 0.25, no bias correction."""
    rows = []
    for coordinate in range(2):
        m, v, x, xs = 0.0, 0.25, 0.0, []
        for update in (u[coordinate] for u in UPDATES):
            m = 0.5 * m + 0.5 * update
            square = update * update
            if yogi:
                v -= 0.25 * square * ((v > square) - (v < square))
            else:
                v = 0.75 * v + 0.25 * square
            x += 0.1 * m / (math.sqrt(v) + 0.5)
            xs.append(x)
        rows.append(xs)
    return [list(r) for r in zip(*rows, strict=True)]


def test_fedadam_and_fedyogi_follow_the_paper_without_bias_correction() -> None:
    adam = _run({"name": "fedadam", **ADAPTIVE}, UPDATES, [0.0, 0.0])
    yogi = _run({"name": "fedyogi", **ADAPTIVE}, UPDATES, [0.0, 0.0])
    # Round 1 by hand: m = (1, 0.125); Adam v = 0.75 * 0.25 + 0.25 * (4, 0.0625) = (1.1875, 0.203125);
    # Yogi v = 0.25 -/+ 0.25 * (4, 0.0625) = (1.25, 0.234375), as Delta^2 is above / below v.
    assert adam[0] == pytest.approx([0.1 * 1 / (math.sqrt(1.1875) + 0.5), 0.1 * 0.125 / (math.sqrt(0.203125) + 0.5)])
    assert yogi[0] == pytest.approx([0.1 * 1 / (math.sqrt(1.25) + 0.5), 0.1 * 0.125 / (math.sqrt(0.234375) + 0.5)])
    torch.testing.assert_close(torch.tensor(adam), torch.tensor(_expected(yogi=False)))
    torch.testing.assert_close(torch.tensor(yogi), torch.tensor(_expected(yogi=True)))
    assert adam[2] != pytest.approx(yogi[2])


def test_fedadam_is_not_torch_adam_which_corrects_the_bias() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    adam = torch.optim.Adam([param], lr=0.1, betas=(0.5, 0.75), eps=0.5)
    for update in UPDATES:
        param.grad = -torch.tensor(update)
        adam.step()
    ours = _run({"name": "fedadam", **ADAPTIVE}, UPDATES, [0.0, 0.0])[-1]
    assert ours != pytest.approx(param.detach().tolist(), rel=1e-2)


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi"])
def test_the_state_dict_carries_the_optimiser_across_a_restart(name: str) -> None:
    cfg = ServerOptimizerConfig(name=name, lr=0.1)
    first, second = build_server_optimizer(cfg, 2), build_server_optimizer(cfg, 2)
    x = torch.zeros(2)
    for update in UPDATES[:2]:
        x = first.step(x, torch.tensor(update))
    second.load_state_dict(first.state_dict())
    last = torch.tensor(UPDATES[2])
    assert torch.equal(first.step(x, last), second.step(x, last))
    fresh = build_server_optimizer(cfg, 2)
    assert not torch.equal(fresh.step(x, last), second.step(x, last)), "the state changes the step"


def test_an_unknown_name_lists_the_nearest() -> None:
    with pytest.raises(ConfigError, match="did you mean 'fedadam'"):
        SERVER_OPTIMIZERS.get("fedadm")
