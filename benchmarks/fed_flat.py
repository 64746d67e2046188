"""``geofm bench fed-round``'s flat-server rows: the server's peak memory and seconds per round at M clients.

For each algorithm (FedAvg with float32 uploads, FedSense with 1-bit uploads and 3 groups) three
kinds of upload are made from random updates of the size of the configured model
(``flat_config``: the GFM Swin-B student by default) and written to an
:class:`~geofm.fl.communication.spill.UploadStore` as Flower's transport writes each reply on arrival;
the ``max(flat_clients)`` clients upload them in turn (their files hard links to their kind's, so
that making 40 Swin-B uploads takes seconds, not minutes on a loaded machine).
Each M then runs in a fresh process, so that its own peak resident memory (``VmHWM``, not the
``getrusage`` peak it would inherit from this process) is the round's alone: the
server's global model, decoding and screening the M uploads, combining them and its update rule
(FedSense's: K-means of the count sketches and the group models; the similarity distillation
that follows, whose cost and memory do not depend on M, is timed by the other rows and left out
here). The target: the peak at the largest M within 1.3x of the peak at the smallest.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Target, current_rss_mib, peak_rss_mib, repo_path

ALGORITHMS: dict[str, dict[str, Any]] = {
    "FedAvg fp32": {"name": "fedavg", "uplink": {"bits": 32}},
    "FedSense 1-bit": {"name": "fedsense", "options": {"clusters": 3, "distill_steps": 1}, "uplink": {"bits": 1}},
}
KINDS = 3
"""Distinct synthetic uploads; client i uploads kind ``i % KINDS``."""
PEAK_RATIO = 1.3
"""The most the server's peak may grow from the fewest to the most clients."""


def model_values(config: str) -> int:
    """Values of the shared vector of a pretraining config's student, built on the meta device (no memory)."""
    from geofm.config.pretrain import PretrainConfig
    from geofm.fl.parameter_vectors import ParameterLayout
    from geofm.tasks.mim.task import build_student

    with torch.device("meta"):
        return ParameterLayout.of(build_student(PretrainConfig.from_file(repo_path(config)))).numel


def server_round(algorithm: dict[str, Any], values: int, folder: str, names: list[str], clients: int) -> dict:
    """One round of the server on the first ``clients`` stored uploads, in this (fresh) process."""
    from geofm.config.algorithm import AlgorithmConfig
    from geofm.fl.aggregation.uploads import ClientUpload
    from geofm.fl.algorithms import build_algorithm
    from geofm.fl.algorithms.rounds import payload_arrays
    from geofm.fl.communication.spill import SPILL_FOLDER, StoredArrays
    from geofm.memory import keep_freed_memory

    keep_freed_memory()  # as FederatedServer does
    rule = build_algorithm(AlgorithmConfig.model_validate(algorithm), values)
    rule.spill_to(Path(folder) / SPILL_FOLDER)
    if (
        rule.options is not None and rule.options.distill_steps
    ):  # the distillation is left out (see the module docstring): the groups pass through
        rule.distillation = lambda rnd, new, groups, weights: (new, 0.0)
    model = torch.zeros(values)
    standing = current_rss_mib()
    started = time.perf_counter()
    uploads = [
        ClientUpload(f"client{i:03d}", payload_arrays(StoredArrays(Path(folder) / f"{i:06d}", names)), 100 + i)
        for i in range(clients)
    ]
    payloads = rule.aggregate(uploads)
    outcome = rule.server_update(model, payloads)
    seconds = time.perf_counter() - started
    assert bool(torch.isfinite(outcome.model).all()) and len(payloads["update"].accepted) == clients
    return {"seconds": seconds, "peak_mib": peak_rss_mib(), "standing_mib": standing}


def run_flat(settings: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], list[Target], list[str]]:
    """The flat-server figures: (results, rows, targets, notes)."""
    from geofm.config.algorithm import AlgorithmConfig
    from geofm.fl.algorithms import build_algorithm
    from geofm.fl.algorithms.rounds import LocalUpdate
    from geofm.fl.communication.spill import UploadStore

    values, ms = model_values(settings["flat_config"]), sorted(settings["flat_clients"])
    results: dict[str, Any] = {"model_values": values}
    rows, targets = [], []
    spawn = multiprocessing.get_context("spawn")
    for label, algorithm in ALGORITHMS.items():
        with tempfile.TemporaryDirectory(prefix="geofm-fed-flat-") as tmp:
            store, rule = UploadStore(Path(tmp)), build_algorithm(AlgorithmConfig.model_validate(algorithm), values)
            generator = torch.Generator().manual_seed(1)
            base = torch.randn(values, generator=generator) * 1e-3
            for i in range(KINDS):  # three kinds of client, for K-means
                arrays, _ = rule.upload(LocalUpdate({"update": base * (1 + i) + 1e-3 * i}), {}, generator)
                names = list(store.keep(arrays))
                del arrays
            for i in range(KINDS, ms[-1]):  # the other clients share their kind's files (hard links: no copy)
                (Path(tmp) / f"{i:06d}").mkdir()
                for file in (Path(tmp) / f"{i % KINDS:06d}").iterdir():
                    os.link(file, Path(tmp) / f"{i:06d}" / file.name)
            upload_mib = sum(p.stat().st_size for p in Path(tmp).glob("000000/*.npy")) / 2**20
            measured = {}
            for m in ms:
                with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                    measured[m] = pool.submit(server_round, algorithm, values, tmp, names, m).result()
                rows.append(
                    {
                        "flat server": label,
                        "clients": m,
                        "peak MiB": measured[m]["peak_mib"],
                        "before round MiB": measured[m]["standing_mib"],
                        "s per round": measured[m]["seconds"],
                        "upload MiB": upload_mib,
                    }
                )
        results[label] = {"upload_mib": upload_mib, "by_clients": measured}
        ratio = measured[ms[-1]]["peak_mib"] / measured[ms[0]]["peak_mib"]
        targets.append(Target(f"{label}: server peak at {ms[-1]} clients / at {ms[0]}", ratio, "<=", PEAK_RATIO, "x"))
    notes = [
        f"flat server: {settings['flat_config']} student, {values:,} values ({values * 4 / 2**20:.0f} MiB in fp32); "
        "uploads stored on disk as they arrive; each M in a fresh process (peak = that process's own peak resident "
        "memory, VmHWM, torch included); decode + screen + combine + server update, FedSense's distillation left out"
    ]
    return results, rows, targets, notes


__all__ = ["ALGORITHMS", "PEAK_RATIO", "model_values", "run_flat", "server_round"]
