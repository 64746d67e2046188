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

from geofm.fl.communication.codec.encoder import Codec, decode
from geofm.fl.communication.codec.packet import (
    BITS,
    HEADER_BYTES,
    HEADER_FIELDS,
    SCALE_NORMS,
    Packet,
    num_buckets,
    payload_nbytes,
)

__all__ = [
    "BITS",
    "HEADER_BYTES",
    "HEADER_FIELDS",
    "SCALE_NORMS",
    "Codec",
    "Packet",
    "decode",
    "num_buckets",
    "payload_nbytes",
]
