"""build_backbone: any known checkpoint into a timm backbone without being told its layout or architecture."""

from __future__ import annotations

import sys

import pytest
import timm
import torch

from geofm.checkpoints import (
    CHECKPOINT_LAYOUTS,
    build_backbone,
    convert_checkpoint,
    export_backbone,
    read_export_sidecar,
)
from geofm.errors import CheckpointFormatError, ConfigError


def _case(name, kit, save, save_with_yacs, tmp_path):
    """(path, source model, in_chans, img, expected layout, expected arch, architecture from) for one input."""
    if name in ("simmim_vit_pretrain", "simmim_vit_finetune"):
        pretrain = name == "simmim_vit_pretrain"
        source = kit.make_beit(kit.SIMMIM_VIT_PRETRAIN if pretrain else kit.SIMMIM_VIT_FINETUNE, seed=1)
        state = kit.simmim_vit_state(source)
        if pretrain:
            model = {
                **kit.prefixed("encoder.", state),
                "encoder.mask_token": torch.zeros(1, 1, 32),
                **kit.decoder_state(),
            }
            path = save_with_yacs(
                {"model": model, **kit.TRAINING_STATE}, kit.yacs_config("vit", kit.BEIT_IMG), "simmim_vit.pth"
            )
            origin = "weights+checkpoint config"
        else:  # heads read from the per-block tables, image size from their length
            model = {**state, "head.weight": torch.randn(10, 32), "head.bias": torch.zeros(10)}
            path = save({"model": model, **kit.TRAINING_STATE, "max_accuracy": 88.0}, "simmim_vit_ft.pth")
            origin = "weights"
        return path, source, 3, kit.BEIT_IMG, "simmim", kit.BEIT, origin

    if name == "geofm_export":
        source = kit.make_vit(in_chans=4, seed=1)
        export_backbone(
            source, tmp_path / "export", arch=kit.VIT, create_kwargs=kit.vit_kwargs(in_chans=4), metadata={}
        )
        return tmp_path / "export", source, 4, kit.IMG, "geofm_export", kit.VIT, "export sidecar"
    if name == "geofm_train":
        source = kit.make_swin(in_chans=4, seed=1)
        return kit.write_run(tmp_path, source), source, 4, kit.IMG, "geofm_train", kit.SWIN, "run config"

    source = kit.make_swin(seed=1)
    microsoft = kit.microsoft_swin_state(source)
    if name == "gfm":
        model = {
            **kit.prefixed("encoder.", microsoft),
            "encoder.mask_token": torch.zeros(1, 1, 16),
            **kit.prefixed("teacher.", kit.microsoft_swin_state(kit.make_swin(seed=5), num_classes=21841)),
            **kit.decoder_state(),
            "projector.weight": torch.randn(512, 128),
            "projector.bias": torch.zeros(512),
        }
        config = kit.yacs_config("swin", kit.IMG, TEACHER={"TYPE": "swin_base_patch4_window7_224_22k"}, ALPHA=1.0)
        path = save_with_yacs({"model": model, **kit.TRAINING_STATE}, config, "gfm.pth")
        return path, source, 3, kit.IMG, "gfm", kit.SWIN, "weights+checkpoint config"
    if name == "simmim_swin_pretrain":
        model = {
            **kit.prefixed("encoder.", microsoft),
            "encoder.mask_token": torch.zeros(1, 1, 16),
            **kit.decoder_state(),
        }
        path = save_with_yacs(
            {"model": model, **kit.TRAINING_STATE}, kit.yacs_config("swin", kit.IMG), "simmim_swin.pth"
        )
        return path, source, 3, kit.IMG, "simmim", kit.SWIN, "weights+checkpoint config"
    if name == "simmim_swin_finetune":
        path = save_with_yacs(
            {"model": microsoft, **kit.TRAINING_STATE, "max_accuracy": 91.2}, kit.yacs_config("swin", kit.IMG)
        )
        return path, source, 3, kit.IMG, "simmim", kit.SWIN, "weights+checkpoint config"
    if name == "microsoft_in22k":
        path = save(
            {"model": kit.microsoft_swin_state(source, num_classes=21841)}, "swin_tiny_patch4_window7_224_22k.pth"
        )
        return path, source, 3, kit.IMG, "microsoft_swin", kit.SWIN, "weights"
    if name == "timm_swin":  # no buffers: the image size comes from the windows clamped in the last stages
        state = {**source.state_dict(), "head.fc.weight": torch.randn(5, 128), "head.fc.bias": torch.zeros(5)}
        return save(state, "timm.pth"), source, 3, kit.IMG, "timm", kit.SWIN, "weights"
    raise AssertionError(name)


CASES = [
    "gfm",
    "simmim_swin_pretrain",
    "simmim_swin_finetune",
    "simmim_vit_pretrain",
    "simmim_vit_finetune",
    "microsoft_in22k",
    "timm_swin",
    "geofm_train",
    "geofm_export",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_every_layout_round_trips_without_being_named(kit, save, save_with_yacs, tmp_path, name):
    path, source, in_chans, img, layout, arch, origin = _case(name, kit, save, save_with_yacs, tmp_path)

    model, report, info = build_backbone(path)

    assert (report.layout, info["layout"], info["arch"], info["inferred_from"]) == (layout, layout, arch, origin)
    assert not report.missing and not report.unexpected
    assert sorted(report.used) == sorted(source.state_dict())
    assert info["in_chans"] == in_chans and info["img_size"] == img
    expected = kit.features(source, in_chans=in_chans, img=img)
    torch.testing.assert_close(kit.features(model, in_chans=in_chans, img=img), expected, rtol=0, atol=0)
    # the inferred kwargs rebuild the same architecture in plain timm
    rebuilt = timm.create_model(info["arch"], **info["timm_kwargs"])
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in source.state_dict().items()}
    dropped = " ".join(report.dropped)
    assert "relative_position_index" not in " ".join(report.used) and "attn_mask" not in " ".join(report.used)
    if name in ("gfm", "simmim_swin_pretrain", "simmim_vit_pretrain", "geofm_train"):
        assert "mask_token" in dropped and "decoder.0.weight" in dropped
    if name == "gfm":
        assert "teacher.head.weight" in dropped and "projector.weight" in dropped
        assert info["provenance"]["method"] == "gfm" and info["provenance"]["epoch"] == 99
        assert info["provenance"]["config"]["TEACHER.TYPE"] == "swin_base_patch4_window7_224_22k"
        assert info["provenance"]["data"] == {"DATA.DATASET": "geopile", "DATA.DATA_PATH": "/data/GeoPileV0"}
    if name in ("simmim_swin_finetune", "simmim_vit_finetune", "microsoft_in22k", "timm_swin"):
        assert "head." in dropped
    if name == "microsoft_in22k":
        origin = info["provenance"]
        assert (origin["method"], origin["data"]) == ("supervised", "ImageNet-22k")
        assert origin["normalisation"]["imagenet"]["mean"] == list(timm.data.IMAGENET_DEFAULT_MEAN)
    if name == "geofm_train":
        assert info["bands"] == ["red", "green", "blue", "nir"] and info["provenance"]["steps"] == 12
        assert info["provenance"]["gsd"] == [0.5, 10.0] and info["provenance"]["metrics"]["step"] == 12


def test_simmim_vit_is_loaded_as_timm_beit(kit, save, save_with_yacs, tmp_path):
    path, *_ = _case("simmim_vit_pretrain", kit, save, save_with_yacs, tmp_path)
    model, _, info = build_backbone(path)
    assert type(model).__name__ == "Beit" and info["family"] == "beit"
    assert info["timm_kwargs"] == {
        "num_classes": 0,
        "in_chans": 3,
        "img_size": 32,
        "patch_size": 8,
        "embed_dim": 32,
        "depth": 2,
        "num_heads": 2,
        "use_rel_pos_bias": False,
        "use_shared_rel_pos_bias": True,
        "global_pool": "token",
    }


def test_gfm_checkpoint_loads_without_yacs(kit, save, save_with_yacs, tmp_path):
    path, *_ = _case("gfm", kit, save, save_with_yacs, tmp_path)
    assert "yacs" not in sys.modules
    build_backbone(path)
    assert "yacs" not in sys.modules and "yacs.config" not in sys.modules


def test_a_vit_needs_its_heads_from_a_config_or_the_caller(kit, save):
    source = kit.make_vit(seed=1)
    path = save(source.state_dict(), "vit.pth")
    with pytest.raises(CheckpointFormatError, match="attention heads") as err:
        build_backbone(path)
    assert "--arch" in str(err.value) and "num_heads" in str(err.value)

    for kwargs in ({"arch": kit.VIT, "timm_kwargs": {"num_heads": 2}}, {"timm_kwargs": {"num_heads": 2}}):
        model, _report, info = build_backbone(path, **kwargs)
        assert info["inferred_from"] == "weights+arguments" and info["timm_kwargs"]["num_heads"] == 2
        torch.testing.assert_close(kit.features(model), kit.features(source), rtol=0, atol=0)
    assert build_backbone(path, arch=kit.VIT, timm_kwargs={"num_heads": 2})[2]["arch"] == kit.VIT


def test_new_window_size_resizes_the_tables_as_timm_does(kit, save):
    source = kit.make_swin(window_size=8, seed=1)
    path = save({"model": kit.microsoft_swin_state(source)}, "swin_w8.pth")
    assert build_backbone(path)[2]["window_size"] == 8

    model, report, info = build_backbone(path, window_size=4)

    table = "layers.0.blocks.0.attn.relative_position_bias_table"
    assert info["timm_kwargs"]["window_size"] == 4 and model.get_parameter(table).shape == (7 * 7, 1)
    assert f"{table}: 15x15 -> 7x7 table (window 8 -> 4)" in report.adapted
    source.set_input_size(window_size=4)  # timm's own resize of a model's window
    for name, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, msg=name)


def test_new_image_size_resamples_beit_tables(kit, save):
    source = kit.make_beit(kit.SIMMIM_VIT_FINETUNE, seed=1)
    path = save({"model": kit.simmim_vit_state(source), **kit.TRAINING_STATE}, "beit.pth")
    model, report, info = build_backbone(path, img_size=64)
    assert info["timm_kwargs"]["img_size"] == 64
    assert "blocks.0.attn.relative_position_bias_table: 7x7 -> 15x15 table (window 4 -> 8)" in report.adapted
    out = kit.features(model, img=64)
    assert out.shape == (2, 1 + 8 * 8, 32) and torch.isfinite(out).all()


def test_rgb_checkpoint_into_named_bands(kit, save, save_with_yacs, tmp_path):
    path, source, *_ = _case("gfm", kit, save, save_with_yacs, tmp_path)
    rgb = source.patch_embed.proj.weight

    model, report, info = build_backbone(path, bands=["blue", "green", "red", "nir"])

    loaded = model.patch_embed.proj.weight
    assert (
        torch.equal(loaded[:, 0], rgb[:, 2])
        and torch.equal(loaded[:, 1], rgb[:, 1])
        and torch.equal(loaded[:, 2], rgb[:, 0])
    )
    assert not any(torch.equal(loaded[:, 3], rgb[:, i]) for i in range(3))
    assert "patch_embed.proj.weight: 3 -> 4 bands, from checkpoint bands [2, 1, 0, None]" in report.adapted
    assert info["source_bands"] == ["red", "green", "blue"] and info["bands"] == ["blue", "green", "red", "nir"]
    assert any("taken as red, green, blue" in n for n in info["notes"])

    model, report, _ = build_backbone(path, bands=["b1", "b2", "b3", "b4", "b5"], rgb_positions=[4, 2, 0])
    assert torch.equal(model.patch_embed.proj.weight[:, 4], rgb[:, 0])
    assert "patch_embed.proj.weight: 3 -> 5 bands, RGB into [4, 2, 0]" in report.adapted
    with pytest.raises(ConfigError, match="none of the bands"):
        build_backbone(path, bands=["b1", "b2", "b3", "b4"])


def test_export_bands_follow_their_names(kit, tmp_path):
    """A 4-band export asked for its bands in another order sees the same image in that order."""
    source = kit.make_swin(in_chans=4, seed=1)
    export_backbone(
        source,
        tmp_path,
        arch=kit.SWIN,
        create_kwargs=kit.swin_kwargs(in_chans=4),
        metadata={"bands": ["blue", "green", "red", "nir"]},
    )
    order = ["nir", "red", "green", "blue"]
    model, report, _ = build_backbone(tmp_path, bands=order)
    images = torch.randn(2, 4, kit.IMG, kit.IMG)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(images[:, [3, 2, 1, 0]]), source.forward_features(images))
    assert "patch_embed.proj.weight: 4 -> 4 bands, from checkpoint bands [3, 2, 1, 0]" in report.adapted

    model, _, info = build_backbone(tmp_path, bands=["red", "nir"])
    assert info["timm_kwargs"]["in_chans"] == 2
    assert torch.equal(model.patch_embed.proj.weight, source.patch_embed.proj.weight[:, [2, 3]])


def test_clear_errors(kit, save, tmp_path):
    with pytest.raises(CheckpointFormatError) as err:
        build_backbone(save({"model": {"conv1.weight": torch.ones(1)}}, "resnet.pth"))
    assert "unknown checkpoint layout" in str(err.value) and all(name in str(err.value) for name in CHECKPOINT_LAYOUTS)

    swin = save(kit.make_swin().state_dict(), "swin.pth")
    with pytest.raises(CheckpointFormatError, match=r"vit.*checkpoint holds a swin"):
        build_backbone(swin, arch=kit.VIT)
    with pytest.raises(ConfigError, match="unknown timm architecture"):
        build_backbone(swin, arch="resnet_of_my_dreams")
    with pytest.raises(ConfigError, match="Swin backbones only"):
        build_backbone(save(kit.make_vit().state_dict(), "vit.pth"), window_size=7, timm_kwargs={"num_heads": 2})
    with pytest.raises(ConfigError, match="need bands"):
        build_backbone(swin, rgb_positions=[0, 1, 2])


def test_a_pickle_that_would_run_code_is_refused(kit, tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "gfm.pth"
    torch.save({"model": kit.prefixed("encoder.", kit.make_swin().state_dict()), "config": kit.Exploit(marker)}, path)
    with pytest.raises(CheckpointFormatError, match=r"refused to unpickle.*system"):
        build_backbone(path)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["gfm", "simmim_vit_pretrain", "simmim_vit_finetune", "geofm_train"])
def test_conversions_load_in_plain_timm_with_the_same_features(kit, save, save_with_yacs, tmp_path, name):
    path, source, in_chans, img, *_ = _case(name, kit, save, save_with_yacs, tmp_path)

    weights, report, info = convert_checkpoint(path, tmp_path / "out")

    meta = read_export_sidecar(weights)
    overlay = dict(file=str(weights), **meta["timm_pretrained_cfg_overlay"])
    via_timm = timm.create_model(meta["arch"], pretrained=True, pretrained_cfg_overlay=overlay, **meta["timm_kwargs"])
    via_geofm, _, _ = build_backbone(tmp_path / "out")
    expected = kit.features(source, in_chans=in_chans, img=img)
    for model in (via_timm.eval(), via_geofm):
        torch.testing.assert_close(kit.features(model, in_chans=in_chans, img=img), expected, rtol=0, atol=0)
    assert meta["converted_from"]["layout"] == report.layout and meta["bands"] == info["bands"]
