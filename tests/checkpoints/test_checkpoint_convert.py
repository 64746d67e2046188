from __future__ import annotations

import pytest
import torch

from geofm.checkpoints import LoadReport, backbone_state_dict, load_backbone_weights
from geofm.errors import CheckpointFormatError, ConfigError


def _swin_checkpoints(kit, source):
    """The source Swin's weights in every layout that can hold it."""
    microsoft = kit.microsoft_swin_state(source)
    timm_state = source.state_dict()
    return {
        "timm": {**timm_state, "head.fc.weight": torch.randn(5, 128), "head.fc.bias": torch.zeros(5)},
        "microsoft_swin": {"model": microsoft},
        "gfm": {
            "model": {
                **kit.prefixed("encoder.", microsoft),
                "encoder.mask_token": torch.zeros(1, 1, 16),
                **kit.prefixed("teacher.", kit.microsoft_swin_state(kit.make_swin(seed=5))),
                **kit.decoder_state(),
                "projector.weight": torch.randn(512, 128),
            },
            "config": {"MODEL": {"TYPE": "swin"}},
        },
        "simmim": {"model": {**kit.prefixed("encoder.", microsoft), **kit.decoder_state()}, "epoch": 99},
        "geofm_train": {
            "module": {
                **kit.prefixed("encoder.", timm_state),
                **kit.decoder_state(),
                "projector.weight": torch.randn(512, 128),
                "mask_token": torch.zeros(1, 1, 16),
            },
            "global_steps": 10,
        },
    }


@pytest.mark.parametrize("layout", ["timm", "microsoft_swin", "gfm", "simmim", "geofm_train"])
def test_swin_from_every_layout_gives_the_source_features(kit, save, layout):
    source = kit.make_swin(seed=1)
    path = save(_swin_checkpoints(kit, source)[layout], f"{layout}.pth")
    model = kit.make_swin(seed=2)
    assert not torch.allclose(kit.features(model), kit.features(source))

    report = load_backbone_weights(model, path)

    assert report.layout == layout
    assert not report.missing and not report.unexpected
    assert sorted(report.used) == sorted(source.state_dict())
    torch.testing.assert_close(kit.features(model), kit.features(source), rtol=0, atol=0)
    dropped = " ".join(report.dropped)
    assert "relative_position_index" not in " ".join(report.used) and "attn_mask" not in " ".join(report.used)
    if layout != "geofm_train":
        assert "head." in dropped
    if layout in ("gfm", "geofm_train"):
        assert "mask_token" in dropped and "decoder.0.weight" in dropped and "projector.weight" in dropped
    if layout == "gfm":
        assert "teacher.layers.0.downsample.reduction.weight" in dropped


@pytest.mark.parametrize("layout", ["timm", "geofm_train"])
def test_vit_layouts_give_the_source_features(kit, save, layout):
    source = kit.make_vit(seed=1)
    state = source.state_dict()
    raw = {
        "timm": {**state, "head.weight": torch.randn(7, 32), "head.bias": torch.zeros(7)},
        "geofm_train": {"module": {**kit.prefixed("encoder.", state), "mask_token": torch.zeros(1, 1, 32)}},
    }[layout]
    model = kit.make_vit(seed=2)
    report = load_backbone_weights(model, save(raw))
    assert report.layout == layout and not report.missing and not report.unexpected
    torch.testing.assert_close(kit.features(model), kit.features(source), rtol=0, atol=0)


def test_microsoft_checkpoint_at_window_8_loads_at_window_4_with_resized_tables(kit, save):
    source = kit.make_swin(window_size=8, seed=1)
    path = save({"model": kit.microsoft_swin_state(source)})
    model = kit.make_swin(window_size=4, seed=2)

    report = load_backbone_weights(model, path)

    table = "layers.0.blocks.0.attn.relative_position_bias_table"
    assert model.get_parameter(table).shape == (7 * 7, 1) and source.get_parameter(table).shape == (15 * 15, 1)
    assert f"{table}: 15x15 -> 7x7 table (window 8 -> 4)" in report.adapted
    # the same interpolation timm applies when it changes a model's window size itself
    source.set_input_size(window_size=4)
    for name, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, msg=name)
    features = kit.features(model)
    assert features.shape == (2, 2, 2, 128) and torch.isfinite(features).all()


def test_vit_at_another_image_size_gets_resampled_position_embeddings(kit, save):
    source = kit.make_vit(img_size=96, seed=1)
    model = kit.make_vit(img_size=64, seed=2)
    report = load_backbone_weights(model, save(source.state_dict()))
    assert "pos_embed: 37 -> 17 positions" in report.adapted
    assert torch.equal(model.cls_token, source.cls_token)


@pytest.mark.parametrize("family", ["swin", "vit"])
def test_rgb_kernels_go_into_the_rgb_bands_and_other_bands_keep_their_init(kit, save, family):
    make = kit.make_swin if family == "swin" else kit.make_vit
    source = make(in_chans=3, seed=1)
    model = make(in_chans=4, seed=2)
    fresh = model.patch_embed.proj.weight.detach().clone()
    checkpoint = {"model": kit.microsoft_swin_state(source)} if family == "swin" else source.state_dict()

    report = load_backbone_weights(model, save(checkpoint), rgb_positions=[2, 1, 0])

    rgb = source.patch_embed.proj.weight
    loaded = model.patch_embed.proj.weight
    assert (
        torch.equal(loaded[:, 2], rgb[:, 0])
        and torch.equal(loaded[:, 1], rgb[:, 1])
        and torch.equal(loaded[:, 0], rgb[:, 2])
    )
    assert torch.equal(loaded[:, 3], fresh[:, 3])
    assert "patch_embed.proj.weight: 3 -> 4 bands, RGB into [2, 1, 0]" in report.adapted
    for name, value in source.state_dict().items():
        if name != "patch_embed.proj.weight":
            assert torch.equal(model.state_dict()[name], value), name


def test_matching_band_count_is_loaded_unchanged(kit):
    source, model = kit.make_swin(in_chans=4, seed=1), kit.make_swin(in_chans=4, seed=2)
    state, report = backbone_state_dict(source.state_dict(), model, rgb_positions=[0, 1, 2])
    assert torch.equal(state["patch_embed.proj.weight"], source.patch_embed.proj.weight)
    assert not report.adapted


def test_band_adaptation_errors(kit):
    rgb = kit.make_swin(in_chans=3).state_dict()
    model = kit.make_swin(in_chans=5)
    with pytest.raises(ConfigError, match="rgb_positions"):
        backbone_state_dict(rgb, model)
    with pytest.raises(ConfigError, match=r"\[0, 5\)"):
        backbone_state_dict(rgb, model, rgb_positions=[0, 1, 5])
    with pytest.raises(ConfigError, match="distinct"):
        backbone_state_dict(rgb, model, rgb_positions=[0, 0, 1])
    with pytest.raises(CheckpointFormatError, match="4 bands and the model 5"):
        backbone_state_dict(kit.make_swin(in_chans=4).state_dict(), model, rgb_positions=[0, 1, 2])


def test_other_family_or_size_is_a_clear_error(kit):
    with pytest.raises(CheckpointFormatError, match="vit backbone, the model is a swin"):
        backbone_state_dict(kit.make_vit().state_dict(), kit.make_swin())
    wider = kit.create_backbone(kit.SWIN, {**kit.swin_kwargs(), "embed_dim": 32})
    with pytest.raises(CheckpointFormatError, match="do not fit") as err:
        backbone_state_dict(wider.state_dict(), kit.make_swin())
    assert "patch_embed.proj.weight (32, 3, 4, 4) vs model (16, 3, 4, 4)" in str(err.value)


def test_strict_load_lists_missing_keys_and_leaves_the_model_alone(kit, save):
    source = kit.make_swin(seed=1)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("layers.3.")}
    path = save(state)
    model = kit.make_swin(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    absent = len(source.state_dict()) - len(state)
    with pytest.raises(
        CheckpointFormatError, match=rf"missing {absent} \[layers\.\* \({absent}\)\], unexpected 0"
    ) as err:
        load_backbone_weights(model, path)
    assert str(path) in str(err.value)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    report = load_backbone_weights(model, path, strict=False)
    assert len(report.missing) == absent and torch.equal(model.patch_embed.proj.weight, source.patch_embed.proj.weight)


def test_report_summary_is_compact(kit):
    source = kit.make_swin(window_size=8)
    raw = {
        "model": {
            **kit.prefixed("encoder.", kit.microsoft_swin_state(source)),
            **kit.prefixed("teacher.", kit.microsoft_swin_state(source)),
            **kit.decoder_state(),
        }
    }
    _, report = backbone_state_dict(raw, kit.make_swin(in_chans=4), rgb_positions=[0, 1, 2], path="gfm.pth")
    text = str(report)
    assert isinstance(report, LoadReport)
    assert text.splitlines()[0] == f"gfm checkpoint from gfm.pth: {len(report.used)} tensors loaded"
    blocks = sum(kit.SWIN_KWARGS["depths"])
    assert "teacher.* (" in text and f"encoder.layers.*.blocks.*.attn.relative_position_index ({blocks})" in text
    assert (
        "  adapted layers.*.blocks.*.attn.relative_position_bias_table: 15x15 -> 7x7 table (window 8 -> 4) (x4)" in text
    )
    assert "  adapted patch_embed.proj.weight: 3 -> 4 bands, RGB into [0, 1, 2]" in text
    assert len(text.splitlines()) == 5
