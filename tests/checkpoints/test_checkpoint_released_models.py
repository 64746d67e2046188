"""The field's released models (Satlas' torchvision Swin-v2, DOFA, Prithvi, torchgeo's SSL4EO-S12 ViTs) against
their reference implementations, on random weights saved in each reference's format."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torchgeo.models import dofa_small_patch16_224
from torchgeo.models.dofa import DOFA
from torchvision.models import swin_v2_t
from torchvision.models.swin_transformer import (
    PatchMerging,
    PatchMergingV2,
    SwinTransformer,
    SwinTransformerBlock,
    SwinTransformerBlockV2,
)

from geofm.checkpoints import build_backbone, inspect_checkpoint, read_export_sidecar, torchgeo_weights
from geofm.cli import main
from geofm.errors import ConfigError

BANDS = ["red", "green", "blue", "nir"]
WAVELENGTHS = [0.665, 0.56, 0.49, 0.842]  # torchgeo's DOFA takes micrometres


def _timm_export(export_dir) -> torch.nn.Module:
    meta = read_export_sidecar(export_dir)
    overlay = dict(file=str(export_dir / "backbone.safetensors"), **meta["timm_pretrained_cfg_overlay"])
    return timm.create_model(
        meta["arch"], pretrained=True, pretrained_cfg_overlay=overlay, **meta["timm_kwargs"]
    ).eval()


def _perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move every parameter off its initial value (norms, logit scales, biases included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


def _tiny_torchvision_swin(v2: bool = True) -> SwinTransformer:
    block, merging = (SwinTransformerBlockV2, PatchMergingV2) if v2 else (SwinTransformerBlock, PatchMerging)
    torch.manual_seed(0)
    model = SwinTransformer([4, 4], 16, [2, 2, 2, 1], [1, 2, 4, 8], [4, 4], block=block, downsample_layer=merging)
    return _perturbed(model)


def _convert(src, dst, *options: str) -> None:
    assert main(["checkpoint", "convert", str(src), str(dst), *options]) == 0


# Satlas: torchvision's Swin-v2 (a Satlas file wraps it as backbone.backbone.*, next to its FPN and heads).


@pytest.mark.parametrize("v2", [True, False], ids=["swin_v2", "swin"])
def test_satlas_torchvision_swin_converts_to_timm_with_the_same_final_features(tmp_path, save, v2):
    reference = _tiny_torchvision_swin(v2)
    satlas = {f"backbone.backbone.{k}": v for k, v in reference.state_dict().items()}
    satlas["intermediates.0.conv.weight"] = torch.zeros(8, 16, 1, 1)
    path = save(satlas, "satlas.pth")

    _convert(path, tmp_path / "export", "--arch", "swinv2_tiny_window8_256" if v2 else "swin_tiny_patch4_window7_224")

    meta = read_export_sidecar(tmp_path / "export")
    assert meta["arch"].startswith("swinv2_" if v2 else "swin_") and meta["timm_kwargs"]["window_size"] == 4
    assert meta["converted_from"]["layout"] == "torchvision_swin"
    images = torch.randn(2, 3, meta["img_size"], meta["img_size"])
    with torch.no_grad():
        expected = reference.norm(reference.features(images))
        assert (_timm_export(tmp_path / "export").forward_features(images) - expected).abs().max() < 1e-4


@pytest.mark.slow
def test_torchvision_swin_v2_t_converts_to_timm_swinv2_tiny_with_the_same_final_features(tmp_path, save):
    reference = _perturbed(swin_v2_t())
    path = save(reference.state_dict(), "swin_v2_t.pth")

    _convert(path, tmp_path / "export")

    meta = read_export_sidecar(tmp_path / "export")
    assert meta["arch"] == "swinv2_tiny_window8_256" and meta["img_size"] == 256
    images = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        expected = reference.norm(reference.features(images))
        assert (_timm_export(tmp_path / "export").forward_features(images) - expected).abs().max() < 1e-4


# DOFA: the wavelength-conditioned patch embedding made for named bands.


def _dofa_file(save, **kwargs):
    torch.manual_seed(0)
    reference = _perturbed(
        DOFA(**{"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4, **kwargs})
    )
    return reference, save(reference.state_dict(), "dofa.pth")


def _dofa_equal(reference: DOFA, model: torch.nn.Module, img: int) -> float:
    """Largest difference of the pooled features; timm sees the image DOFA's padding shifts by one pixel."""
    images = torch.randn(2, len(WAVELENGTHS), img, img)
    with torch.no_grad():
        expected = reference.forward_features(images, WAVELENGTHS)
        shifted = F.pad(images, (1, 0, 1, 0))[..., :img, :img]
        return float((model.forward_head(model.forward_features(shifted), pre_logits=True) - expected).abs().max())


def test_dofa_converts_for_named_bands_to_a_timm_vit_with_dofas_features(tmp_path, save):
    reference, path = _dofa_file(save, num_classes=0)

    _convert(
        path,
        tmp_path / "export",
        "--bands",
        *BANDS,
        "--arch",
        "vit_small_patch16_224",
        "--timm-kwargs",
        '{"num_heads": 4}',
    )

    meta = read_export_sidecar(tmp_path / "export")
    assert meta["bands"] == BANDS and meta["timm_kwargs"]["in_chans"] == 4
    assert meta["converted_from"]["layout"] == "dofa"
    assert (
        meta["release"]["licence"] == "CC-BY-4.0" and "CC-BY-4.0" in (tmp_path / "export" / "MODEL_CARD.md").read_text()
    )
    assert torchgeo_weights(tmp_path / "export").meta["publication"] == "https://arxiv.org/abs/2403.15356"
    assert _dofa_equal(reference, _timm_export(tmp_path / "export"), 32) < 1e-4


@pytest.mark.slow
def test_torchgeo_dofa_small_loads_in_timm_without_missing_keys(tmp_path, save):
    reference = _perturbed(dofa_small_patch16_224(num_classes=0))
    path = save(reference.state_dict(), "dofa_small.pth")

    _convert(path, tmp_path / "export", "--bands", *BANDS)

    meta = read_export_sidecar(tmp_path / "export")
    assert meta["arch"] == "vit_small_patch16_224" and meta["timm_kwargs"]["global_pool"] == "avg"
    model = timm.create_model(meta["arch"], **meta["timm_kwargs"])
    missing, unexpected = model.load_state_dict(load_file(tmp_path / "export" / "backbone.safetensors"))
    assert not missing and not unexpected
    assert _dofa_equal(reference, model.eval(), 224) < 1e-4


def test_a_dofa_release_without_its_final_norm_is_a_vit_without_one(save):
    """DOFA's released files hold no fc_norm (torchgeo adds it at random): the ViT pools without a norm."""
    reference, _ = _dofa_file(save)
    release = {k: v for k, v in reference.state_dict().items() if not k.startswith(("fc_norm", "head"))}
    path = save(release, "dofa_release.pth")

    _, report, info = build_backbone(path, bands=BANDS, timm_kwargs={"num_heads": 4})

    assert info["timm_kwargs"]["final_norm"] is False and info["timm_kwargs"]["global_pool"] == "avg"
    assert not report.missing and not report.unexpected


def test_dofa_band_without_a_wavelength_is_one_clear_error(save):
    _, path = _dofa_file(save)
    with pytest.raises(ConfigError, match=r"dofa.pth: DOFA makes its patch kernel from wavelengths: bands: vv has no"):
        build_backbone(path, bands=["red", "vv"], timm_kwargs={"num_heads": 4})


# Prithvi: PrithviMAE's keys and shapes (EO-2.0: encoder.* with a Conv3d patch embedding, decoder.*; 1.0: the encoder
# at the top, decoder_* and mask_token beside it).


def _sincos(dim: int, positions: torch.Tensor) -> torch.Tensor:
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    angles = positions.double()[:, None] * omega[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def _prithvi_pos_embed(dim: int, frames: int, side: int) -> torch.Tensor:
    """Prithvi's 3-D sine-cosine table: width, height, time parts (6/16, 6/16, 4/16 of the channels), cls first."""
    t, h, w = torch.meshgrid(torch.arange(frames), torch.arange(side), torch.arange(side), indexing="ij")
    parts = [
        _sincos(dim // 16 * 6, w.flatten()),
        _sincos(dim // 16 * 6, h.flatten()),
        _sincos(dim // 16 * 4, t.flatten()),
    ]
    return torch.cat([torch.zeros(1, dim), torch.cat(parts, dim=1)]).float()[None]


def _prithvi_file(save, prefix: str = "encoder.", frames: int = 2, side: int = 4, patch: int = 8, dim: int = 64):
    """A Prithvi state dict: the encoder from a timm ViT's blocks, a Conv3d kernel (D, 6, 1, p, p), the MAE decoder."""
    torch.manual_seed(0)
    vit = _perturbed(
        timm.create_model(
            "vit_small_patch16_224",
            patch_size=patch,
            embed_dim=dim,
            depth=2,
            num_heads=4,
            img_size=side * patch,
            in_chans=6,
            num_classes=0,
        )
    )
    encoder = {k: v for k, v in vit.state_dict().items() if not k.startswith(("patch_embed", "pos_embed"))}
    encoder["patch_embed.proj.weight"] = torch.randn(dim, 6, 1, patch, patch) * 0.02
    encoder["patch_embed.proj.bias"] = torch.randn(dim) * 0.02
    encoder["pos_embed"] = _prithvi_pos_embed(dim, frames, side)
    encoder["temporal_embed_enc.scale"] = torch.ones(1)
    decoder = {
        "mask_token": torch.zeros(1, 1, 32),
        "decoder_embed.weight": torch.randn(32, dim),
        "decoder_embed.bias": torch.zeros(32),
        "decoder_pos_embed": torch.zeros(1, 1 + frames * side * side, 32),
        "decoder_blocks.0.attn.qkv.weight": torch.randn(96, 32),
        "decoder_norm.weight": torch.ones(32),
        "decoder_pred.weight": torch.randn(patch * patch * 6, 32),
    }
    decoder_prefix = "decoder." if prefix else ""
    state = {**{prefix + k: v for k, v in encoder.items()}, **{decoder_prefix + k: v for k, v in decoder.items()}}
    return vit, state, save(state, "prithvi.pt")


def _prithvi_single_frame(vit, state: dict, prefix: str, images: torch.Tensor) -> torch.Tensor:
    """Prithvi's encoder on one frame: Conv3d over (B, C, 1, H, W), the first frame's positions, the blocks, norm."""
    kernel = state[prefix + "patch_embed.proj.weight"]
    tokens = F.conv3d(images[:, :, None], kernel, state[prefix + "patch_embed.proj.bias"], stride=kernel.shape[2:])
    tokens = tokens.flatten(2).transpose(1, 2)
    pos = state[prefix + "pos_embed"]
    tokens = tokens + pos[:, 1 : 1 + tokens.shape[1]]
    x = torch.cat([(state[prefix + "cls_token"] + pos[:, :1]).expand(len(images), -1, -1), tokens], dim=1)
    for block in vit.blocks:
        x = block(x)
    return vit.norm(x)


@pytest.mark.parametrize(("prefix", "release"), [("encoder.", "Prithvi-EO-2.0"), ("", "Prithvi-EO-1.0 (Prithvi-100M)")])
def test_prithvi_encoder_converts_to_a_timm_vit_for_one_time_step(tmp_path, save, prefix, release):
    vit, state, path = _prithvi_file(save, prefix)

    _convert(path, tmp_path / "export", "--timm-kwargs", '{"num_heads": 4}')

    meta = read_export_sidecar(tmp_path / "export")
    assert meta["bands"] == ["blue", "green", "red", "nir08", "swir16", "swir22"] and meta["img_size"] == 32
    assert meta["release"]["name"] == release and meta["release"]["licence"] == "Apache-2.0"
    assert meta["converted_from"]["layout"] == "prithvi"
    notes = " ".join(meta["converted_from"]["notes"] + meta["converted_from"]["adapted"])
    assert "first of 2 frames" in notes and "MAE decoder is dropped" in notes
    images = torch.randn(2, 6, 32, 32)
    with torch.no_grad():
        expected = _prithvi_single_frame(vit, state, prefix, images)
        assert (_timm_export(tmp_path / "export").forward_features(images) - expected).abs().max() < 1e-4


def test_prithvi_release_continues_pretraining_with_its_encoder_and_a_fresh_decoder(kit, tmp_path, save):
    from geofm.checkpoints import load_pretraining_model
    from geofm.tasks.mim.model import MaskedImageModel

    _, _, path = _prithvi_file(save)
    encoder = timm.create_model(
        "vit_small_patch16_224",
        patch_size=8,
        embed_dim=64,
        depth=2,
        num_heads=4,
        img_size=32,
        in_chans=3,
        num_classes=0,
    )
    report = load_pretraining_model(MaskedImageModel(encoder, 3), path, ["red", "green", "blue"])

    assert report.backbone.fresh_bands == [] and not report.backbone.missing
    assert "decoder (not in the checkpoint)" in report.fresh and "mask_token (not in the checkpoint)" in report.fresh
    assert any(key.startswith("decoder.decoder_pred") for key in report.backbone.dropped)


# torchgeo's ViT weights (SSL4EO-S12...): timm names, 13 Sentinel-2 bands, selected by name.


def test_ssl4eo_vit_bands_are_selected_by_name(tmp_path, save):
    from torchgeo.models import vit_small_patch16_224

    torch.manual_seed(0)
    reference = vit_small_patch16_224(in_chans=13, img_size=32, embed_dim=32, depth=2, num_heads=2, num_classes=0)
    reference = _perturbed(reference)
    path = save(reference.state_dict(), "ssl4eo.pth")

    _convert(
        path, tmp_path / "export", "--bands", *BANDS, "--licence", "CC-BY-4.0", "--timm-kwargs", '{"num_heads": 2}'
    )

    meta = read_export_sidecar(tmp_path / "export")
    assert meta["bands"] == BANDS and meta["licence"] == "CC-BY-4.0"
    images = torch.zeros(2, 13, 32, 32)
    chosen = [3, 2, 1, 7]  # B04, B03, B02, B08
    images[:, chosen] = torch.randn(2, 4, 32, 32)
    with torch.no_grad():
        expected = reference.forward_features(images)
        assert (_timm_export(tmp_path / "export").forward_features(images[:, chosen]) - expected).abs().max() < 1e-4
    assert "MODEL_CARD" not in meta and "CC-BY-4.0" in (tmp_path / "export" / "MODEL_CARD.md").read_text()


# inspect names each layout.


@pytest.mark.slow  # names each architecture from the candidates of its family, built on the meta device
def test_inspect_recognises_each_released_layout(save):
    _, dofa = _dofa_file(save)
    satlas = save({f"backbone.backbone.{k}": v for k, v in _tiny_torchvision_swin().state_dict().items()}, "satlas.pth")
    _, _, prithvi = _prithvi_file(save)

    found = {
        name: inspect_checkpoint(path) for name, path in (("dofa", dofa), ("satlas", satlas), ("prithvi", prithvi))
    }

    assert {name: (r["layout"], r["family"]) for name, r in found.items()} == {
        "dofa": ("dofa", "vit"),
        "satlas": ("torchvision_swin", "swinv2"),
        "prithvi": ("prithvi", "vit"),
    }
    assert found["satlas"]["arch"] == "swinv2_tiny_window8_256" and found["satlas"]["tensors"]["missing"] == 0
    assert found["dofa"]["bands"] == ["red", "green", "blue"]
    assert all(r["layout_description"].startswith("A ") for r in found.values()), "geofm list checkpoint-layouts"
    assert found["prithvi"]["bands"] == ["blue", "green", "red", "nir08", "swir16", "swir22"]


def test_satlas_multispectral_bands_are_selected_by_name(save):
    torch.manual_seed(0)
    reference = SwinTransformer(
        [4, 4], 16, [2, 2, 2, 1], [1, 2, 4, 8], [4, 4], block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2
    )
    reference.features[0][0] = torch.nn.Conv2d(9, 16, 4, 4)  # Satlas' Sentinel-2 models take 9 bands
    path = save({f"backbone.backbone.{k}": v for k, v in reference.state_dict().items()}, "satlas_ms.pth")

    model, _, info = build_backbone(path, bands=BANDS)

    assert info["source_bands"][:3] == ["red", "green", "blue"] and info["source_bands"][6] == "nir"
    kernel = reference.features[0][0].weight
    assert torch.equal(model.patch_embed.proj.weight, kernel[:, [0, 1, 2, 6]])


def test_torchgeo_vit_bands_the_file_does_not_name_are_given_in_its_order(tmp_path, save):
    """torchgeo's Sentinel-1 ViT weights take VV, VH: named at conversion, the kernels follow the model's bands."""
    torch.manual_seed(0)
    reference = timm.create_model("vit_small_patch16_224", in_chans=2, img_size=32, embed_dim=32, depth=2, num_heads=2)
    path = save(reference.state_dict(), "s1.pth")
    options = ["--arch", "vit_small_patch16_224", "--timm-kwargs", '{"num_heads": 2}']

    _convert(path, tmp_path / "export", "--checkpoint-bands", "VV", "VH", "--bands", "vh", "vv", *options)

    meta = read_export_sidecar(tmp_path / "export")
    assert meta["bands"] == ["vh", "vv"] and meta["converted_from"]["source_bands"] == ["vv", "vh"]
    kernel = load_file(tmp_path / "export" / "backbone.safetensors")["patch_embed.proj.weight"]
    assert torch.equal(kernel, reference.patch_embed.proj.weight.detach()[:, [1, 0]])
    with pytest.raises(ConfigError, match=r"s1.pth: checkpoint bands name 3 bands, its patch embedding takes 2"):
        build_backbone(path, checkpoint_bands=["vv", "vh", "hh"], arch="vit_small_patch16_224")
