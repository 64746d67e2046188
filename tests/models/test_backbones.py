"""Backbones at another input size than they were built for (whole-scene prediction in other tiles)."""

from __future__ import annotations

import pytest
import torch

from geofm.models.backbones import resize_input


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_swin_keeps_its_trained_windows_and_tables_on_larger_inputs(tiny_swin):
    model = tiny_swin(img_size=64, window_size=4).eval()
    trained = _state(model)
    windows = [block.window_size for stage in model.layers for block in stage.blocks]
    assert windows[-1] == (2, 2), "the last stage (2x2 tokens at 64 px) uses a 2x2 window"
    resize_input(model, 128)
    assert [block.window_size for stage in model.layers for block in stage.blocks] == windows
    state = model.state_dict()
    assert state.keys() == trained.keys() and all(torch.equal(state[k], trained[k]) for k in trained)
    with torch.no_grad():
        features = model.forward_intermediates(torch.randn(1, 3, 128, 128), intermediates_only=True)
    assert [tuple(f.shape[-2:]) for f in features] == [(32, 32), (16, 16), (8, 8), (4, 4)]
    resize_input(model, 64)
    state = model.state_dict()
    assert all(torch.equal(state[k], trained[k]) for k in trained), "back at its own size, it is the trained model"


def test_swin_on_smaller_inputs_shrinks_windows_to_the_feature_maps(tiny_swin):
    model = tiny_swin(img_size=64, window_size=4).eval()
    resize_input(model, 32)
    assert model.layers[2].blocks[0].window_size == (2, 2)
    with torch.no_grad():
        features = model.forward_intermediates(torch.randn(1, 3, 32, 32), intermediates_only=True)
    assert [tuple(f.shape[-2:]) for f in features] == [(8, 8), (4, 4), (2, 2), (1, 1)]


def test_vit_resamples_its_position_embedding(tiny_vit):
    model = tiny_vit(img_size=64).eval()
    before = model.pos_embed.detach().clone()
    resize_input(model, 128)
    assert model.pos_embed.shape[1] == 1 + 8 * 8 and before.shape[1] == 1 + 4 * 4
    assert torch.equal(model.pos_embed[:, :1], before[:, :1]), "the class token's entry is kept"
    with torch.no_grad():
        assert model.forward_features(torch.randn(1, 3, 128, 128)).shape == (1, 65, 32)


@pytest.mark.parametrize("size", [0, -32])
def test_sizes_must_be_positive(tiny_swin, size):
    with pytest.raises(ValueError, match="positive"):
        resize_input(tiny_swin(), size)
