import pytest
import torch

from geofm.models.backbones import feature_pyramid
from geofm.tasks.mim.masking import MaskGenerator
from geofm.tasks.mim.model import MaskedImageModel, Tap, embed_tokens, run_backbone


def _batch(in_chans, size=64, patch=4, mask_patch=16):
    gen = MaskGenerator(size, mask_patch, patch, 0.6)
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, in_chans, size, size), torch.stack([gen(g), gen(g)])


def test_unmasked_forward_matches_timm(tiny_swin, tiny_vit):
    for encoder in (tiny_swin(4), tiny_vit(4)):
        encoder.eval()
        x = torch.randn(2, 4, 64, 64)
        ours, _ = run_backbone(encoder, embed_tokens(encoder, x), tap=None)
        timm_out = encoder.forward_features(x)
        if timm_out.ndim == 4:  # Swin: NHWC
            timm_out = timm_out.permute(0, 3, 1, 2)
        else:  # ViT: drop the class token
            timm_out = timm_out[:, encoder.num_prefix_tokens :].transpose(1, 2).reshape_as(ours)
        assert torch.allclose(ours, timm_out, atol=1e-5)


@pytest.mark.slow
def test_swin_tap_after_stage3_with_merging_has_stride_32(tiny_swin):
    encoder = tiny_swin(3)
    x = torch.randn(1, 3, 64, 64)
    _, tapped = run_backbone(encoder, embed_tokens(encoder, x), Tap(3, include_merging=True))
    assert tapped.shape == (1, 2, 2, 128)  # 64/32 grid, stage-4 width after merging
    _, tapped = run_backbone(encoder, embed_tokens(encoder, x), Tap(3, include_merging=False))
    assert tapped.shape == (1, 4, 4, 64)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["swin", "vit"])
def test_mim_model_losses_and_masked_tokens_change_output(family, tiny_swin, tiny_vit):
    encoder = tiny_swin(4) if family == "swin" else tiny_vit(4)
    patch = 4 if family == "swin" else 16
    tap = Tap(3, True) if family == "swin" else Tap(3)
    model = MaskedImageModel(encoder, in_chans=4, tap=tap, distill_dim=24).eval()
    images, mask = _batch(4, patch=patch)
    grid = 2 if family == "swin" else 4
    teacher = torch.randn(2, grid, grid, 24)
    out = model(images, mask, teacher_features=teacher)
    assert set(out) == {"loss", "loss_mim", "loss_distill"}
    assert torch.isfinite(out["loss"]) and out["loss_distill"] != 0
    out["loss"].backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0
    assert model.projector.weight.grad is not None


def test_plain_simmim_has_no_projector(tiny_swin):
    model = MaskedImageModel(tiny_swin(3), in_chans=3)
    images, mask = _batch(3)
    out = model(images, mask)
    assert model.projector is None and out["loss_distill"] == 0
    assert "mask_token" in model.no_weight_decay()
    assert any("relative_position_bias_table" in n for n in model.no_weight_decay())


def test_decoder_reconstructs_every_band_at_input_resolution(tiny_swin):
    model = MaskedImageModel(tiny_swin(5), in_chans=5)
    images, mask = _batch(5)
    features, _ = model.encode(images, mask)
    assert model.decoder(features).shape == images.shape


@pytest.mark.slow
def test_feature_pyramid_for_dense_heads(tiny_swin, tiny_vit):
    swin = feature_pyramid(tiny_swin(4), torch.randn(1, 4, 64, 64))
    assert [f.shape[-1] for f in swin] == [16, 8, 4, 2]
    vit = feature_pyramid(tiny_vit(4), torch.randn(1, 4, 64, 64))
    assert len(vit) == 4 and vit[0].shape == (1, 32, 4, 4)


def test_any_window_and_image_size(tiny_swin):
    encoder = tiny_swin(3, img_size=96, window_size=6)
    assert [f.shape[-1] for f in feature_pyramid(encoder, torch.randn(1, 3, 96, 96))] == [24, 12, 6, 3]


@pytest.mark.parametrize(
    ("arch", "tap_channels"),
    [
        ("swin_tiny_patch4_window7_224", 768),
        ("swin_small_patch4_window7_224", 768),
        ("swin_base_patch4_window7_224", 1024),
        ("swin_large_patch4_window7_224", 1536),
        ("vit_small_patch16_224", 384),
        ("vit_base_patch16_224", 768),
        ("vit_large_patch16_224", 1024),
    ],
)
def test_full_size_backbones_build_with_any_band_count(arch, tap_channels):
    """Swin-T/S/B/L and ViT-S/B/L at the paper's 192 px (window 6) with 4 bands, built on the meta device."""
    from geofm.models.backbones import backbone_family, backbone_kwargs, create_backbone
    from geofm.tasks.mim.model import default_vit_tap
    from geofm.tasks.mim.model import tap_channels as channels_at

    swin = backbone_family(arch) == "swin"
    kwargs = backbone_kwargs(in_chans=4, img_size=192, window_size=6 if swin else None)
    with torch.device("meta"):
        encoder = create_backbone(arch, kwargs)
        tap = Tap(3, True) if swin else default_vit_tap(encoder)
        model = MaskedImageModel(encoder, in_chans=4, tap=tap, distill_dim=1024)
    assert encoder.patch_embed.proj.in_channels == 4
    assert channels_at(encoder, tap) == tap_channels
    stride = 32 if swin else 16
    assert model.decoder[0].out_channels == stride**2 * 4
