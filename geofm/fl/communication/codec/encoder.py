"""The codec: quantise and pack an update vector into a :class:`~geofm.fl.communication.codec.packet.Packet`, and back."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from geofm.errors import CodecError, ConfigError
from geofm.fl.communication.codec.chunks import ChunkCoder, NonFinite, check_finite, chunks
from geofm.fl.communication.codec.packet import BITS, HEADER_BYTES, Packet, num_buckets, payload_nbytes


class CodecSettings(Protocol):
    """What a config section gives a codec (the fields of :class:`Codec`)."""

    bits: int
    bucket_size: int | None
    scale_norm: Literal["linf", "l2"]
    stochastic: bool


@dataclass(frozen=True)
class Codec:
    """Encoder of update vectors into :class:`Packet` objects (see :mod:`geofm.fl.communication.codec`).

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

    @classmethod
    def of(cls, settings: CodecSettings) -> Codec:
        """The codec a config section describes (:class:`~geofm.config.algorithm.CodecConfig` and its uplink form)."""
        return cls(settings.bits, settings.bucket_size, settings.scale_norm, settings.stochastic)

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
        except NonFinite:
            check_finite(vector, torch.full((1,), math.nan))
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
        except NonFinite as err:
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
        """The chunk loop of :meth:`encode` and :meth:`encode_chunks`; raises :class:`NonFinite`."""
        bucket = None if self.bits == 32 else self.bucket_size
        coder = ChunkCoder(n, self.bits, bucket, self.wire_scale_norm, self.stochastic, device)
        payload = torch.empty(payload_nbytes(n, self.bits), dtype=torch.uint8, device=device)
        scales = torch.empty(0 if self.bits == 32 else num_buckets(n, bucket), dtype=torch.float32, device=device)
        whole = None
        if self.bits != 32 and num_buckets(n, bucket) == 1 and n > coder.size:
            whole = coder.whole_vector_scale(values)
        for start, stop in chunks(n, bucket):
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
    coder = ChunkCoder(n, bits, bucket, packet.scale_norm, False, out.device, decoding=True)
    for start, stop in chunks(n, bucket):
        coder.unpack(packet.payload, start, stop)
        coder.dequantise(start, stop, packet.scales, packet.payload, out[start:stop])
    return out
