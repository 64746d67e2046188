import pytest
import torch

from geofm.errors import ConfigError
from geofm.tasks.mim.masking import MaskGenerator


def test_mask_ratio_and_token_resolution():
    gen = MaskGenerator(input_size=192, mask_patch_size=32, model_patch_size=4, mask_ratio=0.6)
    mask = gen(torch.Generator().manual_seed(0))
    assert mask.shape == (48, 48)
    assert int(mask.sum()) == 22 * 8 * 8  # ceil(36 * 0.6) squares of 8x8 tokens
    blocks = mask.view(6, 8, 6, 8)
    assert torch.equal(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))), "each mask patch is all or nothing"


def test_mask_is_reproducible_from_generator():
    gen = MaskGenerator(64, 16, 4, 0.5)
    a = gen(torch.Generator().manual_seed(3))
    b = gen(torch.Generator().manual_seed(3))
    c = gen(torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(
    ("size", "mask_patch", "patch", "message"),
    [(100, 32, 4, "not divisible by mask_patch_size"), (64, 16, 6, "not divisible by the backbone's patch size")],
)
def test_sizes_that_do_not_divide_are_clear_errors(size, mask_patch, patch, message):
    with pytest.raises(ConfigError, match=message):
        MaskGenerator(size, mask_patch, patch, 0.6)
