"""Dense losses: means over the scored pixels only; a batch without one is a loss of 0 that still backpropagates."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from geofm.config.finetune_data import PADDING_LABEL
from geofm.tasks.finetuning import task_of
from geofm.tasks.finetuning.model import build_finetune_model


def _unscored_target(task: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A target of a batch without any scored pixel: ignore_index 255 (segmentation), padding (change, superres)."""
    if task == "segmentation":
        return torch.full(shape, 255)
    if task == "change":
        return torch.full(shape, PADDING_LABEL)
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("task", ["segmentation", "change", "superres"])
def test_a_batch_without_a_scored_pixel_is_a_zero_loss_with_zero_gradients(task, task_config):
    cfg = task_config(task)  # segmentation: ignore_index 255; change and superres: none
    torch.manual_seed(0)
    model, _ = build_finetune_model(cfg)
    criterion = task_of(cfg).criterion
    inputs = [torch.randn(2, 4, 32, 32) for _ in range(2 if task == "change" else 1)]
    unscored = _unscored_target(task, (2, 4, 64, 64) if task == "superres" else (2, 32, 32))
    scored = torch.randn(unscored.shape) if task == "superres" else torch.zeros_like(unscored)

    def gradients(target: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = criterion(model(*inputs).float(), target)
        loss.backward()
        return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = gradients(unscored)
    assert math.isfinite(loss) and loss == 0.0, f"{task}: loss {loss}"
    reached = set(gradients(scored)[1])
    assert set(grads) == reached, f"{task}: the graph must reach what a labelled batch reaches, {reached - set(grads)}"
    assert all(bool((g == 0).all()) for g in grads.values()), f"{task}: an unscored batch must not move weights"


def test_cross_entropy_is_the_mean_over_the_real_labelled_pixels(task_config):
    cfg = task_config("change")  # no ignore_index: padding is the only unscored value
    torch.manual_seed(1)
    logits = torch.randn(2, 2, 8, 8, requires_grad=True)
    target = torch.full((2, 8, 8), PADDING_LABEL)
    target[0, :3, :5] = torch.randint(0, 2, (3, 5))
    loss = task_of(cfg).criterion(logits, target)
    real = F.cross_entropy(logits[0, :, :3, :5][None], target[0, :3, :5][None])
    assert float(loss.detach()) == pytest.approx(float(real.detach())), "padding and the all-padding image add nothing"


def test_l1_is_the_mean_over_the_unpadded_target(task_config):
    cfg = task_config("superres")
    torch.manual_seed(2)
    outputs = torch.randn(2, 4, 16, 16, requires_grad=True)
    target = torch.full((2, 4, 16, 16), float("nan"))
    target[:, :, :6, :10] = torch.randn(2, 4, 6, 10)
    loss = task_of(cfg).criterion(outputs, target)
    assert float(loss.detach()) == pytest.approx(
        float(F.l1_loss(outputs[:, :, :6, :10], target[:, :, :6, :10]).detach())
    )
    loss.backward()
    assert bool(outputs.grad.isfinite().all()) and bool((outputs.grad[:, :, 6:] == 0).all()), "padding gets no gradient"


def test_an_unmixed_forward_of_a_mixing_task_takes_the_one_hot_targets_smoothed_as_mixing_smooths(task_config):
    cfg = task_config("classification", finetune={"mixup": 0.8, "label_smoothing": 0.1})
    task = task_of(cfg)
    logits = torch.tensor([[2.0, 0.0, 0.0]])

    class Fixed(torch.nn.Module):
        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return logits.expand(len(image), -1)

    batch = {"image": torch.zeros(1, 4, 32, 32), "label": torch.tensor([0])}
    loss = task.forward(Fixed(), batch, torch.device("cpu"), torch.float32, mix=False).losses["loss"]
    # 3 classes, smoothing 0.1: target (1 - 0.1 + 0.1/3, 0.1/3, 0.1/3); log-softmax of (2, 0, 0) is
    # (2, 0, 0) - log(e^2 + 2) = (-0.23954, -2.23954, -2.23954); the loss is 0.93333 * 0.23954 + 2 * 0.03333 * 2.23954.
    assert float(loss) == pytest.approx(0.93333 * 0.23954 + 2 * 0.033333 * 2.23954, rel=1e-4)
