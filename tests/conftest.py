"""Shared fixtures: tiny backbones so the suite stays fast on two CPU cores."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}
TINY_VIT = {"embed_dim": 32, "depth": 4, "num_heads": 2}
SWIN_ARCH = "swin_tiny_patch4_window7_224"
VIT_ARCH = "vit_small_patch16_224"


@pytest.fixture
def tiny_swin():
    from geofm.models.backbones import backbone_kwargs, create_backbone

    def make(in_chans: int = 3, img_size: int = 64, window_size: int = 4):
        kwargs = backbone_kwargs(in_chans=in_chans, img_size=img_size, window_size=window_size, timm_kwargs=TINY_SWIN)
        return create_backbone(SWIN_ARCH, kwargs)

    return make


@pytest.fixture
def tiny_vit():
    from geofm.models.backbones import backbone_kwargs, create_backbone

    def make(in_chans: int = 3, img_size: int = 64):
        return create_backbone(VIT_ARCH, backbone_kwargs(in_chans=in_chans, img_size=img_size, timm_kwargs=TINY_VIT))

    return make


def _finetune_tree(task: str, output_dir: Path, family: str = "swin", **sections) -> dict:
    """A finetuning config tree of a tiny 32 px Swin (or ViT) on 4 bands, 2 epochs of batch 4."""
    vit = family == "vit"
    data = {
        "root": "unused",
        "bands": ["red", "green", "blue", "nir"],
        "dataset_bands": ["blue", "green", "red", "nir"],
        "scale": 0.0001,
        "mean": [0.25] * 4,
        "std": [0.1] * 4,
        "num_workers": 0,
    }
    data.update(
        {
            "classification": {"num_classes": 3},
            "multilabel": {"num_classes": 3},
            "segmentation": {"num_classes": 3, "ignore_index": 255},
            "change": {"num_classes": 2},
            "superres": {"scale_factor": 2},
        }[task]
    )
    model = {"arch": VIT_ARCH, "img_size": 32, "timm_kwargs": TINY_VIT} if vit else {
        "arch": SWIN_ARCH, "img_size": 32, "window_size": 4, "timm_kwargs": TINY_SWIN
    }
    tree = {
        "task": task,
        "run": {"output_dir": str(output_dir), "log_every": 1, "checkpoint_every": 100, "progress": False},
        "model": model,
        "head": {"decoder_channels": 16, "superres_channels": 4},
        "data": data,
        "train": {"epochs": 2, "micro_batch_size": 4, "warmup_epochs": 0.5, "base_lr": 1e-3, "lr_reference_batch": 4},
    }
    for key, values in sections.items():
        tree[key] = values if values is None or not isinstance(values, dict) else {**copy.deepcopy(tree.get(key) or {}), **values}
    return tree


@pytest.fixture(scope="session")
def finetune_tree():
    """:func:`_finetune_tree`: ``make(task, output_dir, family="swin", **sections)``."""
    return _finetune_tree


@pytest.fixture
def task_tree(tmp_path):
    """A finetuning config tree of a tiny 32 px Swin (or ViT, ``family="vit"``) on 4 bands, 2 epochs.

    ``make(task, name="run", family="swin", **sections)``: keyword sections update the tree's
    sections (``checkpoint=...`` sets the top-level key); the run writes to ``tmp_path/name``.
    """

    def make(task: str, name: str = "run", family: str = "swin", **sections) -> dict:
        return _finetune_tree(task, tmp_path / name, family, **sections)

    return make


@pytest.fixture
def task_config(task_tree):
    """The validated :class:`FinetuneConfig` of :func:`task_tree`'s tree."""
    from geofm.config.finetune import FinetuneConfig

    def make(task: str, name: str = "run", family: str = "swin", **sections):
        return FinetuneConfig.from_tree(task_tree(task, name, family, **sections))

    return make
