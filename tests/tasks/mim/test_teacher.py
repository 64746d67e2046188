import pytest
import torch
import torch.nn.functional as F

from geofm.tasks.mim.model import Tap, embed_tokens, run_backbone
from geofm.tasks.mim.teacher import FrozenTeacher, native_bf16, teacher_dtype


@pytest.mark.slow
def test_teacher_is_frozen_and_matches_the_full_backbone_at_its_tap(tiny_swin):
    backbone = tiny_swin(3).eval()
    images = torch.randn(2, 4, 64, 64)  # 4 bands; the teacher sees [red, green, blue] = [2, 1, 0]
    rgb = images[:, [2, 1, 0]]
    _, expected = run_backbone(backbone, embed_tokens(backbone, rgb), Tap(3, True))
    teacher = FrozenTeacher(backbone, Tap(3, True), band_indices=[2, 1, 0], img_size=64)
    teacher.train()
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    out = teacher(images)
    assert out.shape == (2, 2, 2, teacher.out_channels) and not out.is_inference()
    assert torch.allclose(out, expected, atol=1e-5)
    assert len(teacher.backbone.layers[-1].blocks) == 0, "stage-4 blocks were pruned"


def test_teacher_resizes_to_its_own_input_size(tiny_swin):
    teacher = FrozenTeacher(tiny_swin(3, img_size=96, window_size=6), Tap(3, True), [0, 1, 2], img_size=96)
    assert teacher(torch.randn(1, 3, 64, 64)).shape[1:3] == (3, 3)


def test_vit_teacher_cut_after_block(tiny_vit):
    teacher = FrozenTeacher(tiny_vit(3), Tap(2), [0, 1, 2], img_size=64)
    assert len(teacher.backbone.blocks) == 2
    assert teacher(torch.randn(1, 3, 64, 64)).shape == (1, 4, 4, 32)


@pytest.mark.slow
def test_teacher_input_is_resized_as_gfm_does(tiny_swin):
    """GFM feeds the teacher F.interpolate(x, 224, mode="bilinear", align_corners=True)."""
    backbone = tiny_swin(3, img_size=96, window_size=6).eval()
    images = torch.randn(1, 3, 64, 64)
    resized = F.interpolate(images, size=(96, 96), mode="bilinear", align_corners=True)
    _, expected = run_backbone(backbone, embed_tokens(backbone, resized), Tap(3, True))
    teacher = FrozenTeacher(backbone, Tap(3, True), [0, 1, 2], img_size=96)
    assert (teacher.resize_mode, teacher.align_corners) == ("bilinear", True)
    assert torch.allclose(teacher(images), expected, atol=1e-5)


def test_bf16_teacher_features_stay_close_to_fp32(tiny_swin):
    """bfloat16 keeps 8 mantissa bits: features within a few percent, pooled directions (what GFM distils) near equal."""
    backbone = tiny_swin(3).eval()
    exact = FrozenTeacher(backbone, Tap(3, True), [0, 1, 2], img_size=64)
    reduced = FrozenTeacher(tiny_swin(3).eval(), Tap(3, True), [0, 1, 2], img_size=64)
    reduced.load_state_dict(exact.state_dict())
    reduced.to(torch.device("cpu"), torch.bfloat16)
    images = torch.randn(4, 3, 64, 64)
    a, b = exact(images), reduced(images)
    assert b.dtype == torch.float32 and not b.is_inference(), "bf16 features must come back as plain float32"
    relative = float((a - b).norm() / a.norm())
    assert 0 < relative < 0.05, f"bf16 features differ from fp32 by {relative:.3%}"
    cosine = F.cosine_similarity(a.mean(dim=(1, 2)), b.mean(dim=(1, 2)), dim=-1)
    assert bool((cosine > 0.999).all()), f"pooled bf16 features point elsewhere: cosine {cosine.tolist()}"


def test_teacher_precision_resolves_per_device():
    cpu = torch.device("cpu")
    assert teacher_dtype("fp32", cpu) == torch.float32 and teacher_dtype("bf16", cpu) == torch.bfloat16
    assert teacher_dtype("auto", cpu) == (torch.bfloat16 if native_bf16(cpu) else torch.float32)
