"""Continual pretraining from a released GFM file: its student's mask token, decoder and projector
come along, and a teacher read from such a file is its frozen teacher, never its student."""

from __future__ import annotations

import pytest
import torch

from geofm.config import PretrainConfig
from geofm.errors import CheckpointFormatError
from geofm.models.backbones import backbone_kwargs, create_backbone
from geofm.models.teacher import build_teacher
from pretrain.central import build_student

from .conftest import TINY_SWIN

SWIN = "swin_tiny_patch4_window7_224"


def _swin(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_backbone(SWIN, backbone_kwargs(in_chans=3, img_size=32, window_size=4, timm_kwargs=TINY_SWIN))


@pytest.fixture
def gfm_release(tiny_tree, tmp_path):
    """A GFM pretraining checkpoint in the official layout (RGB student, teacher, decoder, projector)."""
    student, teacher = _swin(1), _swin(2)
    reference = build_student(PretrainConfig.from_tree(tiny_tree()))
    rows = reference.decoder[0].weight.shape[0] // 4 * 3  # stride^2 per band, 3 bands
    model = {
        **{f"encoder.{k}": v for k, v in student.state_dict().items()},
        "encoder.mask_token": torch.randn(1, 1, 16),
        **{f"teacher.{k}": v for k, v in teacher.state_dict().items()},
        "decoder.0.weight": torch.randn(rows, *reference.decoder[0].weight.shape[1:]),
        "decoder.0.bias": torch.randn(rows),
        "projector.weight": torch.randn_like(reference.projector.weight),
        "projector.bias": torch.randn_like(reference.projector.bias),
    }
    path = tmp_path / "gfm_release.pth"
    torch.save({"model": model, "epoch": 99}, path)
    return path, model, student, teacher


def test_continual_pretraining_restores_the_mask_token_decoder_and_projector(tiny_tree, gfm_release, caplog):
    path, saved, student, _ = gfm_release
    cfg = PretrainConfig.from_tree(tiny_tree(model={"init_checkpoint": str(path)}))
    assert cfg.data.bands == ["red", "green", "blue", "nir"]
    with caplog.at_level("INFO"):
        model = build_student(cfg)
    torch.testing.assert_close(model.encoder.patch_embed.proj.weight[:, :3], student.patch_embed.proj.weight)
    torch.testing.assert_close(model.mask_token, saved["encoder.mask_token"].reshape(16))
    torch.testing.assert_close(model.projector.weight, saved["projector.weight"])
    per_band = saved["decoder.0.weight"].shape[0] // 3
    decoder = model.decoder[0].weight
    torch.testing.assert_close(decoder[: 3 * per_band], saved["decoder.0.weight"]), "red, green, blue rows restored"
    assert not torch.equal(decoder[3 * per_band :], torch.zeros_like(decoder[3 * per_band :])), "nir rows stay fresh"
    torch.testing.assert_close(model.decoder[0].bias[: 3 * per_band], saved["decoder.0.bias"])
    assert "restored from it too: decoder.0.bias, decoder.0.weight, mask_token, projector.bias" in caplog.text


def test_a_teacher_read_from_a_gfm_file_is_its_teacher_not_its_student(tiny_tree, gfm_release):
    path, saved, student, teacher = gfm_release
    cfg = PretrainConfig.from_tree(tiny_tree(teacher={"checkpoint": str(path)}))
    frozen = build_teacher(cfg.teacher, [0, 1, 2])
    torch.testing.assert_close(frozen.backbone.patch_embed.proj.weight, teacher.patch_embed.proj.weight)
    assert not torch.equal(frozen.backbone.patch_embed.proj.weight, student.patch_embed.proj.weight)
    damaged = {k: v for k, v in saved.items() if k != "teacher.layers.0.blocks.0.attn.qkv.weight"}
    torch.save({"model": damaged}, path)
    with pytest.raises(CheckpointFormatError, match=r"missing 1 \[layers.0.blocks.0.attn.qkv.weight"):
        build_teacher(cfg.teacher, [0, 1, 2])
