"""Task models: output shapes, the siamese backbone, the SR decoder, layer decay over timm's groups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from geofm.errors import ConfigError
from geofm.models.decoders import SimpleFeaturePyramid
from geofm.tasks.finetuning.model import build_finetune_model


@pytest.fixture
def make_model(task_config):
    def make(task: str, family: str = "swin", **sections):
        return build_finetune_model(task_config(task, family=family, **sections))[0]

    return make


@pytest.mark.parametrize("family", ["swin", "vit"])
def test_upernet_gives_full_resolution_logits(family, make_model):
    torch.manual_seed(0)
    model = make_model("segmentation", family, model={"img_size": 64})
    logits = model(torch.randn(2, 4, 64, 64))
    assert logits.shape == (2, 3, 64, 64), f"{family}: logits {tuple(logits.shape)} instead of one per class and pixel"
    features = model.features(torch.randn(2, 4, 64, 64))
    assert [f.shape[-1] for f in features] == [16, 8, 4, 2], "features at strides 4, 8, 16, 32 feed UperNet"


@pytest.mark.slow  # the config's check builds timm's swinv2_tiny on the meta device first
def test_a_swin_v2_backbone_feeds_upernet_with_its_stages_and_layer_decay_with_its_blocks(make_model):
    torch.manual_seed(0)
    model = make_model("segmentation", model={"arch": "swinv2_tiny_window8_256", "img_size": 64})
    assert model(torch.randn(2, 4, 64, 64)).shape == (2, 3, 64, 64)
    assert [f.shape[-1] for f in model.features(torch.randn(2, 4, 64, 64))] == [16, 8, 4, 2]
    names = {id(p): n for n, p in model.named_parameters()}
    scales = {names[id(p)]: g["lr_scale"] for g in model.param_groups(0.05, 0.9) for p in g["params"]}
    assert scales["backbone.patch_embed.proj.weight"] == pytest.approx(0.9 ** (1 + 1 + 2 + 1 + 1))


def test_vit_pyramid_rescales_block_outputs_to_strides_4_to_32():
    pyramid = SimpleFeaturePyramid(channels=8, patch_size=16)
    maps = pyramid([torch.randn(1, 8, 4, 4) for _ in range(4)])
    assert [tuple(m.shape) for m in maps] == [(1, 8, 16, 16), (1, 8, 8, 8), (1, 8, 4, 4), (1, 8, 2, 2)]
    assert isinstance(pyramid.levels[2], torch.nn.Identity), "the patch stride (16) is the block output itself"


def test_vit_dense_head_taps_the_configured_blocks(make_model):
    model = make_model("segmentation", "vit", head={"options": {"channels": 16, "feature_blocks": [1, 2, 3, 4]}})
    assert model.indices == [0, 1, 2, 3], "feature_blocks are 1-based block numbers"
    deeper = make_model("segmentation", "vit", model={"timm_kwargs": {"embed_dim": 32, "depth": 8, "num_heads": 2}})
    assert deeper.indices == [1, 3, 5, 7], "default: blocks at a quarter, half, three quarters and all of the depth"


def test_change_detector_runs_one_shared_backbone_on_the_feature_difference(make_model):
    torch.manual_seed(0)
    model = make_model("change").eval()
    backbones = [m for name, m in model.named_modules() if type(m).__name__ == "SwinTransformer"]
    assert len(backbones) == 1, f"expected one (siamese) backbone, found {len(backbones)}"
    backbone_params = sum(p.numel() for p in model.backbone.parameters())
    head_params = sum(p.numel() for p in model.head.parameters())
    assert sum(p.numel() for p in model.parameters()) == backbone_params + head_params, "no second encoder"
    a, b = torch.randn(2, 4, 32, 32), torch.randn(2, 4, 32, 32)
    with torch.no_grad():
        out = model(a, b)
        assert out.shape == (2, 2, 32, 32)
        assert torch.allclose(out, model(b, a), atol=1e-5), "|f1 - f2| does not depend on the order of the dates"
        same = model(a, a)
        zero = model.head([torch.zeros_like(f) for f in model.features(a)])
        assert torch.allclose(same, zero, atol=1e-5), "identical dates give the head an all-zero difference"


def test_superres_reaches_the_input_resolution_then_upsamples_by_the_scale(make_model):
    torch.manual_seed(0)
    model = make_model("superres", data={"scale_factor": 4})
    image = torch.randn(2, 4, 32, 32)
    decoded = {}

    def record(module, args, out):
        decoded["shape"] = tuple(out.shape)

    model.head.decoder.register_forward_hook(record)
    out = model(image)
    assert decoded["shape"] == (2, 4, 32, 32), (
        "the SimMIM-style decoder ends at the input resolution (hidden channels 4)"
    )
    assert out.shape == (2, 4, 128, 128), "the upsampler multiplies the resolution by the scale factor"


def _learned_part_off(model) -> None:
    """Zero the upsampler's last convolution: the model's output is then its residual alone."""
    torch.nn.init.zeros_(model.head.upsampler[-1].weight)
    torch.nn.init.zeros_(model.head.upsampler[-1].bias)


def test_superres_outputs_the_high_resolution_bands_and_adds_the_inputs_of_the_same_name(make_model):
    # inputs: red, green, blue, nir, mean 0.25 and std 0.1 after scale; outputs: red, green, pan
    hr = {
        "dataset_bands": ["pan", "green", "red"],
        "bands": ["red", "green", "pan"],
        "mean": [0.2, 0.1, 0.5],
        "std": [0.1, 0.05, 0.2],
    }
    model = make_model("superres", data={"hr": hr})
    _learned_part_off(model)
    image = torch.randn(2, 4, 32, 32)
    with torch.no_grad():
        out = model(image)
    assert out.shape == (2, 3, 64, 64), "the head outputs the high-resolution side's bands"
    up = F.interpolate(image, scale_factor=2, mode="bicubic", align_corners=False)
    scaled = up * 0.1 + 0.25  # the inputs in scaled units
    torch.testing.assert_close(out[:, 0], (scaled[:, 0] - 0.5) / 0.2, msg="red: the input's red, renormalised")
    torch.testing.assert_close(out[:, 1], (scaled[:, 1] - 0.1) / 0.05, msg="green: the input's green, renormalised")
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2])), "pan has no input band of its name: learned whole"
    assert not [k for k in model.state_dict() if k.startswith("head.") and "residual" in k], "nothing new to save"


def test_superres_with_one_band_spec_adds_the_upsampled_input_itself(make_model):
    model = make_model("superres")
    _learned_part_off(model)
    image = torch.randn(2, 4, 32, 32)
    with torch.no_grad():
        out = model(image)
    assert torch.equal(out, F.interpolate(image, scale_factor=2, mode="bicubic", align_corners=False))
    residual_off = make_model("superres", head={"options": {"channels": 4, "residual": False}})
    _learned_part_off(residual_off)
    with torch.no_grad():
        assert torch.equal(residual_off(image), torch.zeros(2, 4, 64, 64))


@pytest.mark.parametrize(("family", "blocks"), [("swin", 1 + 1 + 2 + 1), ("vit", 4)])
@pytest.mark.parametrize("task", ["classification", "segmentation"])
def test_layer_decay_scales_the_patch_embedding_by_decay_to_the_blocks_plus_one(family, blocks, task, make_model):
    model = make_model(task, family)
    names = {id(p): n for n, p in model.named_parameters()}
    scales = {names[id(p)]: g["lr_scale"] for g in model.param_groups(0.05, 0.9) for p in g["params"]}
    head = max(scales.values())
    assert head == 1.0, "the head trains at the full learning rate"
    assert scales["backbone.patch_embed.proj.weight"] == pytest.approx(0.9 ** (blocks + 1) * head), (
        "timm's groups: stem, one per block, head: the patch embedding is blocks + 1 groups below the head"
    )
    top = [n for n, s in scales.items() if s == head]
    assert all(not n.startswith("backbone.") or n.startswith("backbone.head") for n in top), (
        f"only the head/decoder is in the top group: {top}"
    )


def test_no_weight_decay_on_norms_biases_and_position_tables(make_model):
    model = make_model("segmentation")
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    decayed = {names[id(p)] for g in model.param_groups(0.05, 0.9) if g["weight_decay"] for p in g["params"]}
    wrong = [n for n in decayed if "relative_position_bias_table" in n or params[n].ndim < 2]
    assert not wrong, f"weight decay on norms, biases or position tables: {wrong}"
    assert "backbone.patch_embed.proj.weight" in decayed and any(n.startswith("head.decoder") for n in decayed)


def test_frozen_backbone_gets_no_gradients_and_stays_in_eval_mode(make_model):
    model = make_model("classification", model={"frozen": True}).train()
    assert not model.backbone.training, "a frozen backbone keeps eval mode (no drop path)"
    trained = {
        n
        for g in model.param_groups(0.05, 0.9)
        for n, p in model.named_parameters()
        if any(p is q for q in g["params"])
    }
    assert trained == {"backbone.head.fc.weight", "backbone.head.fc.bias"}, (
        f"linear probe trains the classifier only: {trained}"
    )
    model(torch.randn(2, 4, 32, 32)).sum().backward()
    assert model.backbone.patch_embed.proj.weight.grad is None
    assert model.backbone.head.fc.weight.grad is not None


def test_head_settings_are_checked(task_config):
    with pytest.raises(ConfigError, match=r"head\.options\.feature_blocks choose the blocks of a ViT"):
        task_config("segmentation", head={"options": {"feature_blocks": [1, 2, 3, 4]}})
    with pytest.raises(ConfigError, match=r"4 increasing blocks in \[1, 4\]"):
        task_config("segmentation", family="vit", head={"options": {"feature_blocks": [1, 2, 3, 5]}})
    with pytest.raises(ConfigError, match=r"head\.options: linear takes no options, got \['channels'\]"):
        task_config("classification", head={"options": {"channels": 16}})
    with pytest.raises(ConfigError, match=r"head\.options\.residual: Input should be a valid boolean"):
        task_config("superres", head={"options": {"residual": "sometimes"}})
    with pytest.raises(
        ConfigError,
        match=r"decoder_channels: a head.s own settings go in head\.options \(geofm list heads\); write options: \{channels: \.\.\.\}",
    ):
        task_config("segmentation", head={"decoder_channels": 16})
    with pytest.raises(ConfigError, match="multiple of 32"):
        task_config("segmentation", family="vit", model={"img_size": 48})
