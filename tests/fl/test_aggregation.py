from __future__ import annotations

import numpy as np
import pytest
import torch

from geofm.errors import ConfigError, LayoutMismatchError
from geofm.fl.aggregation.screening import Upload, UploadRules, screen_uploads
from geofm.fl.aggregation.uploads import aggregate_uploads, weighted_mean
from geofm.fl.communication.codec import Codec, decode

N = 300


def update(seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(N, generator=torch.Generator().manual_seed(seed))


def test_weighted_by_example_counts() -> None:
    codec = Codec(bits=32)
    vectors = [update(i) for i in range(3)]
    uploads = [Upload(f"c{i}", codec.encode(v), n) for i, (v, n) in enumerate(zip(vectors, [10, 30, 60], strict=True))]
    result = aggregate_uploads(uploads, UploadRules(num_values=N, bits=32))
    assert result.weights == pytest.approx([0.1, 0.3, 0.6])
    torch.testing.assert_close(result.update, 0.1 * vectors[0] + 0.3 * vectors[1] + 0.6 * vectors[2])
    assert [a.client for a in result.accepted] == ["c0", "c1", "c2"] and not result.rejected


def test_quantised_uploads_are_decoded_before_averaging() -> None:
    codec = Codec(bits=4)
    packets = [codec.encode(update(i)) for i in range(2)]
    uploads = [Upload("a", packets[0], 1), Upload("b", packets[1].to_arrays(), 3)]
    result = aggregate_uploads(uploads, UploadRules(num_values=N, bits=4))
    torch.testing.assert_close(result.update, 0.25 * decode(packets[0]) + 0.75 * decode(packets[1]))


def test_absolute_checks() -> None:
    codec = Codec(bits=2)
    good = [Upload(f"ok{i}", codec.encode(update(i)), 5) for i in range(2)]
    broken = codec.encode(update(9)).to_arrays()
    broken["payload"] = broken["payload"][:-3]
    nan_scale = codec.encode(update(8)).to_arrays()
    nan_scale["scales"] = nan_scale["scales"].copy()
    nan_scale["scales"][0] = np.nan
    raw_nan = Codec(bits=32).encode(update(7)).to_arrays()
    raw_nan["payload"] = raw_nan["payload"].copy()
    raw_nan["payload"].view(np.float32)[4] = np.inf
    bad = [
        Upload("short", codec.encode(update(3)[:-1]), 5),
        Upload("bits", Codec(bits=4).encode(update(4)), 5),
        Upload("garbled", broken, 5),
        Upload("empty", codec.encode(update(5)), 0),
        Upload("nan", nan_scale, 5),
    ]
    accepted, rejected = screen_uploads([good[0], *bad, good[1]], UploadRules(num_values=N, bits=2))
    assert [a.client for a in accepted] == ["ok0", "ok1"]
    reasons = {r.client: r.reason for r in rejected}
    order = [r.client for r in rejected]
    assert order == ["short", "bits", "garbled", "empty", "nan"], f"rejections out of upload order: {order}"
    assert reasons["short"] == "update has 299 values; the model has 300"
    assert reasons["bits"] == "update is encoded with 4 bits; the round expects 2"
    assert reasons["garbled"].startswith("malformed packet: packet payload has 72 bytes")
    assert "0 training examples" in reasons["empty"]
    assert reasons["nan"] == "malformed packet: packet has 1 non-finite scales"
    rejected = screen_uploads([Upload("inf", raw_nan, 5)], UploadRules(num_values=N, bits=32))[1]
    assert rejected[0].reason == "update decodes to 1 NaN or Inf values (32-bit packet)"


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_a_packet_with_huge_finite_scales_is_rejected_at_every_bit_width(bits: int) -> None:
    """Finite scales near float32's limit decode to infinities or to a norm that overflows: never averaged."""
    codec = Codec(bits=bits)
    poisoned = codec.encode(update(1)).to_arrays()
    poisoned["scales"] = np.full_like(poisoned["scales"], np.finfo(np.float32).max)
    good = Upload("good", codec.encode(update(2)), 10)
    result = aggregate_uploads([good, Upload("poisoned", poisoned, 10)], UploadRules(num_values=N, bits=bits))
    assert [a.client for a in result.accepted] == ["good"]
    assert result.rejected[0].client == "poisoned" and f"({bits}-bit packet)" in result.rejected[0].reason
    assert bool(torch.isfinite(result.update).all())


def test_norm_outlier_rejected_with_three_or_more_uploads() -> None:
    codec = Codec(bits=32)
    rules = UploadRules(num_values=N, bits=32, norm_factor=5.0)
    normal = [Upload(f"c{i}", codec.encode(update(i)), 10) for i in range(3)]
    huge = Upload("huge", codec.encode(update(9, scale=50.0)), 10)
    accepted, rejected = screen_uploads([normal[0], huge, normal[1], normal[2]], rules)
    assert [a.client for a in accepted] == ["c0", "c1", "c2"]
    assert len(rejected) == 1 and rejected[0].client == "huge"
    assert "exceeds 5 x the round's median norm" in rejected[0].reason
    slightly = Upload("big", codec.encode(update(9, scale=4.0)), 10)
    assert not screen_uploads([*normal, slightly], rules)[1], "an update within the factor was rejected"
    # Two uploads: only the absolute checks apply.
    accepted, rejected = screen_uploads([normal[0], huge], rules)
    assert len(accepted) == 2 and not rejected


def test_with_fewer_than_three_uploads_the_recent_rounds_norms_are_the_reference() -> None:
    codec = Codec(bits=32)
    rules = UploadRules(num_values=N, bits=32, norm_factor=5.0)
    normal, huge = Upload("c0", codec.encode(update(0)), 10), Upload("huge", codec.encode(update(9, scale=50.0)), 10)
    typical = float(torch.linalg.vector_norm(update(1)))
    accepted, rejected = screen_uploads([normal, huge], rules, recent_norms=[typical] * 3)
    assert [a.client for a in accepted] == ["c0"]
    assert rejected[0].client == "huge" and "median norm of the last 3 accepted updates" in rejected[0].reason
    accepted, rejected = screen_uploads([huge], rules, recent_norms=[typical] * 3)
    assert not accepted and rejected[0].client == "huge", "a single upload is bounded by the history too"
    # Fewer than three remembered norms: no reference yet, only the absolute checks.
    assert len(screen_uploads([normal, huge], rules, recent_norms=[typical] * 2)[0]) == 2


def test_a_claimed_example_count_is_bounded_by_the_other_uploads_and_the_declaration() -> None:
    codec = Codec(bits=32)
    vectors = [update(i) for i in range(3)]
    rules = UploadRules(num_values=N, bits=32, examples_factor=10.0)
    claims = {"a": 100, "b": 100, "greedy": 10**9}
    uploads = [Upload(c, codec.encode(v), n) for (c, n), v in zip(claims.items(), vectors, strict=True)]
    result = aggregate_uploads(uploads, rules)
    # greedy counts as 10 x the median of the others' 100 = 1000: 1000 / 1200 of the weight, not ~1.
    assert result.weights == pytest.approx([100 / 1200, 100 / 1200, 1000 / 1200])
    assert result.bounded == {"greedy": (10**9, 1000)}
    torch.testing.assert_close(result.update, (100 * vectors[0] + 100 * vectors[1] + 1000 * vectors[2]) / 1200)
    two = aggregate_uploads(uploads[1:], rules)
    assert two.weights == pytest.approx([100 / 1100, 1000 / 1100]), "two uploads are bounded by each other"
    declared = UploadRules(num_values=N, bits=32, examples_factor=None, declared_examples={"greedy": 50})
    assert aggregate_uploads(uploads, declared).weights == pytest.approx([100 / 250, 100 / 250, 50 / 250])
    unbounded = UploadRules(num_values=N, bits=32, examples_factor=None)
    assert aggregate_uploads(uploads, unbounded).bounded == {}


def test_nothing_accepted_gives_no_update() -> None:
    result = aggregate_uploads([Upload("x", Codec(bits=8).encode(update(0)), 3)], UploadRules(num_values=N, bits=1))
    assert result.update is None and result.weights == [] and result.rejected[0].client == "x"


def test_weighted_mean_and_rules_validation() -> None:
    torch.testing.assert_close(weighted_mean([torch.ones(3), torch.zeros(3)], [1, 3]), torch.full((3,), 0.25))
    with pytest.raises(LayoutMismatchError):
        weighted_mean([torch.ones(3), torch.ones(4)], [1, 1])
    with pytest.raises(ValueError, match="positive sum"):
        weighted_mean([torch.ones(3)], [0])
    with pytest.raises(ConfigError, match="norm_factor"):
        UploadRules(num_values=N, bits=1, norm_factor=1.0)
