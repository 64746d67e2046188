"""DINO's objective and networks against hand computations (Caron et al. 2021, Eq. 1 and Sec. 3.1)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from geofm.tasks.dino.loss import dino_loss, entropy, teacher_momentum, teacher_temperature, updated_centre
from geofm.tasks.dino.model import DinoStudent, EmaTeacher, ProjectionHead, pooled_representation
from geofm.tasks.dino.views import MultiCrop

TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}


def _softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def _cross_entropy(p: list[float], q: list[float]) -> float:
    """``-sum p log q``."""
    return -sum(a * math.log(b) for a, b in zip(p, q, strict=True))


def test_the_loss_is_the_mean_cross_entropy_over_pairs_of_different_views_as_the_paper_writes_it():
    # One image, K = 2, two global views and one local; student temperature 0.5, teacher 0.25, centre (0.5, 0).
    student = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    teacher = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    centre = torch.tensor([0.5, 0.0])
    loss, probabilities = dino_loss(student, teacher, centre, student_temp=0.5, teacher_temp=0.25, global_views=2)

    p_t = [_softmax([2.0, 0.0]), _softmax([-2.0, 0.0])]  # (t - c) / 0.25
    p_s = [_softmax([2.0, 0.0]), _softmax([0.0, 2.0]), _softmax([1.0, 1.0])]  # s / 0.5
    pairs = [(0, 1), (0, 2), (1, 0), (1, 2)]  # (teacher's global view, student's other view)
    expected = sum(_cross_entropy(p_t[t], p_s[s]) for t, s in pairs) / len(pairs)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert probabilities.flatten().tolist() == pytest.approx(p_t[0] + p_t[1], rel=1e-6)


def test_the_loss_of_a_batch_is_the_mean_of_its_images_losses():
    torch.manual_seed(0)
    batch, views, k = 3, 4, 5
    student, teacher = torch.randn(views * batch, k), torch.randn(2 * batch, k)
    centre = torch.randn(k)
    loss, _ = dino_loss(student, teacher, centre, 0.1, 0.04, global_views=2)
    # Views are stacked view by view: image b of view v is row v * batch + b.
    singles = [
        dino_loss(student[b::batch], teacher[b::batch], centre, 0.1, 0.04, global_views=2)[0] for b in range(batch)
    ]
    assert loss.item() == pytest.approx(torch.stack(singles).mean().item(), rel=1e-5)


def test_schedules_follow_the_paper_cosine_momentum_and_linear_temperature_warm_up():
    assert teacher_momentum(0.0, 0.996) == pytest.approx(0.996)
    assert teacher_momentum(0.5, 0.996) == pytest.approx(1 - 0.004 * 0.5)
    assert teacher_momentum(1.0, 0.996) == pytest.approx(1.0)
    assert teacher_temperature(0.0, 0.04, 0.07, warmup=0.3) == pytest.approx(0.04)
    assert teacher_temperature(0.15, 0.04, 0.07, warmup=0.3) == pytest.approx(0.055)
    assert teacher_temperature(0.6, 0.04, 0.07, warmup=0.3) == pytest.approx(0.07)
    assert teacher_temperature(0.0, 0.04, 0.07, warmup=0.0) == pytest.approx(0.07)
    centre = updated_centre(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), momentum=0.9)
    assert centre.tolist() == pytest.approx([0.9, 0.2])
    assert entropy(torch.tensor([[0.5, 0.5]])).item() == pytest.approx(math.log(2))


def test_the_head_normalises_its_bottleneck_and_its_last_layers_rows():
    torch.manual_seed(0)
    head = ProjectionHead(8, 16, hidden_dim=12, bottleneck_dim=6, layers=3)
    with torch.no_grad():
        head.last_layer.weight.mul_(5.0)  # row norms do not matter with norm_last_layer
    x = torch.randn(4, 8)
    bottleneck = nn.functional.normalize(head.mlp(x), dim=-1)
    rows = nn.functional.normalize(head.last_layer.weight, dim=1)
    assert torch.allclose(head(x), bottleneck @ rows.T, atol=1e-6)
    assert len([m for m in head.mlp if isinstance(m, nn.Linear)]) == 3
    assert head(x).abs().max() <= 1.0 + 1e-6  # cosines of unit vectors


@pytest.fixture
def student():
    from geofm.models.backbones import backbone_kwargs, create_backbone

    kwargs = backbone_kwargs(in_chans=4, img_size=32, window_size=4, timm_kwargs=TINY_SWIN)
    encoder = create_backbone("swin_tiny_patch4_window7_224", {**kwargs, "dynamic_img_size": True})
    torch.manual_seed(0)
    return DinoStudent(encoder, ProjectionHead(encoder.num_features, 10, hidden_dim=8, bottleneck_dim=4)).eval()


def test_the_student_runs_views_of_one_size_together_and_of_each_size_at_its_own(student):
    torch.manual_seed(1)
    views = [torch.randn(2, 4, 32, 32), torch.randn(2, 4, 32, 32), torch.randn(2, 4, 16, 16)]
    together = student(views)
    apart = torch.cat([student.head(pooled_representation(student.encoder, v)) for v in views])
    assert together.shape == (6, 10)
    assert torch.allclose(together, apart, atol=1e-5)


def test_the_teacher_is_a_float32_moving_average_of_the_student(student):
    teacher = EmaTeacher(student)
    assert not any(p.requires_grad for p in teacher.parameters())
    before = [p.clone() for p in teacher.network.parameters()]
    moved = student.to(torch.bfloat16)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1.0)
    teacher.update(moved, momentum=0.9)
    for old, new, theirs in zip(before, teacher.network.parameters(), moved.parameters(), strict=True):
        assert new.dtype == torch.float32
        assert torch.allclose(new, 0.9 * old + 0.1 * theirs.float(), atol=1e-6)


def test_multi_crop_makes_the_global_and_local_views_and_zeroes_missing_pixels():
    crops = MultiCrop(32, 16, global_views=2, local_views=3)
    image, valid = torch.randn(4, 48, 48) + 5.0, torch.ones(4, 48, 48, dtype=torch.bool)
    valid[:, :, :36] = False  # the left three quarters hold no data: every global crop meets them
    torch.manual_seed(0)
    views = crops(image, valid)
    assert views["global"].shape == (2, 4, 32, 32) and views["local"].shape == (3, 4, 16, 16)
    assert type(views["global"]) is torch.Tensor
    assert all((view.abs() < 1e-6).any() for view in views["global"])  # no data reads as 0, not as its value
    torch.manual_seed(0)
    again = crops(image, valid)
    assert torch.equal(views["global"], again["global"]) and torch.equal(views["local"], again["local"])
    assert "local" not in MultiCrop(32, 16, local_views=0)(image, valid)
