from __future__ import annotations

import torch

from geofm.data.transforms import PretrainAugmentation


def _ramps() -> tuple[torch.Tensor, torch.Tensor]:
    """Image holding each pixel's column and row, and a valid mask that is a function of them.

    Resampling keeps linear ramps linear, so after any crop and flip the image still tells each
    output pixel's source position, and the mask must agree with it away from its edges.
    """
    yy, xx = torch.meshgrid(torch.arange(64.0), torch.arange(64.0), indexing="ij")
    image = torch.stack([xx, yy, xx + yy])
    valid = ((xx < 32) ^ (yy < 24)).expand(3, 64, 64).clone()
    return image, valid


def test_shapes_and_types() -> None:
    image, valid = _ramps()
    out_image, out_valid = PretrainAugmentation(32)(image, valid)
    assert out_image.shape == out_valid.shape == (3, 32, 32)
    assert out_image.dtype == torch.float32 and out_valid.dtype == torch.bool
    assert type(out_image) is torch.Tensor and type(out_valid) is torch.Tensor


def test_image_and_valid_stay_aligned() -> None:
    image, valid = _ramps()
    augment = PretrainAugmentation(48, scale=(0.3, 1.0))
    for seed in range(20):
        torch.manual_seed(seed)
        out_image, out_valid = augment(image, valid)
        x, y = out_image[0], out_image[1]
        expected = (x < 32) ^ (y < 24)
        away = ((x - 31.5).abs() > 1.5) & ((y - 23.5).abs() > 1.5)
        assert away.float().mean() > 0.5
        for band in range(3):
            assert torch.equal(out_valid[band][away], expected[away]), f"seed {seed}, band {band}"


def test_same_seed_same_output_and_randomness_used() -> None:
    image = torch.rand(2, 40, 40)
    valid = torch.rand(2, 40, 40) > 0.2
    augment = PretrainAugmentation(24)
    outputs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outputs.append(augment(image, valid))
    torch.testing.assert_close(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])
    assert not torch.equal(outputs[0][0], outputs[2][0])


def test_flip_only() -> None:
    image = torch.rand(1, 16, 16)
    valid = image > 0.5
    augment = PretrainAugmentation(16, scale=(1.0, 1.0), hflip=True, vflip=False)
    seen = set()
    for seed in range(16):
        torch.manual_seed(seed)
        out_image, out_valid = augment(image, valid)
        flipped = torch.allclose(out_image, image.flip(-1), atol=1e-5)
        assert flipped or torch.allclose(out_image, image, atol=1e-5)
        assert torch.equal(out_valid, valid.flip(-1) if flipped else valid)
        seen.add(flipped)
    assert seen == {True, False}
