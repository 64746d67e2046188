"""What every federated program shares: a node's view of the config, the checks before a simulation, the server base.

A program (the round-based :mod:`federation.programs.rounds`; the one-shot ones on :mod:`federation.programs.oneshot`)
builds its server on :class:`ProgramServer`: the plan from the config's ``federation`` section, the
run folder, the run's rounds log (``rounds.jsonl``, :data:`~geofm.runlog.ROUNDS_LOG`, written by
:meth:`ProgramServer.write_round`) and the check that a rerun continues the same run
(:meth:`ProgramServer.resume`). The program adds its rounds (``configure``, ``aggregate``, ``finish``
of :class:`~federation.runtime.contract.ServerProgram`) and says what its run folder keeps of them. Its
clients see the config as their institution's machine does (:func:`local_config`).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from typing import Any

from federation.programs.resume import comparable_algorithm, saved_config
from federation.runtime.contract import DATA_ROOT, INSTITUTION
from geofm.config import config_to_dict
from geofm.config.base import CONFIG_FILE
from geofm.config.saved import read_saved_config
from geofm.errors import ConfigError
from geofm.loggers import RunLoggers, check_installed, end_status
from geofm.paths import check_writable
from geofm.runlog import ROUNDS_LOG
from geofm.tasks import federated_task
from geofm.training import engine as ds
from geofm.training.rundir import check_inputs

log = logging.getLogger("geofm.fl")

TEACHER = "teacher"  # node config: this machine's copy of the teacher weights
STATE_DIR = "state-dir"  # node config: where this institution keeps its client state between runs
LOCAL_PROCESSES = "local-processes"  # node config: processes (GPUs) of this node a client trains on
OWN_VALIDATION = "val/"  # reply metrics: a personalised client's own model on its own validation data


def local_config(cfg, node_config: dict):
    """The config as one institution's machine sees it: its ``data-root`` and ``teacher`` paths
    (see the config's ``for_node``)."""
    return cfg.for_node(str(node_config.get(INSTITUTION)), node_config.get(DATA_ROOT), node_config.get(TEACHER))


def check_local_processes(count: int, field: str) -> None:
    """Refuse to train a client on more processes than this machine has devices (a GPU each, or a CPU core
    each), before any process starts.

    Raises:
        ConfigError: naming ``field``, ``count`` and this machine's devices.
    """
    devices, kind = ds.local_devices()
    if count > devices:
        raise ConfigError(
            f"{field}={count}: a client trains on one process per device, and this machine has {devices} {kind}; "
            f"expected at most {devices}"
        )


def check_simulation_inputs(cfg, source: str) -> None:
    """Check every input of a simulation, every institution's data included, before anything is built, and
    report all problems at once, as central training does: in a simulation all of them are on this machine.

    (A deployed node checks its own data; the server records a node that fails its handshake.)

    Raises:
        ConfigError: naming each missing folder or file and who reads it.
    """
    task = federated_task(cfg)
    check_inputs([*task.server_inputs(), *task.client_inputs(), *task.inputs()], source)


def check_simulation(cfg, source: str) -> None:
    """What a simulation of a federated config needs of this machine, checked before the simulation engine
    starts: its output folder writable, a device for each of a client's processes
    (:func:`check_local_processes`) and every input (:func:`check_simulation_inputs`).

    Raises:
        ConfigError, OutputPathError: naming the field or file at fault.
    """
    check_writable(cfg.run.output_dir, "run.output_dir", folder=True)
    check_local_processes(cfg.federation.local_processes, "federation.local_processes")
    check_simulation_inputs(cfg, source)


def _lookup(tree: dict | None, dotted: str) -> Any:
    for key in dotted.split("."):
        tree = (tree or {}).get(key)
    return tree


class ProgramServer(ABC):
    """The server of a federated program, less its rounds: the plan of the config's ``federation`` section,
    the run folder (``run_dir``), the rounds log and the resume check.

    A subclass builds what its rounds need, then calls :meth:`resume`; it says how many rounds its run
    folder holds (:meth:`rounds_done`), which settings they depend on (:meth:`resume_invariants`) and
    takes them up (:meth:`restore`).

    Args:
        cfg: the run's config (a :class:`~geofm.config.federated.FederatedProgramConfig`).
    """

    def __init__(self, cfg) -> None:
        check_installed(cfg.run.loggers)
        fed = cfg.federation
        self.cfg, self.run_dir = cfg, cfg.run.output_dir
        self.min_clients = fed.min_clients
        self.fraction = fed.fraction
        self.round_timeout_s = fed.round_timeout_s
        self.expected_clients = cfg.num_clients
        self.connect_timeout_s = fed.connect_timeout_s
        self.round_retries = fed.round_retries
        self.done = 0  # rounds done before this invocation
        self.num_rounds = fed.rounds  # the last round this invocation runs
        self.rounds_log: RunLoggers | None = None

    # ---- resume ------------------------------------------------------------------------------
    @abstractmethod
    def rounds_done(self) -> int:
        """The rounds the run folder holds (0: a new run)."""

    @abstractmethod
    def resume_invariants(self) -> tuple[str, ...]:
        """The config's dotted keys (or sections) the kept rounds depend on: a rerun that changed one is refused."""

    @abstractmethod
    def restore(self, saved: dict | None, current: dict, done: int) -> None:
        """Take up the ``done`` rounds the run folder holds (the program's own checks and state); ``saved`` and
        ``current``: the run's saved config and this one, as :meth:`resume` compares them."""

    def resume(self) -> None:
        """Continue the run the run folder holds, if any: refuse one whose saved config differs at a key of
        :meth:`resume_invariants`, :meth:`restore` its rounds, and set ``done`` and ``num_rounds`` (at most
        ``federation.stop_after_rounds`` from here).

        Raises:
            ConfigError: naming the changed setting and how to proceed.
        """
        done = self.rounds_done()
        if done:
            path = self.run_dir / CONFIG_FILE
            saved = comparable_algorithm(saved_config(read_saved_config(path) if path.exists() else None))
            current = comparable_algorithm(config_to_dict(self.cfg))
            for key in self.resume_invariants():
                before, now = _lookup(saved, key), _lookup(current, key)
                if before != now:
                    values = "" if isinstance(before, dict) or isinstance(now, dict) else f" ({before!r}, now {now!r})"
                    raise ConfigError(
                        f"{self.run_dir} holds the rounds of a run with other {key} settings{values}; rerun with "
                        "the same settings to continue it, or choose a new run.output_dir"
                    )
            self.restore(saved, current, done)
        fed = self.cfg.federation
        stop = fed.stop_after_rounds
        self.done = done
        self.num_rounds = fed.rounds if stop is None else min(fed.rounds, done + stop)
        if done < self.num_rounds < fed.rounds:
            log.info(
                "this invocation runs rounds %d-%d of %d (federation.stop_after_rounds=%d counts from where it "
                "resumes); rerun to continue",
                done + 1,
                self.num_rounds,
                fed.rounds,
                stop,
            )

    def start_round(self) -> int:
        return self.done + 1

    # ---- rounds log ----------------------------------------------------------------------------
    def last_round(self) -> dict | None:
        """The last record of the run's ``rounds.jsonl`` as this invocation found it (None: no round logged)."""
        path = self.run_dir / ROUNDS_LOG
        lines = path.read_text().splitlines() if path.exists() else []
        return json.loads(lines[-1]) if lines else None

    def open_rounds_log(self) -> RunLoggers:
        """The run's ``rounds.jsonl`` and dashboards, opened after the rounds done (later records are dropped)."""
        if self.rounds_log is None:
            self.rounds_log = RunLoggers(
                self.run_dir / ROUNDS_LOG,
                self.cfg.run,
                resume_step=self.done,
                key="round",
                config=config_to_dict(self.cfg),
            )
        return self.rounds_log

    def write_round(self, record: dict) -> None:
        """Log a round's record (its ``round`` entry the round) to ``rounds.jsonl`` and the dashboards."""
        self.open_rounds_log().write(record)

    def close(self, error: BaseException | None) -> None:
        """Close the run's loggers once the invocation ends (``error``: what ended it, if anything did)."""
        if self.rounds_log is not None:
            self.rounds_log.close(end_status(error, self.num_rounds >= self.cfg.federation.rounds))


__all__ = [
    "LOCAL_PROCESSES",
    "OWN_VALIDATION",
    "STATE_DIR",
    "TEACHER",
    "ProgramServer",
    "check_local_processes",
    "check_simulation",
    "check_simulation_inputs",
    "local_config",
]
