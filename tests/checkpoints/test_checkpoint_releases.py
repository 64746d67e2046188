"""Released GFM and SimMIM pretraining checkpoints through every documented route.

The files are written in the layouts of mmendiet/GFM and microsoft/SimMIM (see ``conftest``):
continual pretraining from them (``model.init_checkpoint``) restores what they hold of the whole
pretraining module, a GFM file as ``teacher.checkpoint`` gives its teacher, and SimMIM's ViT loads into
timm's VisionTransformer through ``geofm checkpoint``, pretraining, finetuning and the teacher.
"""

from __future__ import annotations

import json
import logging

import pytest
import timm
import torch
from safetensors.torch import load_file

from geofm.checkpoints import build_backbone, export_backbone, load_backbone_for_bands, read_export_sidecar
from geofm.cli import main
from geofm.config import PretrainConfig, TeacherConfig
from geofm.errors import CheckpointFormatError
from geofm.tasks.finetuning.model import build_finetune_model
from geofm.tasks.mim.task import build_student
from geofm.tasks.mim.teacher_from_checkpoint import build_teacher

BANDS = ["red", "green", "blue", "nir"]
STRIDE = 32  # the tiny Swin's encoder stride: patch 4, three patch mergings


def _pretrain_config(kit, tmp_path, model: dict, teacher: dict | None = None) -> PretrainConfig:
    tree = kit.run_tree(tmp_path / "run", model, BANDS)
    tree["task_options"]["teacher"] = teacher
    return PretrainConfig.from_tree(tree)


def _swin_model(kit, checkpoint, window_size: int = 4) -> dict:
    return {
        "arch": kit.SWIN,
        "img_size": kit.IMG,
        "window_size": window_size,
        "timm_kwargs": kit.SWIN_KWARGS,
        "init_checkpoint": str(checkpoint) if checkpoint else None,
    }


def _swin_teacher(kit, checkpoint, **overrides) -> dict:
    return {
        "arch": kit.SWIN,
        "checkpoint": str(checkpoint),
        "img_size": kit.IMG,
        "window_size": 4,
        "timm_kwargs": kit.SWIN_KWARGS,
        **overrides,
    }


def _band_rows(tensor: torch.Tensor, band: int, area: int) -> torch.Tensor:
    """The decoder outputs (pixel-shuffle channels) of one band."""
    return tensor[band * area : (band + 1) * area]


@pytest.fixture
def gfm_file(kit, save_with_yacs):
    """A GFM release: student window 2 (as GFM's 6 against its teacher's 7), teacher window 4."""
    student, teacher = kit.make_swin(window_size=2, seed=1), kit.make_swin(window_size=4, seed=5)
    model = kit.gfm_release(student, teacher)
    config = kit.yacs_config("swin", kit.IMG, ALPHA=1.0)
    config["MODEL"]["SWIN"] = {**kit.SWIN_SECTION, "WINDOW_SIZE": 2}
    path = save_with_yacs({"model": model, **kit.TRAINING_STATE}, config, "gfm.pth")
    return path, model, student, teacher


@pytest.fixture
def simmim_vit_file(kit, save_with_yacs):
    """A SimMIM ViT pretraining release with absolute position embeddings, and the timm Beit it is."""
    source = kit.make_beit(kit.SIMMIM_VIT_APE, seed=1)
    model = kit.simmim_vit_release(source)
    assert set(model) == kit.simmim_vit_keys(depth=2), "the file holds exactly what SimMIM's code saves"
    config = kit.yacs_config("vit", kit.BEIT_IMG, vit_section=kit.VIT_APE_SECTION)
    path = save_with_yacs({"model": model, **kit.TRAINING_STATE}, config, "simmim_vit.pth")
    return path, model, source


# Continual pretraining from a release restores its mask token, decoder and projector.


def test_gfm_release_continues_with_its_mask_token_decoder_and_projector(kit, gfm_file, tmp_path, caplog):
    path, release, *_ = gfm_file
    cfg = _pretrain_config(kit, tmp_path, _swin_model(kit, path, 2), _swin_teacher(kit, path))
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="geofm.pretrain"):
        model = build_student(cfg)
    torch.manual_seed(0)
    fresh = build_student(cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_checkpoint": None})}))

    torch.testing.assert_close(model.mask_token.detach(), release["encoder.mask_token"].flatten(), rtol=0, atol=0)
    area = STRIDE**2
    for key in ("decoder.0.weight", "decoder.0.bias"):
        loaded, initial = model.state_dict()[key], fresh.state_dict()[key]
        for band in range(3):  # red, green, blue: the release's own reconstruction
            assert torch.equal(_band_rows(loaded, band, area), _band_rows(release[key], band, area)), key
        assert torch.equal(_band_rows(loaded, 3, area), _band_rows(initial, 3, area)), f"{key}: nir starts fresh"
    assert torch.equal(model.projector.weight.detach(), release["projector.weight"])
    assert torch.equal(model.projector.bias.detach(), release["projector.bias"])
    student = build_backbone(path)[0].state_dict()  # the release's student, red, green, blue
    kernel = "patch_embed.proj.weight"
    assert torch.equal(model.encoder.state_dict()[kernel][:, :3], student[kernel])  # nir gets a fresh kernel
    for key, value in model.encoder.state_dict().items():
        assert key == kernel or torch.equal(value, student[key]), key

    text = caplog.text
    assert "restored with the encoder: mask_token (from encoder.mask_token, 1x1x16 -> 16)" in text
    assert "decoder (output bands red, green, blue); projector" in text
    assert "starting fresh: decoder output bands nir (not in the checkpoint)" in text
    assert "fresh bands (not in the checkpoint, newly initialised): nir" in text
    dropped = text.split("dropped", 1)[1].split("\n", 1)[0]
    assert "teacher.*" in dropped and "decoder" not in dropped and "projector" not in dropped


def test_simmim_swin_release_without_projector_says_the_projector_starts_fresh(kit, save_with_yacs, tmp_path, caplog):
    source = kit.make_swin(seed=1)
    release = {
        **kit.prefixed("encoder.", kit.microsoft_swin_state(source, num_classes=None)),
        "encoder.mask_token": torch.randn(1, 1, 16),
        **kit.mim_decoder(source.num_features, STRIDE),
    }
    path = save_with_yacs({"model": release, **kit.TRAINING_STATE}, kit.yacs_config("swin", kit.IMG), "simmim.pth")
    teacher = tmp_path / "teacher.pth"
    torch.save(kit.make_swin(seed=5).state_dict(), teacher)
    cfg = _pretrain_config(kit, tmp_path, _swin_model(kit, path), _swin_teacher(kit, teacher))
    with caplog.at_level(logging.INFO, logger="geofm.pretrain"):
        model = build_student(cfg)
    torch.testing.assert_close(model.mask_token.detach(), release["encoder.mask_token"].flatten(), rtol=0, atol=0)
    assert torch.equal(
        _band_rows(model.decoder[0].bias.detach(), 2, STRIDE**2), _band_rows(release["decoder.0.bias"], 2, STRIDE**2)
    )
    assert "starting fresh: decoder output bands nir (not in the checkpoint); projector (not in the checkpoint)" in (
        caplog.text
    )


def test_a_geofm_training_checkpoint_restores_the_whole_pretraining_module(kit, tmp_path):
    """geofm's own layout (``module``, mask token of shape (C,)) continues through the same route."""
    teacher = tmp_path / "teacher.pth"
    torch.save(kit.make_swin(seed=5).state_dict(), teacher)
    cfg = _pretrain_config(kit, tmp_path, _swin_model(kit, None), _swin_teacher(kit, teacher))
    torch.manual_seed(1)
    trained = build_student(cfg)
    tag = tmp_path / "checkpoints" / "step_0000010"
    tag.mkdir(parents=True)
    torch.save({"module": trained.state_dict(), "global_steps": 10}, tag / "mp_rank_00_model_states.pt")
    torch.manual_seed(2)
    restored = build_student(cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_checkpoint": tag})}))
    for key, value in trained.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key


# A GFM file as the teacher gives its teacher; a key that does not fit is an error.


def test_gfm_file_as_teacher_loads_teacher_keys_not_the_student(kit, gfm_file, caplog):
    path, _, _, teacher = gfm_file
    with caplog.at_level(logging.INFO, logger="geofm.checkpoints"):
        frozen = build_teacher(TeacherConfig.model_validate(_swin_teacher(kit, path)), [0, 1, 2])
    expected = teacher.state_dict()
    loaded = frozen.backbone.state_dict()
    assert loaded and all(torch.equal(value, expected[key]) for key, value in loaded.items())
    assert "teacher loaded from" in caplog.text and "gfm checkpoint" in caplog.text
    assert "relative_position_bias_table" not in caplog.text, "the teacher's window 4 needs no table resized"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("drop", "missing 2 [layers.3.blocks.0.mlp.fc1.weight, layers.3.blocks.0.mlp.fc1.bias]"),
        ("extra_block", "unexpected"),
    ],
)
def test_a_teacher_key_that_does_not_fit_is_an_error(kit, gfm_file, save_with_yacs, change, expected):
    release = dict(gfm_file[1])
    overrides = {}
    if change == "drop":
        del release["teacher.layers.3.blocks.0.mlp.fc1.weight"], release["teacher.layers.3.blocks.0.mlp.fc1.bias"]
    else:  # the configured teacher has one block fewer in stage 3 than the file
        overrides["timm_kwargs"] = {**kit.SWIN_KWARGS, "depths": [2, 2, 1, 1]}
    broken = save_with_yacs({"model": release, **kit.TRAINING_STATE}, kit.yacs_config("swin", kit.IMG), "broken.pth")
    with pytest.raises(CheckpointFormatError, match="does not fit SwinTransformer") as err:
        build_teacher(TeacherConfig.model_validate(_swin_teacher(kit, broken, **overrides)), [0, 1, 2])
    assert expected in str(err.value) and str(broken) in str(err.value)


def test_a_teacher_of_another_width_names_the_timm_kwargs_of_its_export(kit, tmp_path):
    """A 4-band export (its kernels picked band by band for the RGB teacher) and a teacher config without
    the export's ``timm_kwargs``: timm's default width does not fit, and the sidecar says which would."""
    export_backbone(
        kit.make_swin(in_chans=4), tmp_path, arch=kit.SWIN, create_kwargs=kit.swin_kwargs(4), metadata={"bands": BANDS}
    )
    with pytest.raises(CheckpointFormatError) as err:
        build_teacher(TeacherConfig.model_validate(_swin_teacher(kit, tmp_path, timm_kwargs={})), [0, 1, 2])
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'backbone.safetensors'}: "), message
    assert (
        f"geofm_export tensors do not fit SwinTransformer (another architecture size? its backbone.json builds "
        f"{kit.SWIN} with timm_kwargs {json.dumps(kit.SWIN_KWARGS)}): layers.0.blocks.0.attn.proj.bias (16,) vs "
        "model (96,)"
    ) in message


# SimMIM's ViT loads into timm's VisionTransformer through every route.


def _vit_features(model: torch.nn.Module) -> torch.Tensor:
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.forward_features(images)


def test_simmim_vit_converts_to_a_timm_vit_with_the_same_features(kit, simmim_vit_file, tmp_path, capsys):
    path, _, source = simmim_vit_file
    assert main(["checkpoint", "convert", str(path), str(tmp_path / "export")]) == 0
    assert "attn.q_bias, attn.v_bias -> attn.qkv.bias (k bias 0)" in capsys.readouterr().out
    meta = read_export_sidecar(tmp_path / "export")
    model = timm.create_model(meta["arch"], **meta["timm_kwargs"]).eval()
    model.load_state_dict(load_file(tmp_path / "export" / "backbone.safetensors"))
    assert type(model).__name__ == "VisionTransformer" and meta["arch"].startswith("vit_")
    torch.testing.assert_close(_vit_features(model), _vit_features(source))

    assert main(["checkpoint", "inspect", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["layout"], result["family"], result["arch"]) == ("simmim", "vit", meta["arch"])
    assert result["tensors"] == {"used": 34, "dropped": 3, "missing": 0, "unexpected": 0}


def test_simmim_vit_starts_pretraining_with_its_mask_token_and_decoder(kit, simmim_vit_file, tmp_path):
    path, release, source = simmim_vit_file
    model = {"arch": kit.VIT, "img_size": 32, "timm_kwargs": kit.VIT_OF_SIMMIM_APE, "init_checkpoint": str(path)}
    student = build_student(_pretrain_config(kit, tmp_path, model))
    torch.testing.assert_close(student.mask_token.detach(), release["encoder.mask_token"].flatten(), rtol=0, atol=0)
    area = 8**2
    assert torch.equal(
        _band_rows(student.decoder[0].weight.detach(), 1, area), _band_rows(release["decoder.0.weight"], 1, area)
    )
    rgb = build_backbone(path)[0]
    kernel = student.encoder.patch_embed.proj.weight.detach()
    assert torch.equal(kernel[:, :3], rgb.patch_embed.proj.weight)
    assert torch.equal(student.encoder.blocks[1].ls2.gamma, source.blocks[1].gamma_2)


def test_simmim_vit_finetunes(kit, simmim_vit_file, task_config):
    path, _, source = simmim_vit_file
    cfg = task_config(
        "classification",
        family="vit",
        checkpoint=str(path),
        model={"img_size": 32, "timm_kwargs": kit.VIT_OF_SIMMIM_APE},
        data={
            "bands": ["red", "green", "blue"],
            "dataset_bands": ["red", "green", "blue"],
            "mean": [0.2] * 3,
            "std": [0.1] * 3,
        },
    )
    model, report = build_finetune_model(cfg)
    assert not report.missing and not report.unexpected
    torch.testing.assert_close(_vit_features(model.backbone.eval()), _vit_features(source))


def test_simmim_vit_is_a_teacher(kit, simmim_vit_file):
    path, _, source = simmim_vit_file
    cfg = TeacherConfig.model_validate(
        {"arch": kit.VIT, "checkpoint": str(path), "img_size": 32, "timm_kwargs": kit.VIT_OF_SIMMIM_APE, "block": 2}
    )
    teacher = build_teacher(cfg, [0, 1, 2])
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # the Beit reference, cut after block 2 (no final norm)
        tokens = torch.cat([source.cls_token.expand(2, -1, -1), source.patch_embed(images)], 1) + source.pos_embed
        for block in source.blocks:
            tokens = block(tokens)
    torch.testing.assert_close(teacher(images), tokens[:, 1:].reshape(2, 4, 4, 32))


@pytest.mark.parametrize(
    ("kwargs", "table"),
    [
        ("SIMMIM_VIT_PRETRAIN", "rel_pos_bias.relative_position_bias_table (SimMIM's MODEL.VIT.USE_SHARED_RPB"),
        ("SIMMIM_VIT_FINETUNE", "blocks.N.attn.relative_position_bias_table (SimMIM's MODEL.VIT.USE_RPB"),
    ],
)
def test_simmim_vit_with_relative_position_bias_is_refused_for_timm_vit_saying_what_loads(kit, save, kwargs, table):
    source = kit.make_beit(getattr(kit, kwargs), seed=1)
    path = save({"model": kit.simmim_vit_release(source), **kit.TRAINING_STATE}, "simmim_vit_rpb.pth")
    model = timm.create_model(kit.VIT, num_classes=0, img_size=32, **kit.VIT_OF_SIMMIM_APE)
    with pytest.raises(CheckpointFormatError) as err:
        load_backbone_for_bands(model, path, ["red", "green", "blue"])
    message = str(err.value)
    assert table in message and "USE_APE True, USE_RPB False, USE_SHARED_RPB False" in message
    assert message.startswith(str(path)) and "geofm checkpoint convert" in message
    assert type(build_backbone(path)[0]).__name__ == "Beit", "convert still gives timm's Beit"
