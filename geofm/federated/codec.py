"""Quantisation and dense bit packing of model updates (client-to-server uploads).

An update vector ``G`` (float32, length ``n``) is cut into buckets of ``bucket_size`` values (the
last one may be shorter; ``None`` makes the whole vector one bucket), each bucket gets one float32
scale, and every value becomes a ``b``-bit code:

* ``b = 32``: no compression, the raw float32 bytes.
* ``b`` in {2, 4, 8}: ``Q[i] = scale * sign(G[i]) * xi(|G[i]| / scale)`` with ``s = 2**(b-1) - 1``
  levels: one sign bit plus ``b - 1`` magnitude bits. ``xi(r) = floor(r * s + u) / s`` with
  ``u ~ U[0, 1)`` is unbiased stochastic rounding (QSGD); ``u = 1/2`` gives deterministic
  round-to-nearest (the "FedAvg with uniform quantisation" baseline). The scale is the bucket's
  L-infinity norm (default) or its L2 norm.
* ``b = 1``: ``sign(G[i])`` (zero counts as positive) with ``scale = ||bucket||_1 / len(bucket)``,
  the scaled sign of error-feedback signSGD.

On the wire, a ``b >= 2`` value is the offset code ``sign * level + s`` in ``[0, 2s]``, which holds
exactly the sign and the level in ``b`` bits; ``b = 1`` sends 1 for non-negative values. Codes are
packed densely, least significant bits first (``numpy.packbits(bitorder="little")`` order for
``b = 1``), into exactly ``ceil(n * b / 8)`` bytes. A :class:`Packet` carries the payload, the
scales and a four-number header; it converts to and from a dict of numpy arrays.

Stochastic rounding draws 16 random bits per value (from the given :class:`torch.Generator`), so
``u`` takes 65536 equally spaced values centred in ``[0, 1)``: the expectation of a code is exact
to within 2**-17 of one quantisation step, finer than the float32 arithmetic around it for 8 bits.
On the CPU the draws come from torch's serial Mersenne Twister and are the largest part of a
stochastic encode's time.

Encoding and decoding work through the vector in cache-sized chunks with reused buffers: no
Python loop over values, and no temporary of the vector's size besides the decoded output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from geofm.errors import CodecError, ConfigError

BITS = (1, 2, 4, 8, 32)
"""Bit widths a codec supports; 32 means no compression."""

SCALE_NORMS = ("none", "linf", "l2", "l1")
"""Scale kinds of a packet, in header code order: none (32 bits), L-inf or L2 (2-8 bits), L1/length (1 bit)."""

HEADER_FIELDS = ("n", "bits", "bucket_size", "scale_norm")
"""Meaning of the int64 header array; a bucket size of 0 means one bucket for the whole vector."""

HEADER_BYTES = 8 * len(HEADER_FIELDS)

_CHUNK = 1 << 18  # values per chunk: float32 work buffer of 1 MiB
_UNIFORM_BITS = 16


def num_buckets(n: int, bucket_size: int | None) -> int:
    """Number of buckets (and scales) of a vector of ``n`` values; the last bucket may be short."""
    return 1 if bucket_size is None or bucket_size >= n else math.ceil(n / bucket_size)


def payload_nbytes(n: int, bits: int) -> int:
    """Length of the packed payload: ``ceil(n * bits / 8)`` bytes."""
    return (n * bits + 7) // 8


@dataclass(frozen=True, eq=False)
class Packet:
    """One encoded update as it travels: packed codes, per-bucket scales and a tiny header.

    Attributes:
        n: number of values of the update.
        bits: bit width, one of :data:`BITS`.
        bucket_size: values per scale, or None for one scale over the whole vector.
        scale_norm: one of :data:`SCALE_NORMS`, matching ``bits``.
        payload: uint8 CPU tensor of ``ceil(n * bits / 8)`` bytes.
        scales: float32 CPU tensor, one finite non-negative scale per bucket (empty for 32 bits).
    """

    n: int
    bits: int
    bucket_size: int | None
    scale_norm: str
    payload: Tensor
    scales: Tensor

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise CodecError(f"packet has bit width {self.bits}; expected one of {BITS}")
        if self.n < 1:
            raise CodecError(f"packet holds {self.n} values; expected at least 1")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise CodecError(f"packet has bucket size {self.bucket_size}; expected a positive size or none")
        expected_norms = {32: ("none",), 1: ("l1",)}.get(self.bits, ("linf", "l2"))
        if self.scale_norm not in expected_norms:
            raise CodecError(
                f"packet of {self.bits} bits has scale kind {self.scale_norm!r}; expected one of {expected_norms}"
            )
        if self.payload.dtype != torch.uint8 or self.payload.dim() != 1:
            raise CodecError(
                f"packet payload must be a 1-D uint8 array, got {self.payload.dtype} {tuple(self.payload.shape)}"
            )
        expected_bytes = payload_nbytes(self.n, self.bits)
        if self.payload.numel() != expected_bytes:
            raise CodecError(
                f"packet payload has {self.payload.numel()} bytes; {self.n} values at {self.bits} bits "
                f"need {expected_bytes}"
            )
        expected_scales = 0 if self.bits == 32 else num_buckets(self.n, self.bucket_size)
        if self.scales.dtype != torch.float32 or self.scales.dim() != 1:
            raise CodecError(
                f"packet scales must be a 1-D float32 array, got {self.scales.dtype} {tuple(self.scales.shape)}"
            )
        if self.scales.numel() != expected_scales:
            raise CodecError(
                f"packet has {self.scales.numel()} scales; {self.n} values in buckets of "
                f"{self.bucket_size or 'all'} need {expected_scales}"
            )
        if not bool(torch.isfinite(self.scales).all()):
            raise CodecError(f"packet has {int((~torch.isfinite(self.scales)).sum())} non-finite scales")
        if bool((self.scales < 0).any()):
            raise CodecError(f"packet has {int((self.scales < 0).sum())} negative scales")

    @property
    def nbytes(self) -> int:
        """Size on the wire: payload, scales and header, in bytes."""
        return self.payload.numel() + 4 * self.scales.numel() + HEADER_BYTES

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The packet as numpy arrays: ``header`` (int64), ``payload`` (uint8), ``scales`` (float32)."""
        header = np.array(
            [self.n, self.bits, self.bucket_size or 0, SCALE_NORMS.index(self.scale_norm)], dtype=np.int64
        )
        return {"header": header, "payload": self.payload.numpy(), "scales": self.scales.numpy()}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Packet:
        """Rebuild a packet from :meth:`to_arrays` output, checking every field.

        Read-only arrays (as deserialisers return them) are copied; others are shared.

        Raises:
            CodecError: if an array is missing or unexpected, has the wrong dtype or shape, the
                header is out of range, or the payload or scales do not match the header.
        """
        expected = {"header": np.int64, "payload": np.uint8, "scales": np.float32}
        if set(arrays) != set(expected):
            raise CodecError(f"packet arrays are {sorted(arrays)}; expected {sorted(expected)}")
        for key, dtype in expected.items():
            array = arrays[key]
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
                got = f"{array.dtype} {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
                raise CodecError(f"packet array {key!r} is {got}; expected a 1-D {np.dtype(dtype)} array")
        header = arrays["header"]
        if header.shape != (len(HEADER_FIELDS),):
            raise CodecError(f"packet header has {header.size} values; expected {len(HEADER_FIELDS)} {HEADER_FIELDS}")
        n, bits, bucket_size, norm = (int(v) for v in header)
        if not 0 <= norm < len(SCALE_NORMS):
            raise CodecError(f"packet header has scale kind code {norm}; expected 0..{len(SCALE_NORMS) - 1}")
        if bucket_size < 0:
            raise CodecError(f"packet header has bucket size {bucket_size}; expected a positive size or 0 (none)")

        def tensor(array: np.ndarray) -> Tensor:
            return torch.from_numpy(array if array.flags.writeable else array.copy())

        return cls(
            n=n,
            bits=bits,
            bucket_size=bucket_size or None,
            scale_norm=SCALE_NORMS[norm],
            payload=tensor(arrays["payload"]),
            scales=tensor(arrays["scales"]),
        )


@dataclass(frozen=True)
class Codec:
    """Encoder of update vectors into :class:`Packet` objects (see the module docstring).

    Attributes:
        bits: 1, 2, 4, 8, or 32 for no compression.
        bucket_size: values per scale (default 512), or None for one scale per vector.
        scale_norm: scale of 2-8 bit codes: ``"linf"`` (max-abs of the bucket, default) or
            ``"l2"`` (the bucket's L2 norm). The L2 scale is kept for ablations only: most values
            lie far below a bucket's L2 norm, so stochastic rounding sends mostly zeros and the
            quantisation error is large (its squared norm grows like ``||G||_1 ||G||_2`` per
            bucket instead of ``||G||_1 ||G||_inf``). Error feedback accumulates that error, and
            at low bit widths training diverges (2 bits in the tests' regression simulation).
            Ignored for 1 bit (L1/length) and 32 bits.
        stochastic: unbiased stochastic rounding (default) or deterministic round-to-nearest.
    """

    bits: int = 8
    bucket_size: int | None = 512
    scale_norm: Literal["linf", "l2"] = "linf"
    stochastic: bool = True

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ConfigError(f"codec bits must be one of {BITS}, got {self.bits}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ConfigError(f"codec bucket_size must be positive or None, got {self.bucket_size}")
        if self.scale_norm not in ("linf", "l2"):
            raise ConfigError(f"codec scale_norm must be 'linf' or 'l2', got {self.scale_norm!r}")

    @property
    def wire_scale_norm(self) -> str:
        """The scale kind packets of this codec carry: ``"none"``, ``"l1"``, or :attr:`scale_norm`."""
        return {32: "none", 1: "l1"}.get(self.bits, self.scale_norm)

    def packet_nbytes(self, n: int) -> int:
        """Wire size of the packet of an ``n``-value vector, computed without encoding anything."""
        scales = 0 if self.bits == 32 else num_buckets(n, self.bucket_size)
        return payload_nbytes(n, self.bits) + 4 * scales + HEADER_BYTES

    def encode(self, vector: Tensor, generator: torch.Generator | None = None) -> Packet:
        """Quantise and pack an update vector.

        Args:
            vector: 1-D floating tensor on any device; it is not modified.
            generator: random source of stochastic rounding, on the vector's device; None uses
                torch's default generator.

        Returns:
            The packet, on the CPU.

        Raises:
            CodecError: if the vector is not 1-D, is empty, or holds NaN or Inf.
        """
        if vector.dim() != 1 or vector.numel() == 0:
            raise CodecError(f"expected a non-empty 1-D update vector, got shape {tuple(vector.shape)}")
        vector = vector.detach().to(torch.float32)
        try:
            return self._encode(
                vector.numel(), lambda start, stop, _: vector[start:stop], generator, None, vector.device
            )
        except _NonFinite:
            _check_finite(vector, torch.full((1,), math.nan))
            raise

    def encode_chunks(
        self,
        n: int,
        values: Callable[[int, int, Tensor], Tensor],
        generator: torch.Generator | None = None,
        dropped: Callable[[int, int, Tensor, Tensor], None] | None = None,
        device: torch.device | str = "cpu",
    ) -> Packet:
        """Quantise and pack a vector produced chunk by chunk, never held whole.

        Error feedback encodes ``G = delta + e`` this way, computing each chunk of ``G`` into a
        reused buffer and updating ``e`` from the same chunk while it is in cache.

        Args:
            n: length of the vector.
            values: ``values(start, stop, buffer)`` returns the float32 values ``start:stop``,
                computed into ``buffer`` (a float32 tensor of that length) or a view of existing
                memory. Chunks start on bucket boundaries; when one bucket spans a vector longer
                than a chunk, every chunk is asked for twice (scale, then codes), with equal results.
            generator: random source of stochastic rounding, on ``device``.
            dropped: called as ``dropped(start, stop, values, dequantised)`` for every chunk, in
                order, with what :func:`decode` will give for those values.
            device: where the values are.

        Returns:
            The packet, on the CPU.

        Raises:
            CodecError: if a chunk holds NaN or Inf or values too large for float32 norms; the
                chunks before it have been passed to ``dropped``.
        """
        if n < 1:
            raise CodecError(f"expected a non-empty update vector, got {n} values")
        try:
            return self._encode(n, values, generator, dropped, torch.device(device))
        except _NonFinite as err:
            raise CodecError(
                f"update values {err.args[0]} hold NaN or Inf, or values too large for float32 norms"
            ) from None

    def _encode(
        self,
        n: int,
        values: Callable[[int, int, Tensor], Tensor],
        generator: torch.Generator | None,
        dropped: Callable[[int, int, Tensor, Tensor], None] | None,
        device: torch.device,
    ) -> Packet:
        """The chunk loop of :meth:`encode` and :meth:`encode_chunks`; raises :class:`_NonFinite`."""
        bucket = None if self.bits == 32 else self.bucket_size
        coder = _Coder(n, self.bits, bucket, self.wire_scale_norm, self.stochastic, device)
        payload = torch.empty(payload_nbytes(n, self.bits), dtype=torch.uint8, device=device)
        scales = torch.empty(0 if self.bits == 32 else num_buckets(n, bucket), dtype=torch.float32, device=device)
        whole = None
        if self.bits != 32 and num_buckets(n, bucket) == 1 and n > coder.size:
            whole = coder.whole_vector_scale(values)
        for start, stop in _chunks(n, bucket):
            chunk = values(start, stop, coder.values[: stop - start])
            coder.encode(chunk, start, stop, scales, whole, payload, generator)
            if dropped is not None:
                dropped(start, stop, chunk, coder.dequantise(start, stop, scales, payload))
            coder.pack(payload, start, stop)
        return Packet(n, self.bits, bucket, self.wire_scale_norm, payload.cpu(), scales.cpu())


def decode(packet: Packet) -> Tensor:
    """The dequantised update of a packet, as a new float32 CPU vector of ``packet.n`` values."""
    if packet.bits == 32:
        return packet.payload.clone().view(torch.float32)
    n, bits, bucket = packet.n, packet.bits, packet.bucket_size
    out = torch.empty(n, dtype=torch.float32)
    coder = _Coder(n, bits, bucket, packet.scale_norm, False, out.device, decoding=True)
    for start, stop in _chunks(n, bucket):
        coder.unpack(packet.payload, start, stop)
        coder.dequantise(start, stop, packet.scales, packet.payload, out[start:stop])
    return out


class _NonFinite(Exception):
    """A chunk whose scales are not finite; the argument names its values."""


def _check_finite(vector: Tensor, norms: Tensor) -> None:
    """Raise if a vector holds NaN or Inf, given norms of its parts that propagate them."""
    if bool(torch.isfinite(norms).all()):
        return
    bad = int((~torch.isfinite(vector)).sum())
    if bad:
        raise CodecError(f"update holds {bad} NaN or Inf values out of {vector.numel()}")
    raise CodecError(f"update values are too large for float32 norms (max abs {float(vector.abs().max()):.3g})")


def _scales_into(out: Tensor, part: Tensor, norm: str, scratch: Tensor) -> None:
    """Write one scale per row of ``part`` into ``out``: max-abs ("linf"), L2 norm ("l2") or mean absolute value ("l1").

    ``scratch`` is a float32 buffer of ``part``'s size for the absolute values.
    """
    if norm == "l2":
        torch.linalg.vector_norm(part, 2, dim=1, out=out)
        return
    magnitude = torch.abs(part, out=scratch.view(part.shape))
    if norm == "linf":
        torch.amax(magnitude, dim=1, out=out)
    else:
        torch.div(magnitude.sum(dim=1), part.shape[1], out=out)


def _chunk_size(n: int, bucket: int | None) -> int:
    """Values per chunk: whole buckets (unless one bucket spans the vector) and whole packed int64 words.

    A vector shorter than a chunk is one chunk, rounded up to whole words.
    """
    whole_vector = -(-n // 8) * 8
    if num_buckets(n, bucket) == 1:
        return min(_CHUNK, whole_vector)
    unit = math.lcm(bucket, 8)
    return min(unit * max(1, _CHUNK // unit), whole_vector)


def _chunks(n: int, bucket: int | None) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive chunks covering ``range(n)``."""
    size = _chunk_size(n, bucket)
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _pieces(start: int, stop: int, n: int, bucket: int | None) -> Iterator[tuple[int, int, slice, slice]]:
    """Cut a chunk into at most two blocks of equal-length buckets: (rows, cols, value slice, bucket slice).

    Chunks start on bucket boundaries (see :func:`_chunk_size`), so a chunk is a run of full
    buckets, possibly followed by the vector's short last bucket.
    """
    length = stop - start
    if num_buckets(n, bucket) == 1:
        yield 1, length, slice(0, length), slice(0, 1)
        return
    first, full = start // bucket, length // bucket
    if full:
        yield full, bucket, slice(0, full * bucket), slice(first, first + full)
    if length % bucket:
        yield 1, length % bucket, slice(full * bucket, length), slice(first + full, first + full + 1)


class _Coder:
    """The arithmetic of one chunk, with buffers reused from chunk to chunk.

    Codes are one byte per value until :meth:`pack` squeezes them (8-bit codes are written to the
    payload directly). A value decodes to ``(code - centre) * step`` with ``centre, step = 1/2,
    2 * scale`` for 1 bit and ``levels, scale / levels`` otherwise.
    """

    def __init__(
        self,
        n: int,
        bits: int,
        bucket: int | None,
        norm: str,
        stochastic: bool,
        device: torch.device,
        decoding: bool = False,
    ) -> None:
        self.n, self.bits, self.bucket, self.norm, self.stochastic = n, bits, bucket, norm, stochastic
        self.size = size = _chunk_size(n, bucket)
        self.levels = 2 ** (bits - 1) - 1
        self.centre = 0.5 if bits == 1 else float(self.levels)
        self.values = torch.empty(0 if decoding else size, dtype=torch.float32, device=device)
        self.work = torch.empty(0 if decoding else size, dtype=torch.float32, device=device)
        self.scratch = _Scratch(size if bits < 8 else 0, device)
        # Holds 16-bit random draws, then the codes before they narrow to bytes (float -> int16 ->
        # uint8 is much faster than float -> uint8 on CPU). ``size`` is a multiple of 8.
        self.ints = torch.empty(0 if bits == 32 or decoding else size, dtype=torch.int16, device=device)

    def whole_vector_scale(self, values: Callable[[int, int, Tensor], Tensor]) -> Tensor:
        """The one scale of a vector longer than a chunk, from a first sweep over its chunks."""
        parts = []
        for start, stop in _chunks(self.n, self.bucket):
            chunk = values(start, stop, self.values[: stop - start])
            if self.norm == "linf":
                parts.append(torch.maximum(chunk.amax(), chunk.amin().neg()))
            else:
                parts.append(torch.linalg.vector_norm(chunk, 2 if self.norm == "l2" else 1))
        joined = torch.stack(parts)
        if self.norm == "linf":
            return joined.amax().view(1)
        if self.norm == "l2":
            return torch.linalg.vector_norm(joined).view(1)
        return (joined.sum() / self.n).view(1)

    def _codes(self, start: int, stop: int, payload: Tensor) -> Tensor:
        return payload[start:stop] if self.bits == 8 else self.scratch.codes[: stop - start]

    def encode(
        self, chunk: Tensor, start: int, stop: int, scales: Tensor, whole: Tensor | None, payload: Tensor, generator
    ) -> None:
        """Scales of the chunk's buckets into ``scales`` (or ``whole``), and the chunk's codes.

        Raises:
            _NonFinite: if a scale of the chunk is not finite.
        """
        length = stop - start
        if self.bits == 32:
            if not bool(torch.isfinite(torch.linalg.vector_norm(chunk))):
                raise _NonFinite(f"{start}:{stop}")
            payload.view(torch.float32)[start:stop].copy_(chunk)
            return
        pieces = list(_pieces(start, stop, self.n, self.bucket))
        if whole is not None:
            scales.copy_(whole)
        else:
            for rows, cols, where, buckets in pieces:
                _scales_into(scales[buckets], chunk[where].view(rows, cols), self.norm, self.work[where])
        first, last = pieces[0][3].start, pieces[-1][3].stop
        if not bool(torch.isfinite(scales[first:last]).all()):
            raise _NonFinite(f"{start}:{stop}")
        codes = self._codes(start, stop, payload)
        ints = self.ints[:length]
        if self.bits == 1:
            # Through float and int16: comparisons into bool, and float -> uint8, are slow on CPU.
            codes.copy_(ints.copy_(torch.ge(chunk, 0, out=self.work[:length])))
            return
        # code = floor(G * levels / scale + levels + u); an all-zero bucket codes every value as 0.
        part = scales[first:last]
        inverse = torch.where(part > 0, self.levels / part, torch.zeros_like(part))
        scaled = self.work[:length]
        for rows, cols, where, buckets in pieces:
            b = slice(buckets.start - first, buckets.stop - first)
            torch.mul(chunk[where].view(rows, cols), inverse[b, None], out=scaled[where].view(rows, cols))
        if self.stochastic:
            # 16-bit uniforms k in [-32768, 32767] from full 64-bit draws: u - 1/2 - 2**-17 = k / 65536.
            self.ints.view(torch.int64)[: -(-length // 4)].random_(-(2**63), None, generator=generator)
            scaled.add_(ints, alpha=2.0**-_UNIFORM_BITS)
        scaled.add_(self.levels + 0.5 + (2.0 ** -(_UNIFORM_BITS + 1) if self.stochastic else 0.0))
        codes.copy_(ints.copy_(scaled)).clamp_(max=2 * self.levels)

    def unpack(self, payload: Tensor, start: int, stop: int) -> None:
        """Spread the chunk's packed codes to one byte per value (8-bit codes need nothing)."""
        if self.bits < 8:
            self.scratch.unpack(payload, start, stop, self.bits)

    def dequantise(self, start: int, stop: int, scales: Tensor, payload: Tensor, out: Tensor | None = None) -> Tensor:
        """``(code - centre) * step`` of the chunk's codes, into ``out`` (default a reused buffer)."""
        length = stop - start
        out = self.work[:length] if out is None else out
        if self.bits == 32:
            return out.copy_(payload.view(torch.float32)[start:stop])
        out.copy_(self._codes(start, stop, payload)).sub_(self.centre)
        for rows, cols, where, buckets in _pieces(start, stop, self.n, self.bucket):
            part = scales[buckets]
            step = 2 * part if self.bits == 1 else part / self.levels
            out[where].view(rows, cols).mul_(step[:, None])
        return out

    def pack(self, payload: Tensor, start: int, stop: int) -> None:
        """Squeeze the chunk's one-byte codes into the payload (8-bit codes are in place already)."""
        if self.bits < 8:
            self.scratch.pack(payload, start, stop, self.bits)


def _lane_mask(bits: int, lane: int) -> int:
    """An int64 mask keeping the lowest ``bits`` bits of every ``lane``-bit lane of a 64-bit word."""
    return sum(((1 << bits) - 1) << offset for offset in range(0, 64, lane))


class _Scratch:
    """Reused buffers of one chunk for packing codes of 1, 2 or 4 bits into bytes, and back.

    Eight codes, one per byte of an int64 word, are merged in three shift-or-mask steps that halve
    the number of lanes each time (SWAR), leaving ``bits`` packed bytes at the bottom of the word;
    unpacking runs the steps backwards. Bytes are read in little-endian order.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self.codes = torch.empty(size, dtype=torch.uint8, device=device)
        self.shifted = torch.empty(size // 8, dtype=torch.int64, device=device)

    def _words(self, length: int) -> tuple[Tensor, Tensor]:
        words = -(-length // 8)
        return self.codes[: 8 * words].view(torch.int64), self.shifted[:words]

    def pack(self, payload: Tensor, start: int, stop: int, bits: int) -> None:
        """Pack :attr:`codes` ``[:stop - start]`` (values ``start:stop``) into their payload bytes."""
        length = stop - start
        word, shifted = self._words(length)
        self.codes[length : 8 * word.numel()] = 0
        for step in range(3):
            held = bits << step  # bits of each half-lane before this step
            torch.bitwise_right_shift(word, (8 << step) - held, out=shifted)
            word.bitwise_or_(shifted).bitwise_and_(_lane_mask(2 * held, 16 << step))
        packed = word.view(torch.uint8).view(-1, 8)[:, :bits]
        first, count = start * bits // 8, payload_nbytes(length, bits)
        if count == packed.numel():
            payload[first : first + count].view(-1, bits).copy_(packed)
        else:
            payload[first : first + count].copy_(packed.reshape(-1)[:count])

    def unpack(self, payload: Tensor, start: int, stop: int, bits: int) -> Tensor:
        """Codes of values ``start:stop``, one per byte, unpacked from the payload into :attr:`codes`."""
        length = stop - start
        word, shifted = self._words(length)
        first, count = start * bits // 8, payload_nbytes(length, bits)
        word.zero_()
        spread = word.view(torch.uint8).view(-1, 8)[:, :bits]
        if count == spread.numel():
            spread.copy_(payload[first : first + count].view(-1, bits))
        else:
            tail = torch.zeros(spread.numel(), dtype=torch.uint8, device=payload.device)
            tail[:count] = payload[first : first + count]
            spread.copy_(tail.view(-1, bits))
        for step in reversed(range(3)):
            held = bits << step
            torch.bitwise_left_shift(word, (8 << step) - held, out=shifted)
            word.bitwise_or_(shifted).bitwise_and_(_lane_mask(held, 8 << step))
        return self.codes[:length]
