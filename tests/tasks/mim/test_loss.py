import torch

from geofm.tasks.mim.loss import gfm_loss, masked_l1_loss, negative_cosine_loss, pooled_negative_cosine_loss


def test_masked_l1_matches_simmim_formula():
    torch.manual_seed(0)
    x, rec = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    mask = (torch.rand(2, 1, 8, 8) > 0.5).float()
    simmim = (torch.abs(rec - x) * mask).sum() / (mask.sum() + 1e-5) / 4
    assert torch.allclose(masked_l1_loss(rec, x, mask), simmim, atol=1e-5)


def test_unmasked_and_invalid_pixels_do_not_count():
    x = torch.zeros(1, 2, 4, 4)
    rec = torch.zeros(1, 2, 4, 4)
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., :2, :] = 1
    rec[..., 2:, :] = 100.0  # error only where unmasked
    assert masked_l1_loss(rec, x, mask) == 0
    rec[:, 1, :2, :] = 7.0  # error in band 1 of masked pixels, but band 1 is nodata
    valid = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    valid[:, 1] = False
    assert masked_l1_loss(rec, x, mask, valid) == 0
    assert masked_l1_loss(rec, x, mask) > 0


def test_negative_cosine_aligns_grids_and_is_minus_one_for_equal_features():
    feats = torch.randn(2, 4, 4, 8)
    assert torch.allclose(negative_cosine_loss(feats, feats), torch.tensor(-1.0), atol=1e-6)
    coarse = torch.randn(2, 2, 2, 8)
    assert negative_cosine_loss(feats, coarse).shape == ()


def test_gfm_loss_combines_with_alpha():
    torch.manual_seed(1)
    x, rec = torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8)
    mask = torch.ones(1, 1, 8, 8)
    s, t = torch.randn(1, 2, 2, 5), torch.randn(1, 2, 2, 5)
    out = gfm_loss(rec, x, mask, None, s, t, alpha=0.5)
    assert torch.allclose(out["loss"], out["loss_mim"] + 0.5 * out["loss_distill"])
    plain = gfm_loss(rec, x, mask)
    assert plain["loss_distill"] == 0 and torch.equal(plain["loss"], plain["loss_mim"])


def test_pooled_distillation_is_gfms_formula_on_hand_computed_values():
    """GFM: avgpool the stage-3 tokens of student (projected) and teacher, one negative cosine per image."""
    student = torch.tensor([[[[1.0, 0.0], [3.0, 0.0]], [[0.0, 2.0], [0.0, 2.0]]]])  # 1 image, 2x2 tokens, 2 channels
    teacher = torch.tensor([[[[0.0, 1.0]]]])  # 1x1 grid: grids may differ
    # pooled student = ((1+3+0+0)/4, (0+0+2+2)/4) = (1, 1); cos((1, 1), (0, 1)) = 1/sqrt(2)
    assert torch.isclose(pooled_negative_cosine_loss(student, teacher), torch.tensor(-(0.5**0.5)))
    second = torch.tensor([[[[2.0, 0.0]]]])  # cos((1, 1), (2, 0)) = 1/sqrt(2) as well; a batch mean of per-image terms
    batch = pooled_negative_cosine_loss(torch.cat([student, student]), torch.cat([teacher, -second]))
    assert torch.isclose(batch, torch.tensor((-(0.5**0.5) + 0.5**0.5) / 2), atol=1e-7)


def test_pooled_and_token_distillation_differ_and_are_both_selectable():
    torch.manual_seed(2)
    s, t = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4)
    x, rec, mask = torch.randn(2, 1, 4, 4), torch.randn(2, 1, 4, 4), torch.ones(2, 1, 4, 4)
    pooled = gfm_loss(rec, x, mask, None, s, t)["loss_distill"]
    tokens = gfm_loss(rec, x, mask, None, s, t, distill_loss="token_cosine")["loss_distill"]
    assert torch.isclose(pooled, pooled_negative_cosine_loss(s, t)) and torch.isclose(
        tokens, negative_cosine_loss(s, t)
    )
    assert not torch.isclose(pooled, tokens)
