"""``geofm bench codec``: encode and decode time of the uplink codec against a plain ``clone``.

The update has the size of a Swin-T backbone (28M float32 values). *Encode* is a client's whole
upload step, :meth:`geofm.fl.communication.feedback.ErrorFeedback.uplink`: the update plus the residual,
bucket scales, quantisation, dense packing and the residual's update; *decode* is the server's
:func:`geofm.fl.communication.codec.decode`. Both are set against ``vector.clone()`` of the same tensor,
the memory-bound limit of producing a new vector, timed in the same rounds. Bytes on the wire
include the header and the scales.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from benchmarks.common import Report, Target, alternate, summary
from geofm.fl.communication.codec import Codec, decode
from geofm.fl.communication.feedback import ErrorFeedback, FeedbackState

DEFAULTS: dict[str, Any] = {
    "numel": 28_000_000,
    "bits": [1, 2, 4, 8],
    "bucket_size": 512,
    "stochastic": True,
    "rounds": 7,
}
QUICK: dict[str, Any] = {"numel": 1_000_000, "rounds": 3}


def run(settings: dict[str, Any]) -> Report:
    n = int(settings["numel"])
    vector = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    calls, packets = {"clone": vector.clone}, {}
    for bits in settings["bits"]:
        codec = Codec(bits=bits, bucket_size=settings["bucket_size"], stochastic=settings["stochastic"])
        feedback, state, generator = ErrorFeedback(codec), FeedbackState(), torch.Generator().manual_seed(bits)
        packets[bits] = feedback.uplink(vector, state, generator)[0]
        calls[f"encode_{bits}"] = lambda f=feedback, s=state, g=generator: f.uplink(vector, s, g)
        calls[f"decode_{bits}"] = lambda p=packets[bits]: decode(p)
    times = alternate(calls, settings["rounds"], warmup=1)

    clone = summary(times["clone"])
    results: dict[str, Any] = {"numel": n, "clone_s": clone, "bits": {}}
    rows, targets = [], []
    for bits, packet in packets.items():
        per_round = [
            (e + d) / c
            for e, d, c in zip(times[f"encode_{bits}"], times[f"decode_{bits}"], times["clone"], strict=True)
        ]
        ratio = statistics.median(per_round)
        compression = 4 * n / packet.nbytes
        results["bits"][bits] = {
            "encode_s": summary(times[f"encode_{bits}"]),
            "decode_s": summary(times[f"decode_{bits}"]),
            "encode_decode_over_clone": ratio,
            "packet_bytes": packet.nbytes,
            "fp32_over_packet": compression,
        }
        rows.append(
            {
                "bits": bits,
                "encode ms": 1e3 * summary(times[f"encode_{bits}"])["median"],
                "decode ms": 1e3 * summary(times[f"decode_{bits}"])["median"],
                "x clone": ratio,
                "bytes": packet.nbytes,
                "fp32 / bytes": compression,
            }
        )
        targets.append(Target(f"{bits}-bit encode + decode / clone", ratio, "<=", 3.0, "x"))
        if bits == 1:
            targets.append(Target("1-bit upload, fp32 bytes / wire bytes", compression, ">=", 28.0, "x"))
    notes = [
        f"{n:,} float32 values, buckets of {settings['bucket_size']}, encode includes error feedback; "
        f"clone {1e3 * clone['median']:.1f} ms (median of {settings['rounds']} rounds)"
    ]
    return Report(results, targets, rows, notes)
