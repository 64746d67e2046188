"""One client's local round of a federated program, as the client, the benchmarks and the tests run it.

A :class:`ClientRound` takes the run's task, config, the client's name, the round and its learning
rate, and goes through the round in four steps: :meth:`~ClientRound.receive` (a fresh model holding
the decoded downlink, the client's local parameters and statistics), :meth:`~ClientRound.build_engine`
(the local optimiser's engine and every hook of the algorithm, SAM's ascent included),
:meth:`~ClientRound.train` (the local steps with :class:`geofm.training.loop.TrainLoop`) and
:meth:`~ClientRound.finish` (the update, the compressed upload, the client's new state and its
metrics). Nothing here knows of Flower; the runtime's client adds its data share, persistence and
reply.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from geofm.fl.algorithms import build_algorithm, local_optimizer
from geofm.fl.algorithms.rounds import Arrays, LocalUpdate
from geofm.fl.communication.feedback import UplinkReport
from geofm.fl.parameter_vectors import (
    RUNNING_STATISTICS,
    ParameterLayout,
    load_running_statistics,
    running_statistics,
)
from geofm.fl.privacy.client_level import noise_generator
from geofm.memory import peak_resident_bytes
from geofm.training import engine as ds
from geofm.training.loop import TrainLoop

LOCAL_STATISTICS = "local_statistics"
"""The client-state key of its own batch-norm running statistics, under ``Algorithm.keeps_local_statistics``."""


def stable_id(*parts: object) -> int:
    """A seed from names and numbers that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


@dataclass
class RoundResult:
    """The end of a client's round: what it uploads, its state for the next round, and its log.

    Attributes:
        update: the uplink payloads' values before compression, with the algorithm's metadata.
        upload: the arrays that travel (each payload compressed, the batch-norm statistics beside).
        state: the client's state (error-feedback residuals, downlink copies, local parameters...).
        metrics: steps, loss means, the algorithm's metadata, the upload's norms, time per step,
            peak memory and the number of processes that trained.
    """

    update: LocalUpdate
    upload: Arrays
    state: Arrays
    metrics: dict[str, Any]


class ClientRound:
    """One client's local round (see the module's docstring for its steps).

    Args:
        task: the run's task (:data:`geofm.tasks.TASKS`, as a federated program builds it).
        cfg: the run's config as this client sees it.
        client: the client's name.
        rnd: the round (1-based).
        lr: the round's learning rate of the local optimiser, for this client's processes.
        world_size: the processes training the round together (data parallel on the client's node).
        steps: the local steps the round takes, for the task's schedules over the run (the momentum of
            DINO's EMA teacher): after local step ``k`` the run is ``(rnd - 1 + k / steps) / rounds`` done.
    """

    def __init__(
        self, task, cfg, client: str, rnd: int, lr: float, world_size: int = 1, *, steps: int | None = None
    ) -> None:
        self.task, self.cfg, self.client, self.rnd, self.lr = task, cfg, client, rnd, lr
        self.world_size, self.steps = world_size, steps
        self.statistics: np.ndarray | None = None
        self.seconds_per_step, self.peak_memory = 0.0, 0

    def receive(self, arrays: Arrays, config: dict, state: Arrays) -> None:
        """A fresh model holding the downlink's global model, the client's local parameters and statistics."""
        # Each round's model is built fresh and overwritten by the global model: no initial weights to read.
        self.model = model = self.task.build_model(initial_weights=False)
        self.algorithm = algorithm = build_algorithm(self.cfg.algorithm, ParameterLayout.of(model))
        self.received, self.state = algorithm.receive(self.client, arrays, config, state)
        algorithm.shared.assign(model, self.received["model"])
        algorithm.restore_local(model, self.state)
        if RUNNING_STATISTICS in arrays:
            load_running_statistics(model, arrays[RUNNING_STATISTICS])
        if algorithm.keeps_local_statistics and LOCAL_STATISTICS in self.state:
            load_running_statistics(model, self.state[LOCAL_STATISTICS])
        self.task.prepare(model)

    def build_engine(self) -> None:
        """The engine of the run's local optimiser, and the loop with every hook of the algorithm."""
        cfg, algorithm = self.cfg, self.algorithm
        optimizer = local_optimizer.resolve(cfg.train, cfg.algorithm.name)
        groups = local_optimizer.with_weight_decay(self.task.param_groups(self.model), optimizer.weight_decay)
        self.engine = engine = ds.initialize(
            self.model, cfg.train, self.world_size, None, self.lr, param_groups=groups, optimizer=optimizer
        )
        self.local = algorithm.local_round(self.client, self.received, engine.module, self.state, self.lr)
        self.local.momentum = optimizer.momentum if optimizer.name == "sgd" else 0.0
        self.hooks = hooks = algorithm.hooks(self.local)
        self.loop = TrainLoop(
            engine,
            lambda batch: self.task.forward(engine, batch),
            self.task.log_keys,
            seed_of=lambda step: stable_id(cfg.run.seed, self.client, self.rnd, step),
            around_gradient=hooks.around_gradient,
            regulariser=hooks.regulariser,
            ascent=hooks.ascent,
            on_step=lambda step: self.task.after_step(engine.module, self.progress(step + 1)),
        )

    def progress(self, step: int) -> float:
        """The fraction of the run's training done after local step ``step`` (1-based) of this round."""
        within = min(step / self.steps, 1.0) if self.steps else 1.0
        return (self.rnd - 1 + within) / self.cfg.federation.rounds

    def train(self, step_batches: Iterable[Iterable]) -> tuple[dict[str, float], int]:
        """The local steps, one per step-batch; every process of the round calls it together.

        Returns:
            The means of the losses over the round and the number of steps.
        """
        device = ds.device()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        means, steps = self.loop.local_steps(step_batches)
        self.seconds_per_step = (time.perf_counter() - started) / max(steps, 1)
        statistics = running_statistics(self.engine.module)
        if statistics is not None and self.world_size > 1:  # each rank's batch norms saw its share of the batches
            statistics = ds.mean_across_ranks(torch.from_numpy(statistics)).numpy()
        self.statistics = statistics
        peak = torch.tensor([peak_memory_bytes(device)], dtype=torch.float64)
        self.peak_memory = int(ds.max_across_ranks(peak).item())
        return means, steps

    def finish(self, means: dict[str, float], steps: int) -> RoundResult:
        """The update from the trained model, compressed with error feedback (and noised under local
        privacy), the state the client keeps, and the round's metrics (rank 0 alone calls it)."""
        cfg, algorithm, state = self.cfg, self.algorithm, self.state
        module = self.engine.module
        update = algorithm.finish_local(self.local, algorithm.shared.flatten_module(module).cpu(), steps)
        algorithm.keep_local(module, state)
        generator = torch.Generator().manual_seed(stable_id(cfg.run.seed, self.client, self.rnd, "uplink"))
        privacy = cfg.algorithm.privacy
        noise = noise_generator(privacy.seed, "client", self.client, self.rnd) if privacy else None
        upload, reports = algorithm.upload(update, state, generator, noise)
        if self.statistics is not None:
            upload[RUNNING_STATISTICS] = self.statistics
            if algorithm.keeps_local_statistics:
                state[LOCAL_STATISTICS] = self.statistics
        state["round"] = np.array([self.rnd], dtype=np.int64)
        metrics = {
            "steps": steps,
            **means,
            **update.metadata,
            **uplink_metrics(reports),
            "seconds_per_step": self.seconds_per_step,
            "peak_memory_bytes": self.peak_memory,
            "local_world_size": self.world_size,
        }
        return RoundResult(update, upload, state, metrics)

    def run(self, arrays: Arrays, config: dict, state: Arrays, step_batches: Iterable[Iterable]) -> RoundResult | None:
        """The whole round (:meth:`receive`, :meth:`build_engine`, :meth:`train`, :meth:`finish`);
        None on the ranks other than 0 of a data-parallel round."""
        self.receive(arrays, config, state)
        self.build_engine()
        means, steps = self.train(step_batches)
        if ds.data_parallel_rank()[0]:
            return None
        return self.finish(means, steps)


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory the local round took: allocated CUDA memory since the round began on a GPU, else
    the peak resident size of this client's own process (in a simulation, a worker that ran several
    clients); 0 where the system does not tell it."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_resident_bytes() or 0


def uplink_metrics(reports: dict[str, UplinkReport]) -> dict[str, float | str]:
    """A client's log of its upload: the first payload's norms as ``update_norm`` and ``error_norm``,
    another's as ``<payload>.update_norm`` and ``<payload>.error_norm``, and the residuals it reset."""
    metrics: dict[str, float | str] = {}
    resets = []
    for index, (payload, report) in enumerate(reports.items()):
        prefix = f"{payload}." if index else ""
        metrics[f"{prefix}update_norm"], metrics[f"{prefix}error_norm"] = report.update_norm, report.error_norm
        kind = "guard" if report.guard_reset else "periodic" if report.periodic_reset else ""
        if kind:
            resets.append(f"{payload}: {kind}" if len(reports) > 1 else kind)
    return {**metrics, "feedback_reset": ", ".join(resets)}


__all__ = [
    "LOCAL_STATISTICS",
    "ClientRound",
    "RoundResult",
    "peak_memory_bytes",
    "stable_id",
    "uplink_metrics",
]
