from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from geofm.checkpoints import (
    CHECKPOINT_LAYOUTS,
    backbone_state_dict,
    detect_layout,
    load_checkpoint_file,
    locate_backbone,
)
from geofm.checkpoints.layouts import BackboneSource, CheckpointLayout
from geofm.errors import CheckpointFormatError


@pytest.fixture
def layouts(kit):
    """One checkpoint per layout, as the mapping load_checkpoint_file returns (export aside)."""
    swin = kit.make_swin()
    timm_state = swin.state_dict()
    microsoft = kit.microsoft_swin_state(swin)
    vit_state = kit.make_vit().state_dict()
    simmim_vit = kit.simmim_vit_state(kit.make_beit(kit.SIMMIM_VIT_PRETRAIN))
    simmim_vit_ft = kit.simmim_vit_state(kit.make_beit(kit.SIMMIM_VIT_FINETUNE))
    training = {"optimizer": {"state": {}, "param_groups": []}, "lr_scheduler": {}, "epoch": 9, "config": {"A": 1}}
    return {
        "timm": {**timm_state},
        "timm_vit_under_state_dict": {"state_dict": vit_state, "epoch": 3},
        "microsoft_swin": {"model": microsoft},
        "microsoft_swin_bare": microsoft,
        "gfm": {
            "model": {
                **kit.prefixed("encoder.", microsoft),
                "encoder.mask_token": torch.zeros(1, 1, 16),
                **kit.prefixed("teacher.", microsoft),
                **kit.decoder_state(),
                "projector.weight": torch.randn(512, 128),
            },
            **training,
        },
        "simmim_pretrain": {
            "model": {
                **kit.prefixed("encoder.", microsoft),
                "encoder.mask_token": torch.zeros(1, 1, 16),
                **kit.decoder_state(),
            },
            **training,
        },
        "simmim_finetune": {"model": microsoft, **training, "max_accuracy": 91.2},
        "simmim_vit_pretrain": {
            "model": {
                **kit.prefixed("encoder.", simmim_vit),
                "encoder.mask_token": torch.zeros(1, 1, 32),
                **kit.decoder_state(),
            },
            **training,
        },
        "simmim_vit_finetune": {"model": simmim_vit_ft, **training, "max_accuracy": 83.8},
        "timm_beit": simmim_vit_ft,
        "geofm_train": {
            "module": {
                **kit.prefixed("encoder.", timm_state),
                **kit.decoder_state(),
                "projector.weight": torch.randn(512, 128),
                "mask_token": torch.zeros(1, 1, 16),
            },
            "buffer_names": [],
            "global_steps": 100,
            "ds_version": "0.19.8",
        },
        "geofm_train_vit": {"module": {**kit.prefixed("encoder.", vit_state), "mask_token": torch.zeros(1, 1, 32)}},
    }


EXPECTED = {
    "timm": ("timm", "swin", False, ""),
    "timm_vit_under_state_dict": ("timm", "vit", False, ""),
    "microsoft_swin": ("microsoft_swin", "swin", True, ""),
    "microsoft_swin_bare": ("microsoft_swin", "swin", True, ""),
    "gfm": ("gfm", "swin", True, "encoder."),
    "simmim_pretrain": ("simmim", "swin", True, "encoder."),
    "simmim_finetune": ("simmim", "swin", True, ""),
    "simmim_vit_pretrain": ("simmim", "beit", False, "encoder."),
    "simmim_vit_finetune": ("simmim", "beit", False, ""),
    "timm_beit": ("timm", "beit", False, ""),
    "geofm_train": ("geofm_train", "swin", False, "encoder."),
    "geofm_train_vit": ("geofm_train", "vit", False, "encoder."),
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_layout_is_told_from_keys(layouts, case):
    source = locate_backbone(layouts[case])
    layout, family, microsoft, prefix = EXPECTED[case]
    assert (source.layout, source.family, source.microsoft_names, source.prefix) == (layout, family, microsoft, prefix)
    assert detect_layout(layouts[case]) == layout


def test_export_is_recognised_by_its_sidecar_not_its_name(kit, tmp_path):
    state = kit.make_swin().state_dict()
    save_file(state, tmp_path / "weights.safetensors")
    (tmp_path / "weights.json").write_text(json.dumps({"format": "geofm-backbone/1", "arch": kit.SWIN}))
    save_file(state, tmp_path / "backbone.safetensors")  # export name, no sidecar: plain timm weights
    for name, layout in [("weights.safetensors", "geofm_export"), ("backbone.safetensors", "timm")]:
        path = tmp_path / name
        assert detect_layout(load_checkpoint_file(path), path=path) == layout


def test_file_names_do_not_steer_detection(layouts, save):
    path = save(layouts["timm"], "gfm_simmim_microsoft_swin_22k.pth")
    assert detect_layout(load_checkpoint_file(path), path=path) == "timm"


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"model": {"conv1.weight": torch.ones(1)}},
        {"epoch": 1, "optimizer": {}},
        {
            "model": {
                "encoder.patch_embed.proj.weight": torch.ones(1),
                "encoder.blocks.0.attn.qkv.weight": torch.ones(1),
            }
        },
    ],
    ids=["empty", "resnet", "no-weights", "simmim-vit"],
)
def test_unknown_layout_lists_the_known_ones(raw):
    with pytest.raises(CheckpointFormatError) as err:
        detect_layout(raw, path="/data/odd.pth")
    assert "/data/odd.pth" in str(err.value)
    assert all(name in str(err.value) for name in CHECKPOINT_LAYOUTS)


class _EmaStudent(CheckpointLayout):
    """A trainer's EMA weights: `ema` holds the student backbone as `student.*` (a plug-in's layout)."""

    def detect(self, raw, *, path=None, teacher=False):
        ema = raw.get("ema")
        if not isinstance(ema, dict) or "student.patch_embed.proj.weight" not in ema:
            return None
        return BackboneSource("ema_student", ema, "student.", "swin", microsoft_names=False)


def test_a_registered_layout_is_tried_after_the_built_in_ones_and_loads(kit, layouts):
    swin = kit.make_swin()
    CHECKPOINT_LAYOUTS.register("ema_student", _EmaStudent())
    try:
        raw = {"ema": kit.prefixed("student.", swin.state_dict()), "step": 7}
        assert detect_layout(raw) == "ema_student"
        state, report = backbone_state_dict(raw, kit.make_swin(seed=1))
        assert report.layout == "ema_student" and torch.equal(
            state["patch_embed.proj.weight"], swin.patch_embed.proj.weight
        )
        assert all(detect_layout(layouts[case]) == EXPECTED[case][0] for case in EXPECTED), "built-ins first"
    finally:
        CHECKPOINT_LAYOUTS._entries.pop("ema_student")
