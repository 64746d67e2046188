"""Tiny Swin/ViT/BEiT backbones and their weights in the layouts checkpoints come in.

Tests reach the builders through the ``kit`` fixture (``kit.make_swin()``, ``kit.features(model)``...).
"""

from __future__ import annotations

import json
import os
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
import yaml
from torch import nn

from geofm.config import PretrainConfig, config_to_dict
from geofm.models.backbones import backbone_kwargs, create_backbone

SWIN = "swin_tiny_patch4_window7_224"
VIT = "vit_small_patch16_224"
BEIT = "beit_base_patch16_224"
# two blocks in the first stages so that shifted windows (and their attn_mask) exist at 64 px
SWIN_KWARGS = {"embed_dim": 16, "depths": [2, 2, 2, 1], "num_heads": [1, 2, 4, 8]}
VIT_KWARGS = {"embed_dim": 32, "depth": 4, "num_heads": 2}
IMG = 64
BEIT_IMG = 32
# SimMIM's ViT as pretrained (one relative-position table shared by all blocks, no mean pooling) and
# as finetuned (a table per block, mean pooling with fc_norm): BEiT-style, timm's Beit.
BEIT_KWARGS = {
    "patch_size": 8,
    "embed_dim": 32,
    "depth": 2,
    "num_heads": 2,
    "init_values": 0.1,
    "use_abs_pos_emb": False,
}
SIMMIM_VIT_PRETRAIN = {
    **BEIT_KWARGS,
    "use_rel_pos_bias": False,
    "use_shared_rel_pos_bias": True,
    "global_pool": "token",
}
SIMMIM_VIT_FINETUNE = {**BEIT_KWARGS, "use_rel_pos_bias": True, "use_shared_rel_pos_bias": False, "global_pool": "avg"}
# SimMIM's ViT with absolute position embeddings and no relative position bias (MODEL.VIT.USE_APE True,
# USE_RPB and USE_SHARED_RPB False): BEiT names, the function of timm's VisionTransformer.
SIMMIM_VIT_APE = {
    **BEIT_KWARGS,
    "use_abs_pos_emb": True,
    "use_rel_pos_bias": False,
    "use_shared_rel_pos_bias": False,
    "global_pool": "token",
}
# The timm VisionTransformer that holds it (init_values: layer scales exist; their values are loaded over).
VIT_OF_SIMMIM_APE = {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "init_values": 0.1}


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_torch_thread):
    """Every checkpoint test runs its tiny models on one thread (see ``one_torch_thread``)."""


def swin_kwargs(in_chans: int = 3, window_size: int = 4, img_size: int = IMG) -> dict:
    return backbone_kwargs(in_chans=in_chans, img_size=img_size, window_size=window_size, timm_kwargs=SWIN_KWARGS)


def vit_kwargs(in_chans: int = 3, img_size: int = IMG) -> dict:
    return backbone_kwargs(in_chans=in_chans, img_size=img_size, timm_kwargs=VIT_KWARGS)


def make_swin(in_chans: int = 3, window_size: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return create_backbone(SWIN, swin_kwargs(in_chans, window_size)).eval()


def make_vit(in_chans: int = 3, img_size: int = IMG, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return create_backbone(VIT, vit_kwargs(in_chans, img_size)).eval()


def make_beit(kwargs: dict, in_chans: int = 3, img_size: int = BEIT_IMG, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(BEIT, pretrained=False, num_classes=0, in_chans=in_chans, img_size=img_size, **kwargs)
    with torch.no_grad():  # layer scales and q/v biases away from their constant initialisation
        for name, param in model.named_parameters():
            if name.endswith(("gamma_1", "gamma_2", "q_bias", "v_bias")):
                param.normal_()
    return model.eval()


def features(model: nn.Module, in_chans: int = 3, seed: int = 1, img: int = IMG) -> torch.Tensor:
    images = torch.randn(2, in_chans, img, img, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.forward_features(images)


def microsoft_swin_state(model: nn.Module, num_classes: int | None = 10) -> dict[str, torch.Tensor]:
    """A timm Swin's weights in Microsoft's names, with the buffers and classifier the releases hold
    (``num_classes=None``: without classifier, as SimMIM's and GFM's pretraining encoders and GFM's teacher)."""
    state = {}
    for key, value in model.state_dict().items():
        key = re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", key)
        state[key] = value.clone()
    for name, buffer in model.named_buffers():  # relative_position_index and attn_mask, not persistent in timm
        state[name] = buffer.clone()
    assert any(k.endswith("attn_mask") for k in state) and any(k.endswith("relative_position_index") for k in state)
    if num_classes is not None:
        state["head.weight"] = torch.randn(num_classes, model.num_features)
        state["head.bias"] = torch.zeros(num_classes)
    return state


def simmim_vit_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A timm Beit's weights as Microsoft's SimMIM ViT stores them: with relative_position_index buffers."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, buffer in model.named_buffers():
        if name.endswith("relative_position_index"):
            state[name] = buffer.clone()
    return state


def prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in state.items()}


def decoder_state(prefix: str = "decoder.") -> dict[str, torch.Tensor]:
    return {prefix + "0.weight": torch.randn(48, 128, 1, 1), prefix + "0.bias": torch.zeros(48)}


def mim_decoder(in_features: int, stride: int, in_chans: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """SimMIM's pixel decoder: a 1x1 convolution to ``stride**2 * in_chans`` channels (a pixel shuffle follows)."""
    generator = torch.Generator().manual_seed(seed)
    out = stride**2 * in_chans
    return {
        "decoder.0.weight": torch.randn(out, in_features, 1, 1, generator=generator),
        "decoder.0.bias": torch.randn(out, generator=generator),
    }


def gfm_release(student: nn.Module, teacher: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """The ``model`` of a checkpoint written by mmendiet/GFM's pretraining (``main_teacher.py``).

    ``SimMIM(encoder, encoder_stride=32, teacher)``: the student ``encoder.*`` (Microsoft Swin names,
    no classifier, ``mask_token`` of shape (1, 1, C)), the frozen ``teacher.*`` (a whole Microsoft Swin
    whose classifier is None), ``decoder.0`` (to ``32**2 * 3`` channels) and ``projector`` (a linear
    map from the student's width to the same width).
    """
    generator = torch.Generator().manual_seed(seed)
    width, embed = student.num_features, student.patch_embed.proj.out_channels
    return {
        **prefixed("encoder.", microsoft_swin_state(student, num_classes=None)),
        "encoder.mask_token": torch.randn(1, 1, embed, generator=generator),
        **prefixed("teacher.", microsoft_swin_state(teacher, num_classes=None)),
        **mim_decoder(width, 32, seed=seed),
        "projector.weight": torch.randn(width, width, generator=generator),
        "projector.bias": torch.randn(width, generator=generator),
    }


def simmim_vit_release(source: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """The ``model`` of microsoft/SimMIM's ViT pretraining checkpoint (``main_simmim.py``).

    ``SimMIM(VisionTransformerForSimMIM, encoder_stride=patch size)``: ``encoder.*`` in BEiT names
    with ``mask_token`` (1, 1, C), and ``decoder.0`` to ``patch**2 * 3`` channels.
    """
    generator = torch.Generator().manual_seed(seed)
    embed, patch = source.embed_dim, source.patch_embed.proj.kernel_size[0]
    return {
        **prefixed("encoder.", simmim_vit_state(source)),
        "encoder.mask_token": torch.randn(1, 1, embed, generator=generator),
        **mim_decoder(embed, patch, seed=seed),
    }


def simmim_vit_keys(depth: int) -> set[str]:
    """The keys microsoft/SimMIM saves for its ViT with USE_APE, QKV_BIAS and INIT_VALUES set, no relative
    position bias and no mean pooling (``models/simmim.py``, ``models/vision_transformer.py``)."""
    block = [
        "norm1.weight",
        "norm1.bias",
        "attn.qkv.weight",
        "attn.q_bias",
        "attn.v_bias",
        "attn.proj.weight",
        "attn.proj.bias",
        "norm2.weight",
        "norm2.bias",
        "mlp.fc1.weight",
        "mlp.fc1.bias",
        "mlp.fc2.weight",
        "mlp.fc2.bias",
        "gamma_1",
        "gamma_2",
    ]
    encoder = ["cls_token", "pos_embed", "mask_token", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    encoder += ["norm.weight", "norm.bias", *(f"blocks.{i}.{key}" for i in range(depth) for key in block)]
    return {f"encoder.{key}" for key in encoder} | {"decoder.0.weight", "decoder.0.bias"}


TRAINING_STATE = {"optimizer": {"state": {}, "param_groups": []}, "lr_scheduler": {}, "epoch": 99}
SWIN_SECTION = {
    "PATCH_SIZE": 4,
    "IN_CHANS": 3,
    "EMBED_DIM": 16,
    "DEPTHS": [2, 2, 2, 1],
    "NUM_HEADS": [1, 2, 4, 8],
    "WINDOW_SIZE": 4,
}
# yacs default trees hold both model sections; only the one of MODEL.TYPE describes the model
VIT_SECTION = {"PATCH_SIZE": 8, "IN_CHANS": 3, "EMBED_DIM": 32, "DEPTH": 2, "NUM_HEADS": 2, "USE_SHARED_RPB": True}
SIMMIM_VIT_DEFAULTS = {"PATCH_SIZE": 16, "EMBED_DIM": 768, "DEPTH": 12, "NUM_HEADS": 12}
VIT_APE_SECTION = {**VIT_SECTION, "USE_APE": True, "USE_RPB": False, "USE_SHARED_RPB": False, "INIT_VALUES": 0.1}


def yacs_config(kind: str, img: int, vit_section: dict = VIT_SECTION, **extra) -> dict:
    model = {"TYPE": kind, "NAME": f"simmim_{kind}", "SWIN": SWIN_SECTION, "VIT": SIMMIM_VIT_DEFAULTS}
    if kind == "vit":
        model.update(SWIN={**SWIN_SECTION, "EMBED_DIM": 96}, VIT=vit_section)
    return {
        "MODEL": model,
        "DATA": {"IMG_SIZE": img, "DATASET": "geopile", "DATA_PATH": "/data/GeoPileV0", "MASK_PATCH_SIZE": 32},
        "TRAIN": {"EPOCHS": 100, "BASE_LR": 1e-4},
        **extra,
    }


def run_tree(run_dir, model: dict, bands: list[str]) -> dict:
    """A validated geofm run config, as pretrain writes it to config.yaml."""
    tree = {
        "run": {"output_dir": str(run_dir)},
        "model": model,
        "task_options": {"masking": {"mask_patch_size": 16}},
        "data": {
            "bands": bands,
            "sources": [
                {
                    "name": "aerial",
                    "root": "/archive/aerial",
                    "bands": ["red", "green", "blue"],
                    "scale": 1 / 255,
                    "mean": [0.48, 0.49, 0.32],
                    "std": [0.12, 0.07, 0.08],
                    "gsd": 0.5,
                },
                {
                    "name": "s2",
                    "root": "/archive/s2",
                    "bands": ["blue", "green", "red", "nir"],
                    "scale": 1e-4,
                    "mean": [0.05, 0.08, 0.07, 0.26],
                    "std": [0.03, 0.03, 0.04, 0.1],
                    "gsd": 10.0,
                },
            ],
        },
        "train": {"epochs": 2, "micro_batch_size": 4, "warmup_epochs": 0.5},
    }
    return config_to_dict(PretrainConfig.from_tree(tree))


def write_run(tmp_path, source, step: int = 12):
    """A geofm run directory with config.yaml, metrics.jsonl and a DeepSpeed checkpoint behind 'last'."""
    run_dir = tmp_path / "run"
    model = {"arch": SWIN, "img_size": IMG, "window_size": 4, "timm_kwargs": SWIN_KWARGS}
    tree = run_tree(run_dir, model, ["red", "green", "blue", "nir"])
    tag = run_dir / "checkpoints" / f"step_{step:07d}"
    tag.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    records = [{"step": s, "epoch": s / 6, "loss": 1.0 / s, "loss_mim": 0.5 / s} for s in range(1, step + 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    module = {
        **prefixed("encoder.", source.state_dict()),
        **decoder_state(),
        "projector.weight": torch.randn(512, 128),
        "mask_token": torch.zeros(1, 1, 16),
    }
    torch.save(
        {"module": module, "global_steps": step, "step": step, "ds_version": "0.19.8"},
        tag / "mp_rank_00_model_states.pt",
    )
    (run_dir / "checkpoints" / "last").symlink_to(tag.name)
    return run_dir


class Exploit:
    """Pickles as a call of os.system: a checkpoint that would run code when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class CfgNodeBase(dict):
    """Pickles like yacs' CfgNode: a dict subclass carrying bookkeeping attributes."""

    def __init__(self, init_dict=None, new_allowed=False):
        super().__init__(init_dict or {})
        self.__dict__["__immutable__"] = False
        self.__dict__["__deprecated_keys__"] = set()
        self.__dict__["__renamed_keys__"] = {"OLD.KEY": ("NEW.KEY", "renamed")}
        self.__dict__["__new_allowed__"] = new_allowed

    def __getattr__(self, name):
        if name in self:
            return self[name]
        raise AttributeError(name)


def fake_modules(monkeypatch, dotted: str, **members) -> None:
    """Register ``dotted`` and its parents in sys.modules; monkeypatch restores them afterwards."""
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    for name, member in members.items():
        member.__module__, member.__qualname__ = dotted, name
        setattr(sys.modules[dotted], name, member)


@pytest.fixture
def save_with_yacs(monkeypatch, save):
    """torch.save ``payload`` with ``config`` (a nested dict) pickled as yacs CfgNodes, yacs being absent."""

    def write(payload: dict, config: dict, name: str = "ckpt.pth") -> Path:
        CfgNode = type("CfgNode", (CfgNodeBase,), {})

        def node(tree):
            return CfgNode({k: node(v) if isinstance(v, dict) else v for k, v in tree.items()})

        with monkeypatch.context() as patch:
            fake_modules(patch, "yacs.config", CfgNode=CfgNode)
            path = save({**payload, "config": node(config)}, name)
        assert "yacs" not in sys.modules and "yacs.config" not in sys.modules
        return path

    return write


@pytest.fixture
def kit():
    """The builders and constants of this module."""
    return SimpleNamespace(**{name: value for name, value in globals().items() if not name.startswith("_")})


@pytest.fixture
def save(tmp_path: Path):
    """Write an object with torch.save under tmp_path and return the file's path."""

    def write(obj, name: str = "ckpt.pth") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, path)
        return path

    return write
