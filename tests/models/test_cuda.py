"""The CUDA paths of the model code: bf16, fused attention, the teacher's precision.

Skipped without a CUDA GPU; ``python -m benchmarks.device_check`` runs them on a GPU machine, where
deepspeed, pydantic and rasterio may be missing, so this module imports none of them.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from geofm.models.backbones import prefer_fused_attention, set_fused_attention
from geofm.tasks.mim.loss import gfm_loss
from geofm.tasks.mim.model import MaskedImageModel, Tap
from geofm.tasks.mim.teacher import FrozenTeacher, teacher_dtype

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
FUSED_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("img_size", "window_size"), [(64, 4), (96, 6)])  # 16 and 36 tokens a window (Swin-B: 36)
def test_fused_swin_attention_trains_on_a_fused_kernel_and_matches_explicit_attention(tiny_swin, img_size, window_size):
    """With only the fused kernels allowed, Swin's masked window attention still runs forward and backward in bf16."""
    torch.manual_seed(0)
    explicit = tiny_swin(3, img_size=img_size, window_size=window_size).to(CUDA)
    fused = tiny_swin(3, img_size=img_size, window_size=window_size).to(CUDA)
    fused.load_state_dict(explicit.state_dict())
    set_fused_attention(explicit, False)
    prefer_fused_attention(fused, CUDA)
    assert all(m.fused_attn for m in fused.modules() if hasattr(m, "fused_attn"))
    images = torch.randn(2, 3, img_size, img_size, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = explicit.forward_features(images)
        with sdpa_kernel(FUSED_KERNELS):
            out = fused.forward_features(images)
    probe = torch.randn(expected.shape, device=CUDA)  # a loss whose gradient the final norm does not cancel
    (expected.float() * probe).mean().backward()
    with sdpa_kernel(FUSED_KERNELS):
        (out.float() * probe).mean().backward()
    assert _relative(out, expected) < 0.03
    weight = "patch_embed.proj.weight"
    grads = dict(fused.named_parameters())[weight].grad, dict(explicit.named_parameters())[weight].grad
    assert _relative(*grads) < 0.05


def test_the_teacher_runs_in_bf16_on_cuda_and_returns_float32_features_near_fp32(tiny_swin):
    assert teacher_dtype("auto", CUDA) == torch.bfloat16, "auto must pick bf16 on a GPU that computes it natively"
    torch.manual_seed(0)
    exact = FrozenTeacher(tiny_swin(3).eval(), Tap(3, True), [0, 1, 2], img_size=64).to(CUDA)
    reduced = FrozenTeacher(tiny_swin(3).eval(), Tap(3, True), [0, 1, 2], img_size=64)
    reduced.load_state_dict(exact.state_dict())
    prefer_fused_attention(reduced, CUDA)
    reduced.to(CUDA, teacher_dtype("auto", CUDA))
    images = torch.randn(4, 3, 64, 64, device=CUDA)
    a, b = exact(images), reduced(images)
    assert b.dtype == torch.float32 and not b.is_inference()
    assert _relative(b, a) < 0.05
    cosine = F.cosine_similarity(a.mean(dim=(1, 2)), b.mean(dim=(1, 2)), dim=-1)
    assert bool((cosine > 0.999).all()), f"pooled bf16 features point elsewhere: cosine {cosine.tolist()}"


def test_the_student_trains_with_bf16_weights_on_cuda_as_the_engine_runs_it(tiny_swin):
    """DeepSpeed's bf16 mode: weights, buffers and inputs in bf16; the GFM losses come out float32 and finite."""
    torch.manual_seed(0)
    teacher = FrozenTeacher(tiny_swin(3).eval(), Tap(3, True), [2, 1, 0], img_size=64).to(CUDA, torch.bfloat16)
    student = MaskedImageModel(tiny_swin(4), 4, Tap(3, True), teacher.out_channels)
    reference = MaskedImageModel(tiny_swin(4), 4, Tap(3, True), teacher.out_channels).to(CUDA)
    reference.load_state_dict(student.state_dict())
    prefer_fused_attention(student, CUDA)
    student.to(CUDA, torch.bfloat16)
    images = torch.randn(2, 4, 64, 64, device=CUDA)
    mask = (torch.rand(2, 16, 16, device=CUDA) < 0.6).to(torch.uint8)
    valid = torch.ones(2, 4, 64, 64, dtype=torch.bool, device=CUDA)
    targets = teacher(images.to(torch.bfloat16))
    losses = student(images.to(torch.bfloat16), mask, valid, targets)
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
    losses["loss"].backward()
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    assert any(bool(g.abs().sum() > 0) for g in grads)
    expected = reference(images, mask, valid, targets)["loss"]
    assert abs(float(losses["loss"]) - float(expected)) < 0.05 * abs(float(expected))


def test_gfm_loss_of_bf16_cuda_tensors_is_computed_in_float32():
    torch.manual_seed(0)
    reconstruction, images = torch.randn(2, 4, 3, 8, 8, device=CUDA, dtype=torch.bfloat16).unbind(0)
    mask = (torch.rand(4, 1, 8, 8, device=CUDA) < 0.5).to(torch.uint8)
    student, teacher = torch.randn(2, 4, 2, 2, 16, device=CUDA, dtype=torch.bfloat16).unbind(0)
    reduced = gfm_loss(reconstruction, images, mask, None, student, teacher)
    exact = gfm_loss(reconstruction.float(), images.float(), mask, None, student.float(), teacher.float())
    for name, value in reduced.items():
        assert value.dtype == torch.float32 and torch.allclose(value, exact[name]), name
