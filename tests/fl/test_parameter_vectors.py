from __future__ import annotations

import pytest
import torch
from torch import nn

from geofm.errors import LayoutMismatchError
from geofm.fl.parameter_vectors import ParameterLayout


def small_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).to(dtype)
    model[1].bias.requires_grad_(False)
    return model


def test_layout_of_trainable_parameters() -> None:
    layout = ParameterLayout.of(small_model())
    assert layout.names == ("0.weight", "0.bias", "1.weight", "2.weight", "2.bias"), "frozen 1.bias must be left out"
    assert layout.shapes == ((4, 3), (4,), (4,), (2, 4), (2,))
    assert layout.numel == 12 + 4 + 4 + 8 + 2
    assert ParameterLayout.of(small_model()) == layout


def test_flatten_unflatten_assign_round_trip() -> None:
    model = small_model()
    layout = ParameterLayout.of(model)
    vector = layout.flatten_module(model)
    assert vector.dtype == torch.float32 and vector.shape == (layout.numel,)
    assert not vector.requires_grad
    torch.testing.assert_close(vector[:12], model[0].weight.detach().flatten())
    tensors = layout.unflatten(vector * 2)
    torch.testing.assert_close(tensors["2.weight"], model[2].weight.detach() * 2)
    layout.assign(model, vector * 2)
    torch.testing.assert_close(layout.flatten_module(model), vector * 2)
    assert torch.equal(layout.flatten(tensors), vector * 2), "flatten of a name mapping differs"
    assert model[1].bias.detach().eq(0).all(), "assign touched a frozen parameter"


def test_bf16_parameters_flatten_to_float32() -> None:
    model = small_model(torch.bfloat16)
    layout = ParameterLayout.of(model)
    vector = layout.flatten_module(model)
    assert vector.dtype == torch.float32
    assert all(t.dtype == torch.bfloat16 for t in layout.unflatten(vector).values())
    layout.assign(model, vector + 1)
    assert model[0].weight.dtype == torch.bfloat16


def test_vector_of_wrong_length_names_both_lengths() -> None:
    model = small_model()
    layout = ParameterLayout.of(model)
    with pytest.raises(LayoutMismatchError, match="vector has 29 values, the layout of 5 tensors expects 30"):
        layout.assign(model, torch.zeros(29))
    with pytest.raises(LayoutMismatchError, match="1-D"):
        layout.unflatten(torch.zeros(2, 15))


def test_mismatched_module_and_tensors() -> None:
    layout = ParameterLayout.of(small_model())
    other = nn.Sequential(nn.Linear(3, 5))
    with pytest.raises(LayoutMismatchError, match="missing"):
        layout.flatten_module(other)
    tensors = [torch.zeros(s) for s in layout.shapes]
    tensors[3] = torch.zeros(4, 2)
    with pytest.raises(LayoutMismatchError, match=r"'2.weight' has shape \(4, 2\), layout expects \(2, 4\)"):
        layout.flatten(tensors)
    with pytest.raises(LayoutMismatchError, match="unexpected \\['extra'\\]"):
        layout.flatten(
            {**dict(zip(layout.names, [torch.zeros(s) for s in layout.shapes], strict=False)), "extra": torch.zeros(1)}
        )


def test_layout_records_the_normalisation_parameters_and_their_kind() -> None:
    model = nn.Sequential(
        nn.Linear(3, 4), nn.BatchNorm1d(4), nn.LayerNorm(4), nn.Sequential(nn.GroupNorm(2, 4)), nn.Linear(4, 2)
    )
    model[2].bias.requires_grad_(False)
    layout = ParameterLayout.of(model)
    assert layout.norms == (
        ("1.weight", "batchnorm"),
        ("1.bias", "batchnorm"),
        ("2.weight", "layernorm"),
        ("3.0.weight", "groupnorm"),
        ("3.0.bias", "groupnorm"),
    ), "a frozen parameter is no part of the layout, nor of its norms"
    shared = layout.select(lambda name: not name.startswith("3."))
    assert shared.norms == layout.norms[:3] and shared.names == (
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.weight",
        "4.weight",
        "4.bias",
    )
