"""A federated program's client: one institution's local rounds of the run's task.

The client's state (the algorithm's: error-feedback residuals, its copies of a compressed downlink,
the parameters that stay local, the algorithm's own variables) travels in Flower's client state and
is also kept in its state folder, from which a restarted run recovers it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from federation.programs.base import (
    LOCAL_PROCESSES,
    OWN_VALIDATION,
    STATE_DIR,
    check_local_processes,
    local_config,
)
from federation.programs.localgroup import local_group
from federation.runtime.contract import DATA_ROOT, INSTITUTION, Arrays, Scalars
from geofm.config.federated import FederatedConfig
from geofm.errors import ConfigError
from geofm.fl.client_round import ClientRound, stable_id
from geofm.tasks import federated_task
from geofm.training import engine as ds
from geofm.training.rundir import check_inputs


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
        self.task = federated_task(self.cfg)
        check_inputs(self.task.inputs(), f"client {self.name}")
        self.own_data = bool(node_config.get(DATA_ROOT))
        self.share = self.task.client_share(self.name, own_data=self.own_data)
        self.num_examples = self.share.num_examples
        self.state_dir = Path(node_config.get(STATE_DIR) or self.cfg.run.output_dir / "clients" / self.name)

    def identity(self) -> Scalars:
        return {"client": self.name, "num_examples": self.num_examples}

    def train(self, arrays: Arrays, config: Scalars, state: Arrays) -> tuple[Arrays, Scalars, Arrays]:
        """One round: receive the payloads, train the local steps under the algorithm's hooks, upload.

        With ``local_processes`` above 1 the node's local group (:mod:`federation.programs.localgroup`) trains
        the round data-parallel; this process only hands it the payloads and returns rank 0's answer.
        """
        if self.local_processes > 1:
            group = local_group(self.local_processes)
            return group.train(type(self), self.run_cfg, self.node_config, arrays, config, state)
        return self.train_here(arrays, config, state)

    def train_here(self, arrays: Arrays, config: Scalars, state: Arrays) -> tuple[Arrays, Scalars, Arrays] | None:
        """:meth:`train` in this process's process group: every rank trains its share of each global batch
        (the same model, payloads and state on each); rank 0 uploads, keeps the state and answers, the
        other ranks answer None."""
        started = time.perf_counter()
        _, world_size = ds.init_distributed()
        # The round's rate is the server's for federation.local_processes; a node with another count scales it.
        lr = float(config["lr"]) * world_size / self.cfg.federation.local_processes
        rnd = int(config["round"])
        steps = self._num_steps()
        local = ClientRound(self.task, self.cfg, self.name, rnd, lr, world_size, steps=steps)
        batches = self.task.local_batches(self.share.data, steps, rnd, stable_id(self.cfg.run.seed, self.name))
        result = local.run(arrays, config, state or self._recover(rnd), batches)
        if result is None:
            return None
        self._persist(rnd, result.state)
        # A personalised algorithm's product is each client's own model: validated on the client's own data.
        own = (
            self.task.evaluate_client(local.engine.module, self.name, self.own_data)
            if local.algorithm.personalised
            else None
        )
        metrics = {
            "client": self.name,
            "num_examples": self.num_examples,
            **result.metrics,
            "seconds": time.perf_counter() - started,
            **{f"{OWN_VALIDATION}{key}": value for key, value in (own or {}).items()},
        }
        return result.upload, metrics, result.state

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
    ``federation.local_processes``; at most this machine's devices (:func:`~federation.programs.base.check_local_processes`).

    Raises:
        ConfigError: ``local-processes`` is not a positive whole number, or either asks for more processes
            than this machine has devices.
    """
    if LOCAL_PROCESSES not in node_config:
        field, value = "federation.local_processes", cfg.federation.local_processes
    else:
        field, value = f"node config {LOCAL_PROCESSES}", node_config[LOCAL_PROCESSES]
        if not str(value).isdigit() or int(value) < 1:
            raise ConfigError(f"{field}={value!r}: expected a positive whole number of processes")
    check_local_processes(int(value), field)
    return int(value)


__all__ = ["FederatedClient", "local_processes"]
