"""SAM and ASAM against steps worked by hand, their random draws, their place inside FedSense's drift
perturbation, their steps on a real engine with AdamW and accumulation, and the ``algorithm.sam`` section."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from timm.layers import DropPath
from torch import nn

from geofm.config.algorithm import AlgorithmConfig
from geofm.config.federated import LocalTrainConfig
from geofm.errors import ConfigError
from geofm.fl.algorithms import build_algorithm
from geofm.fl.local.sharpness import SharpnessAscent, asam_scaled
from geofm.fl.parameter_vectors import ParameterLayout
from geofm.tasks import StepOutput
from geofm.training import engine as ds
from geofm.training.loop import TrainLoop, micro_step


class Engine:
    """Stands in for the DeepSpeed engine: plain backward into ``.grad``, no optimizer step."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass


class Weights(nn.Module):
    def __init__(self, weight: list[float], bias: list[float] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(weight))
        if bias is not None:
            self.bias = nn.Parameter(torch.tensor(bias))


def _hooks(model: nn.Module, anchor: list[float], **algorithm):
    """The hooks ``algorithm.hooks`` gives a client training ``model`` from the global model ``anchor``."""
    algorithm = build_algorithm(AlgorithmConfig(**algorithm), ParameterLayout.of(model))
    local = algorithm.local_round("c", {"model": torch.tensor(anchor)}, model, {}, 0.1)
    return algorithm.hooks(local)


def test_sam_takes_the_gradient_at_w_plus_e_and_leaves_w_as_it_was():
    # L(w) = (w1^2 + 2 w2^2) / 2 at w = (3, 2): g = (3, 4), ||g|| = 5; rho = 0.5: e = 0.5 (3, 4) / 5 = (0.3, 0.4);
    # the gradient at w + e = (3.3, 2.4) is (3.3, 4.8).
    model = Weights([3.0, 2.0])
    seen = []

    def forward(batch):
        seen.append(model.weight.detach().clone().tolist())
        return StepOutput({"loss": 0.5 * (model.weight[0] ** 2 + 2 * model.weight[1] ** 2)})

    hooks = _hooks(model, [3.0, 2.0], name="fedsam", sam={"rho": 0.5})
    micro_step(Engine(), forward, None, hooks.around_gradient, hooks.regulariser, hooks.ascent)
    assert seen == [[3.0, 2.0], pytest.approx([3.3, 2.4])]
    assert model.weight.grad.tolist() == pytest.approx([3.3, 4.8])
    assert model.weight.tolist() == [3.0, 2.0]
    with SharpnessAscent([model.weight], 0.5)(lambda: forward(None).losses["loss"]) as norm:
        assert float(norm) == pytest.approx(5.0)


def test_asam_scales_the_weights_by_abs_w_plus_eta_and_leaves_the_biases_unscaled():
    # L = ||w - (0, -2.5)||^2 / 2 + (b + 5)^2 / 2 at w = (1.5, -0.5), b = 1: g_w = (1.5, 2), g_b = 6.
    # eta = 0.5: T_w = |w| + eta = (2, 1) on "weight", 1 on "bias" (the official code's rule).
    # T g = (3, 2, 6), ||T g|| = 7; rho = 0.7: e = 0.1 T^2 g = (0.6, 0.2 | 0.6).
    # The gradient at w + e = (2.1, -0.3), b + e = 1.6: (2.1, 2.2 | 6.6).
    model = Weights([1.5, -0.5], [1.0])

    def forward(batch):
        w, b = model.weight, model.bias
        return StepOutput({"loss": 0.5 * ((w - torch.tensor([0.0, -2.5])) ** 2).sum() + 0.5 * ((b + 5) ** 2).sum()})

    assert asam_scaled(["stages.0.weight", "stages.0.bias", "relative_position_bias_table"]) == [True, False, False]
    hooks = _hooks(model, [1.5, -0.5, 1.0], name="fedasam", sam={"rho": 0.7, "eta": 0.5})
    micro_step(Engine(), forward, None, hooks.around_gradient, hooks.regulariser, hooks.ascent)
    assert model.weight.grad.tolist() == pytest.approx([2.1, 2.2])
    assert model.bias.grad.tolist() == pytest.approx([6.6])
    assert model.weight.tolist() == [1.5, -0.5] and model.bias.tolist() == [1.0]


def test_a_zero_gradient_moves_nothing_and_bf16_parameters_come_back_bit_for_bit():
    model = Weights([1.0, -2.0], [3.0])  # the bias takes no part in the loss: its gradient is None

    def flat() -> torch.Tensor:
        return (0 * model.weight).sum()

    with SharpnessAscent(list(model.parameters()), 0.5)(flat) as norm:
        assert model.weight.tolist() == [1.0, -2.0] and model.bias.tolist() == [3.0] and float(norm) == 0.0

    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(64).to(torch.bfloat16))
    before = weight.detach().clone()

    def cubic() -> torch.Tensor:
        return (weight.float() ** 3).sum()

    with SharpnessAscent([weight], 0.05, eta=0.01)(cubic):
        assert not torch.equal(weight.detach(), before)
    assert torch.equal(weight.detach(), before)


def test_the_first_forward_draws_the_same_masks_drop_path_and_mixing_as_the_real_one():
    model, drop = Weights([1.0] * 8), DropPath(0.5).train()
    draws = []

    def forward(batch):
        mask = torch.rand(8) < 0.6  # a masked-image-modelling mask drawn in the forward
        lam = np.random.beta(1.0, 1.0)  # timm's Mixup draws its mixing ratio from numpy
        x = drop(model.weight.expand(6, 8))  # drop path: whole samples dropped
        draws.append((mask, lam, x.detach() != 0))
        return StepOutput({"loss": (x * mask).sum() * lam})

    torch.manual_seed(0)
    np.random.seed(0)
    micro_step(Engine(), forward, None, ascent=SharpnessAscent([model.weight], 0.1))
    after = torch.get_rng_state(), np.random.get_state()[1].copy()
    (mask_a, lam_a, kept_a), (mask_b, lam_b, kept_b) = draws
    assert kept_a.any() and not kept_a.all(), "some samples dropped, some kept"
    assert torch.equal(mask_a, mask_b) and lam_a == lam_b and torch.equal(kept_a, kept_b)
    torch.manual_seed(0)
    np.random.seed(0)
    forward(None)
    assert torch.equal(torch.get_rng_state(), after[0]) and np.array_equal(np.random.get_state()[1], after[1]), (
        "the random stream goes on as after one forward"
    )


def test_under_fedsense_the_drift_perturbation_comes_first_and_sam_ascends_from_there():
    # w = (3, 2), global Theta = (3, -2): d = (0, 4), lambda = 1: e_drift = (0, 1), w + e_drift = (3, 3).
    # L(w) = (w1^2 + (w2 + 1)^2) / 2: g(3, 3) = (3, 4), ||g|| = 5, rho = 0.5: e_sam = (0.3, 0.4);
    # gradient used = grad L(3.3, 3.4) = (3.3, 4.4), applied at w = (3, 2).
    # (SAM first would ascend along g(w) = (3, 3) instead.)
    model = Weights([3.0, 2.0])
    seen = []

    def forward(batch):
        seen.append(model.weight.detach().clone().tolist())
        w = model.weight
        return StepOutput({"loss": 0.5 * (w[0] ** 2 + (w[1] + 1) ** 2)})

    hooks = _hooks(model, [3.0, -2.0], name="fedsense", options={"perturbation_radius": 1.0}, sam={"rho": 0.5})
    micro_step(Engine(), forward, None, hooks.around_gradient, hooks.regulariser, hooks.ascent)
    assert seen == [[3.0, 3.0], pytest.approx([3.3, 3.4])]
    assert model.weight.grad.tolist() == pytest.approx([3.3, 4.4])
    assert model.weight.tolist() == [3.0, 2.0]


class Distance(nn.Module):
    """``||w - m||^2 / 2``; ``sam_by_hand`` scales it so that its gradient at w is SAM's: with
    e = rho (w - m) / ||w - m||, grad L(w + e) = w + e - m = (1 + rho / ||w - m||) (w - m)."""

    def __init__(self, rho: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.3, 0.2, -0.1]))
        self.rho = rho

    def forward(self, target: torch.Tensor, sam_by_hand: bool) -> torch.Tensor:
        diff = self.weight - target
        scale = 1 + self.rho / diff.detach().norm() if sam_by_hand else 1.0
        return 0.5 * scale * diff.pow(2).sum()


def test_sam_on_the_engine_takes_adamw_steps_on_the_sam_gradient_through_accumulation():
    """Two steps of two micro-batches each: the engine with the ascent ends where an engine fed SAM's
    gradient by hand ends (AdamW, clipping, accumulation untouched by the first gradient)."""
    rho = 0.4
    train = LocalTrainConfig(micro_batch_size=1, grad_accum_steps=2, local_epochs=None, local_steps=2, precision="fp32")
    targets = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([-1.0, 0.0, 2.0])]
    ends = []
    for by_hand in (False, True):
        engine = ds.initialize(Distance(rho), train, 1, None, 0.05)
        ascent = None if by_hand else SharpnessAscent([engine.module.weight], rho)
        loop = TrainLoop(
            engine, lambda m, e=engine, h=by_hand: StepOutput({"loss": e(m, h)}), seed_of=lambda s: s, ascent=ascent
        )
        assert loop.local_steps([targets, targets])[1] == 2
        ends.append(engine.module.weight.detach().clone())
    assert not torch.allclose(ends[0], torch.tensor([0.3, 0.2, -0.1]))
    torch.testing.assert_close(ends[0], ends[1], rtol=1e-6, atol=1e-7)


def test_algorithms_take_their_papers_radii_and_any_algorithm_takes_sam():
    def sam(**algorithm):
        return build_algorithm(AlgorithmConfig(**algorithm), 3).local_sam()

    assert sam(name="fedavg") is None
    assert (sam(name="fedsam").rho, sam(name="fedsam").adaptive) == (0.1, False)
    assert (sam(name="fedasam").rho, sam(name="fedasam").adaptive, sam(name="fedasam").eta) == (0.7, True, 0.2)
    kept = sam(name="fedasam", sam={"rho": 0.05})
    assert (kept.rho, kept.adaptive, kept.eta) == (0.05, True, 0.2), "the fields sam leaves out stay the paper's"
    written = AlgorithmConfig(name="fedasam", sam={"rho": 0.05}).model_dump(mode="json")
    again = build_algorithm(AlgorithmConfig.model_validate(written), 3).local_sam()
    assert again == kept, "a config written out and read back (each node's copy) means the same"
    assert (sam(name="fedavg", sam={"rho": 0.1}).adaptive, sam(name="fedavg", sam={"rho": 0.1}).eta) == (False, 0.01)
    assert sam(name="fedavg", sam={"rho": 0.1, "adaptive": True}).eta == 0.01
    assert sam(name="fedgloss").rho == 0.15
    assert sam(name="scaffold", sam={"rho": 0.02}).rho == 0.02


@pytest.mark.parametrize(
    ("algorithm", "error", "match"),
    [
        ({"name": "fedavg", "sam": {"rho": 0.0}}, ValidationError, r"sam\.rho\n.*greater than 0"),
        ({"name": "fedasam", "sam": {"eta": -0.1}}, ValidationError, r"sam\.eta\n.*greater than or equal to 0"),
        ({"name": "fedsam", "sam": {"rhoo": 0.1}}, ValidationError, r"sam\.rhoo\n.*Extra inputs"),
        ({"name": "fedavg", "sam": {}}, ConfigError, r"algorithm\.sam\.rho: fedavg has no default radius"),
        ({"name": "fedavg", "sam": {"rho": 0.1, "eta": 0.1}}, ConfigError, r"algorithm\.sam\.eta: .*adaptive: true"),
        ({"name": "fedsam", "sam": {"adaptive": True}}, ConfigError, r"algorithm\.sam\.adaptive: .*name fedasam"),
        ({"name": "fedasam", "sam": {"adaptive": False}}, ConfigError, r"algorithm\.sam\.adaptive: .*name fedsam"),
    ],
)
def test_bad_sam_settings_name_the_field(algorithm, error, match):
    with pytest.raises(error, match=match):
        build_algorithm(AlgorithmConfig(**algorithm), 3)
