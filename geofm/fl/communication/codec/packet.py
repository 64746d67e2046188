"""The packet format of an encoded update: header, per-bucket scales and packed codes, and its numpy arrays."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from geofm.errors import CodecError

BITS = (1, 2, 4, 8, 32)
"""Bit widths a codec supports; 32 means no compression."""

SCALE_NORMS = ("none", "linf", "l2", "l1")
"""Scale kinds of a packet, in header code order: none (32 bits), L-inf or L2 (2-8 bits), L1/length (1 bit)."""

HEADER_FIELDS = ("n", "bits", "bucket_size", "scale_norm")
"""Meaning of the int64 header array; a bucket size of 0 means one bucket for the whole vector."""

HEADER_BYTES = 8 * len(HEADER_FIELDS)


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
        arrays = {key: arrays[key] for key in expected}  # each taken once (stored uploads read it afresh)
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
