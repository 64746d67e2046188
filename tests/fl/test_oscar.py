"""OSCAR's pieces on tiny models: classifier-free guidance, condition dropout, a client's class embeddings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from geofm.config.oneshot import DDPMConfig
from geofm.fl.oneshot.feddiff import COUNTS, LabelledImages
from geofm.fl.oneshot.oscar import EMBEDDINGS, class_embeddings
from geofm.models.diffusion import build_embedding_unet, build_scheduler, drop_conditions, guided_noise, sample

TINY = DDPMConfig(unet={"channels": [4, 8], "norm_groups": 2}, timesteps=20, sampling_steps=4)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models on loaded cores: one thread each."""


def test_guidance_extrapolates_from_the_null_condition_by_w():
    conditional, unconditional = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5, 3.0, -1.0])
    assert guided_noise(conditional, unconditional, 2.0).tolist() == [2.0, 0.0, -1.0]  # 3 * c - 2 * u
    assert torch.equal(guided_noise(conditional, unconditional, 0.0), conditional), "w = 0: the conditional model"


def test_the_embedding_unet_is_conditioned_and_the_guided_sampler_asks_both_halves_at_once():
    torch.manual_seed(0)
    unet = build_embedding_unet(TINY, 2, 5, 8)
    x, condition = torch.randn(2, 2, 8, 8), torch.randn(2, 5)
    out = unet(x, 3, class_labels=condition).sample
    assert out.shape == x.shape and not torch.allclose(out, unet(x, 3, class_labels=torch.zeros(2, 5)).sample)
    calls = []
    unet.register_forward_hook(
        lambda m, args, kwargs, o: calls.append(kwargs["class_labels"].clone()), with_kwargs=True
    )
    images = sample(unet, build_scheduler(TINY), condition, 4, torch.Generator().manual_seed(1), guidance_scale=2.0)
    assert images.shape == (2, 2, 8, 8) and torch.isfinite(images).all()
    assert len(calls) == 4, "one forward pass per step"
    for labels in calls:
        assert torch.equal(labels[:2], condition) and torch.equal(labels[2:], torch.zeros(2, 5))


def test_condition_dropout_zeroes_whole_rows_with_probability_p_uncond():
    conditions = torch.randn(8, 3) + 5.0
    dropped = drop_conditions(conditions, 0.5, torch.Generator().manual_seed(3))
    keep = torch.rand(8, generator=torch.Generator().manual_seed(3)) >= 0.5  # the same draw, by hand
    assert torch.equal(dropped[keep], conditions[keep]) and (dropped[~keep] == 0).all()
    assert 0 < keep.sum() < 8
    assert torch.equal(drop_conditions(conditions, 0.0, torch.Generator().manual_seed(3)), conditions)
    many = drop_conditions(torch.ones(20_000, 2), 0.1, torch.Generator().manual_seed(0))
    assert (many.sum(1) == 0).float().mean().item() == pytest.approx(0.1, abs=0.01)


class MeanEncoder(nn.Module):
    """A stand-in encoder: the mean of each band (its ``num_features`` is the band count)."""

    num_features = 2

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.mean(dim=(2, 3))


def test_a_client_uploads_the_mean_embedding_of_each_class_it_holds_and_its_counts():
    rng = np.random.default_rng(0)
    labels = [0, 2, 0, 2, 2]  # class 1 absent
    samples = [{"image": torch.tensor(rng.normal(size=(2, 4, 4)), dtype=torch.float32), "label": k} for k in labels]
    upload = class_embeddings(MeanEncoder(), LabelledImages(samples, np.arange(5)), 3, batch_size=2)
    assert upload[COUNTS].tolist() == [2, 0, 3] and upload[COUNTS].dtype == np.int64
    by_hand = [np.mean([s["image"].numpy().mean(axis=(1, 2)) for s in samples if s["label"] == k], 0) for k in (0, 2)]
    assert upload[EMBEDDINGS].dtype == np.float32 and upload[EMBEDDINGS].shape == (2, 2), "only the classes held"
    assert np.allclose(upload[EMBEDDINGS], by_hand, atol=1e-6)
    assert sum(a.nbytes for a in upload.values()) == 2 * 2 * 4 + 3 * 8
