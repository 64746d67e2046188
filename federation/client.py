"""A federated program's client: one institution's local rounds of the run's task.

The client's state (the algorithm's: error-feedback residuals, its copies of a compressed downlink,
the parameters that stay local, the algorithm's own variables) travels in Flower's client state and
is also kept in its state folder, from which a restarted run recovers it.
"""

from __future__ import annotations

import re
import resource
import time
from pathlib import Path

import numpy as np
import torch

from federation.program import LOCAL_PROCESSES, OWN_VALIDATION, STATE_DIR, build_task, local_config, stable_id
from federation.runtime import DATA_ROOT, INSTITUTION, Arrays, Scalars
from geofm import engine as ds
from geofm.config.federated import FederatedConfig
from geofm.errors import ConfigError
from geofm.federated.algorithms import build_algorithm, local_optimizer
from geofm.federated.communication.feedback import UplinkReport
from geofm.federated.parameter_vectors import (
    RUNNING_STATISTICS,
    ParameterLayout,
    load_running_statistics,
    running_statistics,
)
from geofm.federated.privacy.client_level import noise_generator
from geofm.loop import TrainLoop
from geofm.rundir import check_inputs

LOCAL_STATISTICS = "local_statistics"
"""The client-state key of its own batch-norm running statistics, under ``Algorithm.keeps_local_statistics``."""


class FederatedClient:
    """One institution: trains the run's task on its own share only, uploads compressed updates.

    Args:
        cfg: the run's config.
        node_config: the node's config (``institution``, optionally ``data-root``, ``teacher``,
            ``state-dir``).
    """

    def __init__(self, cfg: FederatedConfig, node_config: dict) -> None:
        self.name = str(node_config[INSTITUTION])
        self.run_cfg, self.node_config = cfg, dict(node_config)
        self.local_processes = local_processes(node_config, cfg)
        self.cfg = local_config(cfg, node_config)
        self.task = build_task(self.cfg)
        check_inputs(self.task.inputs(), f"client {self.name}")
        self.own_data = bool(node_config.get(DATA_ROOT))
        self.share = self.task.client_share(self.name, own_data=self.own_data)
        self.num_examples = self.share.num_examples
        self.state_dir = Path(node_config.get(STATE_DIR) or self.cfg.run.output_dir / "clients" / self.name)

    def identity(self) -> Scalars:
        return {"client": self.name, "num_examples": self.num_examples}

    def train(self, arrays: Arrays, config: Scalars, state: Arrays) -> tuple[Arrays, Scalars, Arrays]:
        """One round: receive the payloads, train the local steps under the algorithm's hooks, upload.

        With ``local_processes`` above 1 the node's local group (:mod:`federation.localgroup`) trains
        the round data-parallel; this process only hands it the payloads and returns rank 0's answer.
        """
        if self.local_processes > 1:
            from federation.localgroup import local_group

            return local_group(self.local_processes).train(self.run_cfg, self.node_config, arrays, config, state)
        return self.train_here(arrays, config, state)

    def train_here(self, arrays: Arrays, config: Scalars, state: Arrays) -> tuple[Arrays, Scalars, Arrays] | None:
        """:meth:`train` in this process's process group: every rank trains its share of each global batch
        (the same model, payloads and state on each); rank 0 uploads, keeps the state and answers, the
        other ranks answer None."""
        started = time.perf_counter()
        rank, world_size = ds.init_distributed()
        # The round's rate is the server's for federation.local_processes; a node with another count scales it.
        lr = float(config["lr"]) * world_size / self.cfg.federation.local_processes
        cfg, rnd = self.cfg, int(config["round"])
        # Each round's model is built fresh and overwritten by the global model: no initial weights to read.
        model = self.task.build_model(initial_weights=False)
        algorithm = build_algorithm(cfg.algorithm, ParameterLayout.of(model))
        received, state = algorithm.receive(self.name, arrays, config, state or self._recover(rnd))
        algorithm.shared.assign(model, received["model"])
        algorithm.restore_local(model, state)
        if RUNNING_STATISTICS in arrays:
            load_running_statistics(model, arrays[RUNNING_STATISTICS])
        if algorithm.keeps_local_statistics and LOCAL_STATISTICS in state:
            load_running_statistics(model, state[LOCAL_STATISTICS])
        self.task.prepare(model)
        optimizer = local_optimizer.resolve(cfg.train, cfg.algorithm.name)
        groups = local_optimizer.with_weight_decay(self.task.param_groups(model), optimizer.weight_decay)
        engine = ds.initialize(model, cfg.train, world_size, None, lr, param_groups=groups, optimizer=optimizer)
        local = algorithm.local_round(self.name, received, engine.module, state, lr)
        local.momentum = optimizer.momentum if optimizer.name == "sgd" else 0.0
        hooks = algorithm.hooks(local)
        loop = TrainLoop(
            engine,
            lambda batch: self.task.forward(engine, batch),
            self.task.log_keys,
            seed_of=lambda step: stable_id(cfg.run.seed, self.name, rnd, step),
            around_gradient=hooks.around_gradient,
            regulariser=hooks.regulariser,
            ascent=hooks.ascent,
        )
        batches = self.task.local_batches(self.share.data, self._num_steps(), rnd, stable_id(cfg.run.seed, self.name))
        device = ds.device()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trained = time.perf_counter()
        means, steps = loop.local_steps(batches)
        seconds_per_step = (time.perf_counter() - trained) / max(steps, 1)
        statistics = running_statistics(engine.module)
        if statistics is not None and world_size > 1:  # each rank's batch norms saw its share of the batches
            statistics = ds.mean_across_ranks(torch.from_numpy(statistics)).numpy()
        peak_memory = int(ds.max_across_ranks(torch.tensor([peak_memory_bytes(device)], dtype=torch.float64)).item())
        if rank:
            return None

        update = algorithm.finish_local(local, algorithm.shared.flatten_module(engine.module).cpu(), steps)
        algorithm.keep_local(engine.module, state)
        generator = torch.Generator().manual_seed(stable_id(cfg.run.seed, self.name, rnd, "uplink"))
        privacy = cfg.algorithm.privacy
        noise = noise_generator(privacy.seed, "client", self.name, rnd) if privacy else None
        upload, reports = algorithm.upload(update, state, generator, noise)
        if statistics is not None:
            upload[RUNNING_STATISTICS] = statistics
            if algorithm.keeps_local_statistics:
                state[LOCAL_STATISTICS] = statistics
        state["round"] = np.array([rnd], dtype=np.int64)
        self._persist(rnd, state)
        # A personalised algorithm's product is each client's own model: validated on the client's own data.
        own = self.task.evaluate_client(engine.module, self.name, self.own_data) if algorithm.personalised else None
        metrics = {
            "client": self.name,
            "num_examples": self.num_examples,
            "steps": steps,
            **means,
            **update.metadata,
            **uplink_metrics(reports),
            "seconds": time.perf_counter() - started,
            "seconds_per_step": seconds_per_step,
            "peak_memory_bytes": peak_memory,
            "local_world_size": world_size,
            **{f"{OWN_VALIDATION}{key}": value for key, value in (own or {}).items()},
        }
        return upload, metrics, state

    def _num_steps(self) -> int:
        """Local steps per round: ``train.local_steps``, or ``train.local_epochs`` of this client's share in
        global batches of its ``local_processes``."""
        train = self.cfg.train
        if train.local_steps is not None:
            return train.local_steps
        return max(1, int(train.local_epochs * self.num_examples) // ds.global_batch(train, self.local_processes))

    def _persist(self, rnd: int, state: Arrays) -> None:
        """Keep the state on this institution's disk too; a restarted run (new Flower context) reads it back."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / f"state_round_{rnd:06d}.npz"
        partial = path.with_name(path.name + ".partial")  # not a state_round_*.npz until complete
        with partial.open("wb") as f:
            np.savez(f, **state)
        partial.replace(path)
        for _, old in self._saved()[:-2]:
            old.unlink()

    def _saved(self) -> list[tuple[int, Path]]:
        """The complete states on disk, oldest first, as (round, path); anything else there is ignored."""
        found = (re.fullmatch(r"state_round_(\d+)\.npz", p.name) for p in self.state_dir.glob("state_round_*"))
        return sorted((int(m.group(1)), self.state_dir / m.group(0)) for m in found if m)

    def _recover(self, rnd: int) -> Arrays:
        """The newest state saved before round ``rnd`` (empty: a first round, or none kept)."""
        earlier = [path for saved, path in self._saved() if saved < rnd]
        if not earlier:
            return {}
        with np.load(earlier[-1]) as data:
            return {key: data[key] for key in data.files}


def local_processes(node_config: dict, cfg: FederatedConfig) -> int:
    """The processes a node's client trains on: its node config's ``local-processes``, else
    ``federation.local_processes``.

    Raises:
        ConfigError: ``local-processes`` is not a positive whole number.
    """
    value = node_config.get(LOCAL_PROCESSES, cfg.federation.local_processes)
    if not str(value).isdigit() or int(value) < 1:
        raise ConfigError(f"node config {LOCAL_PROCESSES}={value!r}: expected a positive whole number of processes")
    return int(value)


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory the local round took: allocated CUDA memory since the round began on a GPU, else
    the peak resident size of this client's process (in a simulation, a worker that ran several clients)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


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


__all__ = ["FederatedClient", "local_processes", "peak_memory_bytes", "uplink_metrics"]
