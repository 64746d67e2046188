"""Encode + decode time of the update codec against a plain ``tensor.clone()``, at every bit width.

The vector has the size of a Swin-T backbone (28M float32 values) unless ``--numel`` says otherwise.
Each repeat times a clone and an encode + decode back to back, so both see the same machine load;
the table gives the fastest repeat of each and their ratio. Prints one JSON line per setting.

    python benchmarks/codec_speed.py --repeats 9 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from geofm.federated.codec import BITS, Codec, decode


def seconds(fn) -> float:
    """Wall time of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=28_000_000)
    parser.add_argument("--bucket-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    vector = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    for bits in BITS:
        for stochastic in (True, False) if 2 <= bits <= 8 else (True,):
            codec = Codec(bits=bits, bucket_size=args.bucket_size, stochastic=stochastic)
            decode(codec.encode(vector, generator))  # warm-up
            clone, encode, both = [], [], []
            for _ in range(args.repeats):
                clone.append(seconds(vector.clone))
                start = time.perf_counter()
                packet = codec.encode(vector, generator)
                encode.append(time.perf_counter() - start)
                decode(packet)
                both.append(time.perf_counter() - start)
            record = {
                "bits": bits,
                "rounding": "stochastic" if stochastic and 2 <= bits <= 8 else "deterministic",
                "numel": args.numel,
                "threads": torch.get_num_threads(),
                "clone_ms": round(1e3 * min(clone), 1),
                "encode_ms": round(1e3 * min(encode), 1),
                "encode_decode_ms": round(1e3 * min(both), 1),
                "ratio_to_clone": round(min(both) / min(clone), 2),
                "packet_bytes": packet.nbytes,
                "compression": round(4 * args.numel / packet.nbytes, 1),
            }
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
