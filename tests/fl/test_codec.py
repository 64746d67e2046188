from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from geofm.errors import CodecError, ConfigError
from geofm.fl.communication.codec import BITS, HEADER_BYTES, Codec, Packet, decode


def bucket_view(values: torch.Tensor, bucket: int) -> list[torch.Tensor]:
    """The buckets of a vector, the last one possibly short."""
    return list(torch.split(values, bucket))


def per_value(scales: torch.Tensor, n: int, bucket: int) -> torch.Tensor:
    """Each value's bucket scale."""
    return scales.repeat_interleave(bucket)[:n]


def rounded_reference(g: torch.Tensor, scales: torch.Tensor, bits: int, bucket: int) -> torch.Tensor:
    """What deterministic quantisation must give: round(g / scale * levels) * scale / levels, value by value.

    The float32 operations are the codec's own, in its order, so ties round the same way.
    """
    levels = 2 ** (bits - 1) - 1
    inverse = torch.where(scales > 0, levels / scales, torch.zeros_like(scales))
    code = torch.floor(g * per_value(inverse, g.numel(), bucket) + (levels + 0.5)).clamp(0, 2 * levels)
    return (code - levels) * per_value(scales / levels, g.numel(), bucket)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    n, bucket, draws = 600, 100, 1500
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    codec = Codec(bits=bits, bucket_size=bucket)
    decoded = torch.stack([decode(codec.encode(g, generator)) for _ in range(draws)])
    scales = codec.encode(g).scales
    step = per_value(scales, n, bucket) / (2 ** (bits - 1) - 1)
    # One draw rounds |g| / step up with probability f (its fractional part): variance step^2 f (1 - f).
    fraction = torch.frac(g.abs() / step)
    std_of_mean = step * torch.sqrt(fraction * (1 - fraction) / draws)
    tolerance = 6 * std_of_mean + step * 2.0**-14
    error = (decoded.mean(0) - g).abs()
    assert bool((error <= tolerance).all()), (
        f"{bits}-bit stochastic rounding is biased: worst |mean - G| is {float((error - tolerance).max()):.3g} "
        f"above the 6-sigma tolerance"
    )
    # The same check catches a biased quantiser: deterministic rounding fails it.
    deterministic = decode(Codec(bits=bits, bucket_size=bucket, stochastic=False).encode(g))
    assert not bool(((deterministic - g).abs() <= tolerance).all()), "the check cannot tell a biased rounding"


@pytest.mark.parametrize("stochastic", [True, False])
def test_eight_bit_round_trip_within_one_step(stochastic: bool) -> None:
    n, bucket = 5000, 512
    g = torch.randn(n, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 10, n)
    packet = Codec(bits=8, bucket_size=bucket, stochastic=stochastic).encode(g, torch.Generator().manual_seed(2))
    expected_scales = torch.stack([b.abs().max() for b in bucket_view(g, bucket)])
    assert torch.equal(packet.scales, expected_scales), "8-bit scales are not the buckets' max-abs"
    step = per_value(packet.scales, n, bucket) / 127
    error = (decode(packet) - g).abs()
    bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-5)
    assert bool((error <= bound).all()), f"8-bit round trip off by {float((error / step).max()):.3f} steps"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(("n", "bucket"), [(1, 512), (7, 3), (1000, 512), (4099, 64), (777, None)])
def test_payload_is_densely_packed(bits: int, n: int, bucket: int | None) -> None:
    codec = Codec(bits=bits, bucket_size=bucket)
    packet = codec.encode(torch.randn(n, generator=torch.Generator().manual_seed(n)))
    assert packet.payload.numel() == math.ceil(n * bits / 8), "payload is not ceil(n * bits / 8) bytes"
    scales = 0 if bits == 32 else (1 if bucket is None else math.ceil(n / bucket))
    assert packet.scales.numel() == scales
    assert packet.nbytes == packet.payload.numel() + 4 * scales + HEADER_BYTES
    assert HEADER_BYTES <= 32, "the header is no longer small"
    arrays = packet.to_arrays()
    assert sum(a.nbytes for a in arrays.values()) == packet.nbytes == codec.packet_nbytes(n)
    assert {k: a.dtype for k, a in arrays.items()} == {"header": np.int64, "payload": np.uint8, "scales": np.float32}


def test_one_bit_swin_t_upload_is_28x_smaller_than_fp32() -> None:
    n = 28_000_000  # a Swin-T's parameters
    update = torch.randn(n, generator=torch.Generator().manual_seed(0))
    packet = Codec(bits=1).encode(update)
    on_the_wire = sum(a.nbytes for a in packet.to_arrays().values())
    assert on_the_wire == packet.nbytes == Codec(bits=1).packet_nbytes(n), "what travels is what is counted"
    ratio = update.numel() * update.element_size() / on_the_wire
    assert ratio >= 28, f"a 1-bit upload of {n} values is only {ratio:.1f}x smaller than float32"


def test_one_bit_sends_scaled_sign_with_l1_mean_scale_per_bucket() -> None:
    n, bucket = 1100, 512  # the last bucket has 76 values
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    g[5] = 0.0
    packet = Codec(bits=1, bucket_size=bucket).encode(g)
    expected = torch.stack([b.abs().sum() / b.numel() for b in bucket_view(g, bucket)])
    torch.testing.assert_close(packet.scales, expected, msg="1-bit scales are not L1 / bucket length")
    assert packet.scale_norm == "l1"
    decoded = decode(packet)
    scale = per_value(packet.scales, n, bucket)
    torch.testing.assert_close(decoded, torch.where(g >= 0, scale, -scale), rtol=0, atol=0)
    packed = np.packbits(g.numpy() >= 0, bitorder="little")
    np.testing.assert_array_equal(packet.payload.numpy(), packed, err_msg="1-bit payload is not LSB-first sign bits")


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_deterministic_rounding_is_round_to_nearest(bits: int) -> None:
    n, bucket = 3000, 256
    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    codec = Codec(bits=bits, bucket_size=bucket, stochastic=False)
    first = codec.encode(g, torch.Generator().manual_seed(0))
    second = codec.encode(g, torch.Generator().manual_seed(99))
    assert torch.equal(first.payload, second.payload), "deterministic rounding depends on the generator"
    torch.testing.assert_close(decode(first), rounded_reference(g, first.scales, bits, bucket), rtol=1e-6, atol=1e-7)


def test_stochastic_rounding_reproducible_from_generator() -> None:
    g = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    codec = Codec(bits=4)
    a = codec.encode(g, torch.Generator().manual_seed(5))
    b = codec.encode(g, torch.Generator().manual_seed(5))
    c = codec.encode(g, torch.Generator().manual_seed(6))
    assert torch.equal(a.payload, b.payload), "same seed gave different codes"
    assert not torch.equal(a.payload, c.payload), "different seeds gave the same codes"


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("bucket", [500, None])
def test_packing_across_chunks(bits: int, bucket: int | None) -> None:
    """Vectors longer than one internal chunk, with a bucket size that is not a power of two."""
    n = 600_007
    g = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    packet = Codec(bits=bits, bucket_size=bucket, stochastic=False).encode(g)
    size = bucket or n
    if bits == 1:
        scale = per_value(packet.scales, n, size)
        expected = torch.where(g >= 0, scale, -scale)
    else:
        expected = rounded_reference(g, packet.scales, bits, size)
    torch.testing.assert_close(decode(packet), expected, rtol=1e-6, atol=1e-7)


def test_l2_scale_option() -> None:
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    packet = Codec(bits=4, bucket_size=300, scale_norm="l2").encode(g)
    expected = torch.stack([torch.linalg.vector_norm(b) for b in bucket_view(g, 300)])
    torch.testing.assert_close(packet.scales, expected)
    assert packet.scale_norm == "l2"
    assert (decode(packet) - g).abs().max() <= expected.max() / 7 * (1 + 1e-5)


def test_zero_buckets_and_raw_float32() -> None:
    g = torch.zeros(1000)
    g[600:] = torch.randn(400, generator=torch.Generator().manual_seed(0))
    for bits in (1, 2, 4, 8):
        decoded = decode(Codec(bits=bits, bucket_size=500).encode(g))
        assert bool((decoded[:500] == 0).all()), f"{bits}-bit all-zero bucket does not decode to zeros"
    packet = Codec(bits=32).encode(g)
    assert torch.equal(decode(packet), g), "32-bit upload is not exact"
    assert packet.scale_norm == "none" and packet.scales.numel() == 0


def test_arrays_round_trip_read_only() -> None:
    g = torch.randn(999, generator=torch.Generator().manual_seed(0))
    packet = Codec(bits=2, bucket_size=100).encode(g)
    arrays = {k: np.frombuffer(a.tobytes(), dtype=a.dtype) for k, a in packet.to_arrays().items()}
    assert not arrays["payload"].flags.writeable
    again = Packet.from_arrays(arrays)
    assert (again.n, again.bits, again.bucket_size, again.scale_norm) == (999, 2, 100, "linf")
    assert torch.equal(decode(again), decode(packet))


def corrupt(arrays: dict[str, np.ndarray], key: str, value) -> dict[str, np.ndarray]:
    return {**arrays, key: value}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: corrupt(a, "payload", a["payload"][:-1]), "payload has 249 bytes; 1000 values at 2 bits need 250"),
        (lambda a: corrupt(a, "header", np.array([1000, 3, 100, 1], dtype=np.int64)), "bit width 3"),
        (
            lambda a: corrupt(a, "scales", np.where(np.arange(10) == 4, np.nan, a["scales"]).astype(np.float32)),
            "finite",
        ),
        (lambda a: corrupt(a, "scales", -a["scales"]), "negative scales"),
        (lambda a: corrupt(a, "scales", a["scales"][:-1]), "has 9 scales"),
        (lambda a: corrupt(a, "header", np.array([1000, 2, 100], dtype=np.int64)), "header has 3 values"),
        (lambda a: corrupt(a, "header", np.array([1000, 2, 100, 3], dtype=np.int64)), "scale kind 'l1'"),
        (lambda a: corrupt(a, "header", np.array([1000, 2, 100, 9], dtype=np.int64)), "scale kind code 9"),
        (lambda a: corrupt(a, "header", np.array([1000, 2, -1, 1], dtype=np.int64)), "bucket size -1"),
        (lambda a: corrupt(a, "header", np.array([0, 2, 100, 1], dtype=np.int64)), "holds 0 values"),
        (lambda a: corrupt(a, "scales", a["scales"].astype(np.float64)), "'scales' is float64"),
        (lambda a: corrupt(a, "payload", a["payload"].tolist()), "'payload' is list"),
        (lambda a: {k: v for k, v in a.items() if k != "scales"}, "expected \\['header', 'payload', 'scales'\\]"),
    ],
)
def test_bad_packets_rejected(mutate, message: str) -> None:
    arrays = Codec(bits=2, bucket_size=100).encode(torch.randn(1000)).to_arrays()
    with pytest.raises(CodecError, match=message):
        Packet.from_arrays(mutate(arrays))


def test_encode_rejects_non_finite_and_bad_shapes() -> None:
    g = torch.randn(100)
    g[7] = float("nan")
    for bits in BITS:
        with pytest.raises(CodecError, match="1 NaN or Inf values"):
            Codec(bits=bits).encode(g)
    with pytest.raises(CodecError, match="1-D"):
        Codec().encode(torch.zeros(3, 3))


def test_codec_settings_validated() -> None:
    with pytest.raises(ConfigError, match="bits must be one of"):
        Codec(bits=3)
    with pytest.raises(ConfigError, match="bucket_size"):
        Codec(bucket_size=0)
    with pytest.raises(ConfigError, match="scale_norm"):
        Codec(scale_norm="l1")


@pytest.mark.parametrize("bits", [1, 4, 8, 32])
@pytest.mark.parametrize("bucket", [500, None])
def test_encoding_chunk_by_chunk_matches_whole_vector_encoding(bits: int, bucket: int | None) -> None:
    """A vector produced chunk by chunk encodes as the whole vector, and ``dropped`` sees what decoding gives."""
    n = 600_007
    g = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    codec = Codec(bits=bits, bucket_size=bucket)
    whole = codec.encode(g, torch.Generator().manual_seed(1))
    seen = torch.full((n,), float("nan"))

    def values(start: int, stop: int, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.copy_(g[start:stop])

    def dropped(start: int, stop: int, chunk: torch.Tensor, dequantised: torch.Tensor) -> None:
        assert torch.equal(chunk, g[start:stop])
        seen[start:stop] = dequantised

    streamed = codec.encode_chunks(n, values, torch.Generator().manual_seed(1), dropped)
    assert torch.equal(streamed.payload, whole.payload) and torch.equal(streamed.scales, whole.scales)
    assert torch.equal(seen, decode(streamed)), "dropped did not see the decoded values of every chunk"
