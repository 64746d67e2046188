"""The federated program: a registered task trained by a federated algorithm on partitioned data.

The program runs whatever task the config names (``task``, an entry of :data:`geofm.tasks.TASKS`;
masked image modelling by default) and never imports a task's package. Each round:

1. the server sends each selected client the algorithm's downlink payloads (the global model,
   whole or as its quantised change; SCAFFOLD adds its control variate), the round and its
   learning rate;
2. the client trains its local steps on its share (from the registered partitioner) with the one
   training loop (:class:`geofm.loop.TrainLoop`) under the algorithm's hooks, uploads its payloads
   (each quantised with its own error feedback) with its metadata, and keeps its state in Flower's
   client state and in its state folder, from which a restarted run recovers it;
3. the server screens, decodes and combines each payload, applies the algorithm's server rule
   (FedSense: clustering and similarity distillation on its public source), logs the round to
   ``rounds.jsonl``, redraws ``rounds.png`` and checkpoints with the algorithm's state.

After the last round the task exports the global model, with the federation recorded in its
sidecar. Rerunning the same config resumes from the server's last checkpoint, with the same
clients selected, the same data and the same result. The server and client live in
:mod:`federation.server` and :mod:`federation.client`; this module holds what both share.
"""

from __future__ import annotations

import math

from federation.runtime import DATA_ROOT, INSTITUTION, Program, Scalar, program_config
from geofm import engine as ds
from geofm.config.federated import FederatedConfig, read_federated_config
from geofm.errors import ConfigError
from geofm.federated.algorithms import local_optimizer
from geofm.paths import check_writable
from geofm.rundir import check_inputs
from geofm.tasks import federated_task

TEACHER = "teacher"  # node config: this machine's copy of the teacher weights
STATE_DIR = "state-dir"  # node config: where this institution keeps its client state between runs
LOCAL_PROCESSES = "local-processes"  # node config: processes (GPUs) of this node a client trains on
OWN_VALIDATION = "val/"  # reply metrics: a personalised client's own model on its own validation data


def run_config_tree(run_config: dict[str, Scalar]):
    """The run's validated config (its task's federated config class) from the run config's ``config`` entry."""
    return read_federated_config(program_config(run_config), "the run's config")


def make_server(run_config: dict[str, Scalar]):
    """The runtime's server program for this run."""
    from federation.server import FederatedServer

    return FederatedServer(run_config_tree(run_config))


def make_client(run_config: dict[str, Scalar], node_config: dict[str, Scalar]):
    """The runtime's client program for this run on one node."""
    from federation.client import FederatedClient

    return FederatedClient(run_config_tree(run_config), node_config)


PROGRAM = Program(
    make_server,
    make_client,
    check_simulation=lambda run_config, source: check_simulation(run_config_tree(run_config), source),
)
"""The built-in federated program, registered as ``"geofm"`` in :data:`federation.runtime.PROGRAMS`."""


def build_task(cfg):
    """The task the config names, as a federated program runs it (:func:`geofm.tasks.federated_task`)."""
    return federated_task(cfg)


def check_simulation_inputs(cfg, source: str) -> None:
    """Check every input of a simulation, every institution's data included, before anything is built, and
    report all problems at once, as central training does: in a simulation all of them are on this machine.

    (A deployed node checks its own data; the server records a node that fails its handshake.)

    Raises:
        ConfigError: naming each missing folder or file and who reads it.
    """
    task = build_task(cfg)
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


def round_lr(cfg: FederatedConfig, rnd: int) -> float:
    """The clients' learning rate in round ``rnd`` (1-based): warm-up, then constant or cosine to ``min_lr_ratio``,
    from the peak scaled to a client's global batch (``federation.local_processes`` processes), with the
    base rate of the run's local optimiser (:func:`geofm.federated.algorithms.local_optimizer.resolve`)."""
    train, rounds = cfg.train, cfg.federation.rounds
    base_lr = local_optimizer.resolve(train, cfg.algorithm.name).base_lr
    peak = base_lr * ds.global_batch(train, cfg.federation.local_processes) / train.lr_reference_batch
    if rnd <= train.warmup_rounds:
        return peak * rnd / (train.warmup_rounds + 1)
    if train.lr_schedule == "constant":
        return peak
    progress = (rnd - 1 - train.warmup_rounds) / max(rounds - 1 - train.warmup_rounds, 1)
    return peak * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def local_config(cfg, node_config: dict):
    """The config as one institution's machine sees it: its ``data-root`` and ``teacher`` paths
    (see the config class's ``for_node``)."""
    return cfg.for_node(str(node_config.get(INSTITUTION)), node_config.get(DATA_ROOT), node_config.get(TEACHER))


__all__ = [
    "LOCAL_PROCESSES",
    "OWN_VALIDATION",
    "PROGRAM",
    "build_task",
    "check_local_processes",
    "check_simulation",
    "check_simulation_inputs",
    "local_config",
    "make_client",
    "make_server",
    "round_lr",
]
