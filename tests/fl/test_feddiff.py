"""FedDiff's pieces on a tiny U-Net: the DDPM loss and sampler, Fourier magnitude filtering, DP-SGD's accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from geofm.config.feddiff import DiffusionConfig, DiffusionPrivacyConfig, FedDiffConfig
from geofm.errors import ConfigError
from geofm.fl.oneshot import fmf
from geofm.fl.oneshot.feddiff import COUNTS, FMF_MEAN, WEIGHTS, LabelledImages, train_client
from geofm.fl.privacy import dpsgd
from geofm.fl.privacy.client_level import gaussian_noise
from geofm.models.diffusion import build_scheduler, build_unet, diffusion_loss, load_arrays, model_arrays, sample

TINY = DiffusionConfig(unet={"channels": [4, 8], "norm_groups": 2}, timesteps=20, sampling_steps=4)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models on loaded cores: one thread each."""


def _unet(bands: int = 2, classes: int = 3, size: int = 8):
    torch.manual_seed(0)
    return build_unet(TINY, bands, classes, size)


def test_the_u_net_is_class_conditional_residual_and_multi_band():
    unet = _unet(bands=5)
    assert sum(p.numel() for p in unet.parameters()) < 20_000
    assert [type(b).__name__ for b in unet.down_blocks] == ["DownBlock2D", "DownBlock2D"]
    x = torch.randn(2, 5, 8, 8)
    out = unet(x, 3, class_labels=torch.tensor([0, 0])).sample
    assert out.shape == x.shape
    assert not torch.allclose(out, unet(x, 3, class_labels=torch.tensor([1, 1])).sample), "the class changes the output"
    torch.manual_seed(1)
    other = build_unet(TINY, 5, 3, 8)
    assert not torch.equal(other(x, 3, class_labels=torch.tensor([0, 0])).sample, out)
    copy = load_arrays(other, model_arrays(unet))
    assert torch.equal(copy(x, 3, class_labels=torch.tensor([0, 0])).sample, out), "uploaded weights load back"


def test_the_loss_is_the_mse_of_the_noise_predicted_at_a_uniform_timestep():
    unet, scheduler = _unet(), build_scheduler(TINY)
    images, labels = torch.randn(4, 2, 8, 8), torch.tensor([0, 1, 2, 0])
    loss = diffusion_loss(unet, scheduler, images, labels, torch.Generator().manual_seed(7))

    generator = torch.Generator().manual_seed(7)  # the same draws, by hand
    noise = torch.randn(images.shape, generator=generator)
    t = torch.randint(0, 20, (4,), generator=generator)
    betas = torch.linspace(1e-4, 0.02, 20)  # DDPM's linear schedule
    abar = torch.cumprod(1 - betas, 0)[t].view(-1, 1, 1, 1)
    noisy = abar.sqrt() * images + (1 - abar).sqrt() * noise
    expected = ((unet(noisy, t, class_labels=labels).sample - noise) ** 2).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_sampler_runs_its_steps_from_its_generator_for_the_given_classes():
    unet, calls = _unet(), []
    unet.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(kwargs["class_labels"].tolist()), with_kwargs=True
    )
    labels = torch.tensor([2, 1])
    first = sample(unet, build_scheduler(TINY), labels, 4, torch.Generator().manual_seed(3))
    assert first.shape == (2, 2, 8, 8) and torch.isfinite(first).all()
    assert calls == [[2, 1]] * 4, "one model call per sampling step, conditioned on the labels"
    again = sample(unet, build_scheduler(TINY), labels, 4, torch.Generator().manual_seed(3))
    other = sample(unet, build_scheduler(TINY), labels, 4, torch.Generator().manual_seed(4))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_fmf_scores_are_the_distance_of_each_magnitude_to_the_client_mean():
    rng = np.random.default_rng(0)
    samples, mean = rng.normal(size=(3, 2, 4, 4)), np.abs(rng.normal(size=(2, 4, 4)))
    by_hand = [np.linalg.norm(np.abs(np.fft.fft2(z, norm="ortho")) - mean) for z in samples]
    scores = fmf.fmf_scores(torch.tensor(samples), torch.tensor(mean))
    assert scores.numpy() == pytest.approx(by_hand, rel=1e-5)
    constant = torch.full((1, 1, 4, 4), 2.0)
    magnitude = fmf.fourier_magnitude(constant)
    assert magnitude[0, 0, 0, 0].item() == pytest.approx(8.0) and magnitude.sum().item() == pytest.approx(8.0)


def test_fmf_drops_the_worst_gamma_percent():
    scores = np.array([1.0, 5.0, 3.0, 4.0, 2.0])
    assert fmf.kept(scores, 40.0).tolist() == [True, False, True, False, True]
    assert fmf.kept(scores, 0.0).all() and fmf.kept(scores, 10.0).all(), "floor(gamma% of 5) = 0 samples dropped"
    assert fmf.kept(scores, 99.0).tolist() == [True, False, False, False, False]


def test_the_bounded_mean_clips_each_magnitude_and_adds_noise_scaled_to_the_bound():
    big, small = torch.full((1, 1, 2, 2), 10.0), torch.full((1, 1, 2, 2), 0.1)
    images = torch.cat([big, small])
    total = fmf.magnitude_sum(images, bound=1.0)
    assert total.norm().item() == pytest.approx(1.0 + 0.2, rel=1e-5), "10 * 2 clipped to 1, plus 0.1 * 2"
    assert fmf.magnitude_sum(images).norm().item() == pytest.approx(20.2, rel=1e-5)
    noisy = fmf.private_mean(total, 2, 1.0, 3.0, torch.Generator().manual_seed(5))
    noise = gaussian_noise(total, 3.0, torch.Generator().manual_seed(5))
    assert torch.allclose(noisy, (total + noise) / 2)
    assert fmf.magnitude_bound(0.5, (2, 4, 4)) == pytest.approx(0.5 * math.sqrt(32))


def _images(n: int, size: int = 8) -> LabelledImages:
    rng = np.random.default_rng(0)
    samples = [
        {"image": torch.tensor(rng.normal(size=(2, size, size)), dtype=torch.float32), "label": i % 3} for i in range(n)
    ]
    return LabelledImages(samples, np.arange(n))


def _config(tmp_path, **diffusion) -> FedDiffConfig:
    tree = {
        "task": "classification",
        "run": {"output_dir": str(tmp_path), "progress": False},
        "model": {"arch": "swin_tiny_patch4_window7_224", "img_size": 32, "window_size": 4},
        "data": {
            "root": str(tmp_path),
            "bands": ["red", "green"],
            "dataset_bands": ["red", "green"],
            "mean": [0.0, 0.0],
            "std": [1.0, 1.0],
            "num_classes": 3,
            "class_names": ["a", "b", "c"],
        },
        "train": {"epochs": 1, "warmup_epochs": 0, "micro_batch_size": 4},
        "federation": {"rounds": 1, "clients": 2},
        "diffusion": {**TINY.model_dump(), "epochs": 2, "batch_size": 5, **diffusion},
    }
    return FedDiffConfig.model_validate(tree)


def test_a_client_uploads_weights_counts_and_its_mean_magnitude(tmp_path):
    cfg = _config(tmp_path, fmf_gamma=5.0)
    images = _images(10)
    upload, metrics = train_client(cfg, images, "client00")
    assert upload[COUNTS].tolist() == [4, 3, 3]
    assert upload[FMF_MEAN].shape == (2, 8, 8)
    expected = fmf.magnitude_sum(torch.stack([images[i][0] for i in range(10)])) / 10
    assert np.allclose(upload[FMF_MEAN], expected.numpy(), atol=1e-5)
    assert {k.removeprefix(WEIGHTS) for k in upload if k.startswith(WEIGHTS)} == set(_unet().state_dict())
    assert metrics["num_examples"] == 10 and metrics["steps"] == 4 and math.isfinite(metrics["loss"])
    assert "epsilon" not in metrics
    without, _ = train_client(_config(tmp_path, fmf_gamma=0.0, epochs=1), images, "client00")
    assert FMF_MEAN not in without and without[COUNTS].tolist() == [4, 3, 3], "no filtering: no mean is sent"


@pytest.mark.slow
def test_dp_sgd_reports_the_accountants_own_epsilons_composed_with_the_fourier_mean(tmp_path):
    privacy = {"epsilon": 10.0, "delta": 1e-3, "fmf_epsilon": 2.0, "seed": 0}
    cfg = _config(tmp_path, privacy=privacy, fmf_gamma=5.0)
    upload, metrics = train_client(cfg, _images(20), "client00")
    p = DiffusionPrivacyConfig(**privacy)
    rate, steps = 1 / 4, 2 * 4  # batch 5 of 20 images: 4 batches an epoch, 2 epochs
    assert metrics["steps"] == steps
    z = get_noise_multiplier(target_epsilon=10.0, target_delta=1e-3, sample_rate=rate, steps=steps, accountant="rdp")
    model, fourier, total = RDPAccountant(), RDPAccountant(), RDPAccountant()
    model.history = [(z, rate, steps)]
    fourier.history = [(dpsgd.fmf_noise_multiplier(p), 1.0, 1)]
    total.history = model.history + fourier.history
    assert metrics["epsilon_model"] == pytest.approx(model.get_epsilon(1e-3), rel=1e-9)
    assert metrics["epsilon_fmf"] == pytest.approx(fourier.get_epsilon(1e-3), rel=1e-9)
    assert metrics["epsilon"] == pytest.approx(total.get_epsilon(1e-3), rel=1e-9)
    assert 9.0 < metrics["epsilon_model"] <= 10.0 and 1.9 < metrics["epsilon_fmf"] <= 2.0
    assert max(metrics["epsilon_model"], metrics["epsilon_fmf"]) < metrics["epsilon"] < 12.0, "RDP composes tighter"
    clean, _ = train_client(_config(tmp_path, fmf_gamma=5.0), _images(20), "client00")
    assert not np.allclose(upload[FMF_MEAN], clean[FMF_MEAN], atol=0.1), "the private mean is noised"


def test_privacy_refuses_a_delta_of_one_over_n_and_layers_without_per_example_gradients(tmp_path):
    cfg = _config(tmp_path, privacy={"epsilon": 10.0, "delta": 0.1})
    with pytest.raises(ConfigError, match="not below 1 / n for a client of 10 images"):
        train_client(cfg, _images(10), "client00")
    with pytest.raises(ConfigError, match="per-example gradients"):
        dpsgd.check_private_model(torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4)))
    dpsgd.check_private_model(_unet())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"federation": {"rounds": 2, "clients": 2}}, "one-shot"),
        ({"task": "segmentation"}, "FedDiff is one-shot federated classification"),
        ({"diffusion": {"sampling_steps": 2000}}, "exceeds diffusion.timesteps"),
        ({"diffusion": {"unet": {"channels": [6], "norm_groups": 4}}}, "must divide"),
    ],
)
def test_the_config_refuses_what_feddiff_cannot_run(tmp_path, change, message):
    tree = _config(tmp_path).model_dump(mode="json")
    tree.update(change)
    if change.get("task") == "segmentation":
        tree["data"]["ignore_index"] = 255
    with pytest.raises(ConfigError, match=message):
        FedDiffConfig.from_tree(tree)
    tree = _config(tmp_path).model_dump(mode="json")
    tree["data"]["class_names"] = None
    with pytest.raises(ConfigError, match="one folder per class name"):
        FedDiffConfig.from_tree(tree)
