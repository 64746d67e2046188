"""The chunk arithmetic of encoding and decoding: bucket scales, stochastic rounding and codes of one chunk at a time."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from geofm.errors import CodecError
from geofm.fl.communication.codec.bitpack import BitPacker
from geofm.fl.communication.codec.packet import num_buckets

_CHUNK = 1 << 18  # values per chunk: float32 work buffer of 1 MiB
_UNIFORM_BITS = 16


class NonFinite(Exception):
    """A chunk whose scales are not finite; the argument names its values."""


def check_finite(vector: Tensor, norms: Tensor) -> None:
    """Raise if a vector holds NaN or Inf, given norms of its parts that propagate them."""
    if bool(torch.isfinite(norms).all()):
        return
    bad = int((~torch.isfinite(vector)).sum())
    if bad:
        raise CodecError(f"update holds {bad} NaN or Inf values out of {vector.numel()}")
    raise CodecError(f"update values are too large for float32 norms (max abs {float(vector.abs().max()):.3g})")


def scales_into(out: Tensor, part: Tensor, norm: str, scratch: Tensor) -> None:
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


def chunk_size(n: int, bucket: int | None) -> int:
    """Values per chunk: whole buckets (unless one bucket spans the vector) and whole packed int64 words.

    A vector shorter than a chunk is one chunk, rounded up to whole words.
    """
    whole_vector = -(-n // 8) * 8
    if num_buckets(n, bucket) == 1:
        return min(_CHUNK, whole_vector)
    unit = math.lcm(bucket, 8)
    return min(unit * max(1, _CHUNK // unit), whole_vector)


def chunks(n: int, bucket: int | None) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive chunks covering ``range(n)``."""
    size = chunk_size(n, bucket)
    for start in range(0, n, size):
        yield start, min(start + size, n)


def bucket_blocks(start: int, stop: int, n: int, bucket: int | None) -> Iterator[tuple[int, int, slice, slice]]:
    """Cut a chunk into at most two blocks of equal-length buckets: (rows, cols, value slice, bucket slice).

    Chunks start on bucket boundaries (see :func:`chunk_size`), so a chunk is a run of full
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


class ChunkCoder:
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
        self.size = size = chunk_size(n, bucket)
        self.levels = 2 ** (bits - 1) - 1
        self.centre = 0.5 if bits == 1 else float(self.levels)
        self.values = torch.empty(0 if decoding else size, dtype=torch.float32, device=device)
        self.work = torch.empty(0 if decoding else size, dtype=torch.float32, device=device)
        self.scratch = BitPacker(size if bits < 8 else 0, device)
        # Holds 16-bit random draws, then the codes before they narrow to bytes (float -> int16 ->
        # uint8 is much faster than float -> uint8 on CPU). ``size`` is a multiple of 8.
        self.ints = torch.empty(0 if bits == 32 or decoding else size, dtype=torch.int16, device=device)

    def whole_vector_scale(self, values: Callable[[int, int, Tensor], Tensor]) -> Tensor:
        """The one scale of a vector longer than a chunk, from a first sweep over its chunks."""
        parts = []
        for start, stop in chunks(self.n, self.bucket):
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
            NonFinite: if a scale of the chunk is not finite.
        """
        length = stop - start
        if self.bits == 32:
            if not bool(torch.isfinite(torch.linalg.vector_norm(chunk))):
                raise NonFinite(f"{start}:{stop}")
            payload.view(torch.float32)[start:stop].copy_(chunk)
            return
        pieces = list(bucket_blocks(start, stop, self.n, self.bucket))
        if whole is not None:
            scales.copy_(whole)
        else:
            for rows, cols, where, buckets in pieces:
                scales_into(scales[buckets], chunk[where].view(rows, cols), self.norm, self.work[where])
        first, last = pieces[0][3].start, pieces[-1][3].stop
        if not bool(torch.isfinite(scales[first:last]).all()):
            raise NonFinite(f"{start}:{stop}")
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
        for rows, cols, where, buckets in bucket_blocks(start, stop, self.n, self.bucket):
            part = scales[buckets]
            step = 2 * part if self.bits == 1 else part / self.levels
            out[where].view(rows, cols).mul_(step[:, None])
        return out

    def pack(self, payload: Tensor, start: int, stop: int) -> None:
        """Squeeze the chunk's one-byte codes into the payload (8-bit codes are in place already)."""
        if self.bits < 8:
            self.scratch.pack(payload, start, stop, self.bits)
