"""SWA's cyclical server rate and running average, and WiMA's window, against values worked by hand."""

import copy

import pytest
import torch

from geofm.config.algorithm import AlgorithmConfig
from geofm.errors import ConfigError
from geofm.fl.aggregation.uploads import ClientUpload
from geofm.fl.algorithms import build_algorithm
from geofm.fl.communication.codec import Codec


def _round(server, rnd: int, model: torch.Tensor, delta: list[float], keep: bool = True):
    """One server round on a single upload ``delta`` (32 bits, weight 1); the outcome, kept or discarded."""
    server.begin_round(rnd)
    payloads = server.aggregate([ClientUpload("a", {"update": Codec(bits=32).encode(torch.tensor(delta))}, 1)])
    outcome = server.server_update(model, payloads)
    if keep:
        server.commit(outcome, payloads)
    else:
        server.discard()
    return outcome


def test_the_cyclical_server_rate_falls_linearly_within_each_cycle():
    # start 3, cycle 4, lr_max 1, lr_min 0.2: rounds 1-2 are FedAvg's (1); then t = 1/4, 2/4, 3/4, 1 and
    # rho = (1 - t) 1 + t 0.2 = 0.8, 0.6, 0.4, 0.2, and again from round 7.
    options = {"start": 3, "cycle": 4, "lr_max": 1.0, "lr_min": 0.2}
    swa = build_algorithm(AlgorithmConfig(name="swa", options=options), 2)
    rates = [swa.server_lr(r) for r in range(1, 11)]
    assert rates == pytest.approx([1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.8, 0.6, 0.4, 0.2])
    # Unset start: after int(0.75 * rounds) FedAvg rounds, the paper's; the paper's cycle is 10 rounds.
    assert build_algorithm(AlgorithmConfig(name="swa"), 2, num_rounds=10).start == 8
    assert build_algorithm(AlgorithmConfig(name="swa"), 2, num_rounds=10000).start == 7501


def test_swa_scales_the_server_step_and_averages_each_cycles_last_model():
    # start 2, cycle 2, lr 1 -> 0.5: rho = 1 (round 1), 0.75, 0.5, 0.75, 0.5. Delta = (1, 2) each round, x0 = 0:
    # x1 = (1, 2); x2 = x1 + 0.75 Delta = (1.75, 3.5); x3 = x2 + 0.5 Delta = (2.25, 4.5), the end of a cycle:
    # w_swa = x3, n = 1; x4 = (3, 6); x5 = (3.5, 7), a cycle's end: w_swa = (1 * x3 + x5) / 2 = (2.875, 5.75).
    options = {"start": 2, "cycle": 2, "lr_max": 1.0, "lr_min": 0.5}
    server = build_algorithm(AlgorithmConfig(name="swa", options=options), 2, num_rounds=5)
    model, evaluated, logged = torch.zeros(2), [], []
    for rnd in range(1, 6):
        outcome = _round(server, rnd, model, [1.0, 2.0])
        model = outcome.model
        evaluated.append(server.evaluated_model(model).tolist())
        logged.append((outcome.metrics["server_lr"], outcome.metrics["swa_models"]))
    assert model.tolist() == [3.5, 7.0]
    assert logged == [(1.0, 0.0), (0.75, 0.0), (0.5, 1.0), (0.75, 1.0), (0.5, 2.0)]
    # No average before the first cycle's end: the training model; then the average, whatever the training model.
    assert evaluated == [[1.0, 2.0], [1.75, 3.5], [2.25, 4.5], [2.25, 4.5], [2.875, 5.75]]


def test_the_cyclical_rate_scales_the_server_optimisers_rate():
    # fedavgm: v <- 0.9 v + Delta; x <- x + lr v. A constant rho = 0.5 (lr_max = lr_min, cycle 1) on lr 1
    # moves the model as lr 0.5 does.
    momentum = {"name": "fedavgm", "lr": 1.0, "options": {"momentum": 0.9}}
    options = {"start": 1, "cycle": 1, "lr_max": 0.5, "lr_min": 0.5}
    swa = build_algorithm(AlgorithmConfig(name="swa", server_optimizer=momentum, options=options), 2)
    half = build_algorithm(AlgorithmConfig(name="fedavg", server_optimizer={**momentum, "lr": 0.5}), 2)
    a = b = torch.zeros(2)
    for rnd, delta in enumerate([[1.0, -1.0], [0.5, 2.0], [-1.0, 1.0]], start=1):
        a, b = _round(swa, rnd, a, delta).model, _round(half, rnd, b, delta).model
    assert torch.allclose(a, b)
    # v = (1, -1), (1.4, 1.1), (0.26, 1.99); x = 0.5 (sum of v) = (1.33, 1.045).
    assert torch.allclose(a, torch.tensor([1.33, 1.045]))


def test_a_discarded_swa_round_changes_nothing_and_the_state_resumes():
    options = {"start": 1, "cycle": 1, "lr_max": 1.0, "lr_min": 0.5}
    cfg = AlgorithmConfig(
        name="swa", server_optimizer={"name": "fedavgm", "options": {"momentum": 0.9}}, options=options
    )
    server = build_algorithm(cfg, 2, num_rounds=3)
    model = _round(server, 1, torch.zeros(2), [1.0, 1.0]).model
    saved = copy.deepcopy(server.state_dict())  # as the server's checkpoint holds it
    _round(server, 2, model, [4.0, 0.0], keep=False)
    assert torch.equal(server.state["swa.model"], saved["state"]["swa.model"]) and int(server.state["swa.models"]) == 1
    resumed = build_algorithm(cfg, 2, num_rounds=3)
    resumed.load_state_dict(saved)
    for rnd, delta in ((2, [4.0, 0.0]), (3, [0.0, 2.0])):
        model, again = _round(server, rnd, model, delta).model, _round(resumed, rnd, model, delta).model
        assert torch.equal(model, again)
        assert torch.equal(server.evaluated_model(model), resumed.evaluated_model(model))


# x_r for rounds 1-6 (the server's model after each round, moved there by its uploads):
# first entry 3, 6, 0, 9, 3, 6; second 0, 3, 3, 0, 6, 3.
MODELS = [[3.0, 0.0], [6.0, 3.0], [0.0, 3.0], [9.0, 0.0], [3.0, 6.0], [6.0, 3.0]]


def _wima(options: dict) -> torch.Tensor:
    """The evaluated model after each of the six rounds of MODELS."""
    server = build_algorithm(AlgorithmConfig(name="wima", options=options), 2, num_rounds=6)
    model, evaluated = torch.zeros(2), []
    for rnd, target in enumerate(MODELS, start=1):
        model = _round(server, rnd, model, (torch.tensor(target) - model).tolist()).model
        assert model.tolist() == target
        evaluated.append(server.evaluated_model(model))
        if "wima.blocks" in server.state:  # memory: at most `blocks` block sums, with no storage beyond them
            kept = server.state["wima.blocks"]
            assert len(kept) <= options["blocks"] and kept.untyped_storage().nbytes() == kept.numel() * 4
    return torch.stack(evaluated)


def test_wima_averages_the_last_window_of_models_exactly_with_a_block_per_model():
    # W = 3, blocks = 3 (one model each): the mean of what there is while the window fills, then it slides:
    # r1 (3, 0); r2 ((3+6)/2, (0+3)/2) = (4.5, 1.5); r3 ((3+6+0)/3, (0+3+3)/3) = (3, 2);
    # r4 ((6+0+9)/3, (3+3+0)/3) = (5, 2); r5 ((0+9+3)/3, (3+0+6)/3) = (4, 3); r6 ((9+3+6)/3, (0+6+3)/3) = (6, 3).
    expected = [[3.0, 0.0], [4.5, 1.5], [3.0, 2.0], [5.0, 2.0], [4.0, 3.0], [6.0, 3.0]]
    torch.testing.assert_close(_wima({"window": 3, "blocks": 3}), torch.tensor(expected))


def test_wima_with_one_block_keeps_two_sums_and_is_exact_at_each_blocks_end():
    # W = 3, one block: S1 = x1 + x2 + x3 = (9, 6) once round 3 completes it; rounds 1-3 as the exact window.
    # r4 (k = 1): (S1 - S1 / 3 + x4) / 3 = ((6 + 9) / 3, (4 + 0) / 3) = (5, 4/3);
    # r5 (k = 2): (S1 / 3 + x4 + x5) / 3 = ((3 + 9 + 3) / 3, (2 + 0 + 6) / 3) = (5, 8/3);
    # r6: the second block (x4 + x5 + x6) / 3 = (6, 3), exact again.
    expected = [[3.0, 0.0], [4.5, 1.5], [3.0, 2.0], [5.0, 4 / 3], [5.0, 8 / 3], [6.0, 3.0]]
    torch.testing.assert_close(_wima({"window": 3, "blocks": 1}), torch.tensor(expected))


def test_wima_starts_at_its_start_round():
    # start 3: rounds 1-2 validate the training model; the window then holds x3, x3..x4, x3..x5, x4..x6.
    expected = [[3.0, 0.0], [6.0, 3.0], [0.0, 3.0], [4.5, 1.5], [4.0, 3.0], [6.0, 3.0]]
    torch.testing.assert_close(_wima({"start": 3, "window": 3, "blocks": 3}), torch.tensor(expected))


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError, match=r"options: window 100 is not a multiple of blocks 3"):
        build_algorithm(AlgorithmConfig(name="wima", options={"blocks": 3}), 2)
    with pytest.raises(ConfigError, match=r"options: lr_min 2.0 is above lr_max 1.0"):
        build_algorithm(AlgorithmConfig(name="swa", options={"lr_min": 2.0}), 2)
    with pytest.raises(ConfigError, match=r"options.cycle: Input should be greater than or equal to 1"):
        build_algorithm(AlgorithmConfig(name="swa", options={"cycle": 0}), 2)
    with pytest.raises(ConfigError, match=r"options.start: round 7 is after the run's last round 6"):
        build_algorithm(AlgorithmConfig(name="wima", options={"start": 7}), 2, num_rounds=6)
