"""The federated program: a registered task trained by a federated algorithm on partitioned data.

The program runs whatever task the config names (``task``, an entry of :data:`geofm.tasks.TASKS`;
masked image modelling by default) and never imports a task's package. Each round:

1. the server sends each selected client the algorithm's downlink payloads (the global model,
   whole or as its quantised change; SCAFFOLD adds its control variate), the round and its
   learning rate;
2. the client trains its local steps on its share (from the registered partitioner) with the one
   training loop (:class:`geofm.training.loop.TrainLoop`) under the algorithm's hooks, uploads its payloads
   (each quantised with its own error feedback) with its metadata, and keeps its state in Flower's
   client state and in its state folder, from which a restarted run recovers it;
3. the server screens, decodes and combines each payload, applies the algorithm's server rule
   (FedSense: clustering and similarity distillation on its public source), logs the round to
   ``rounds.jsonl``, redraws ``rounds.png`` and checkpoints with the algorithm's state.

After the last round the task exports the global model, with the federation recorded in its
sidecar. Rerunning the same config resumes from the server's last checkpoint, with the same
clients selected, the same data and the same result. The server and client live in
:mod:`federation.programs.server` and :mod:`federation.programs.client`, on what every federated program shares
(:mod:`federation.programs.base`); this module registers them.
"""

from __future__ import annotations

from federation.programs.base import check_simulation
from federation.runtime.contract import Program, Scalar, program_config
from geofm.config.federated import read_federated_config


def run_config_tree(run_config: dict[str, Scalar]):
    """The run's validated config (its task's federated config class) from the run config's ``config`` entry."""
    return read_federated_config(program_config(run_config), "the run's config")


def make_server(run_config: dict[str, Scalar]):
    """The runtime's server program for this run."""
    from federation.programs.server import FederatedServer

    return FederatedServer(run_config_tree(run_config))


def make_client(run_config: dict[str, Scalar], node_config: dict[str, Scalar]):
    """The runtime's client program for this run on one node."""
    from federation.programs.client import FederatedClient

    return FederatedClient(run_config_tree(run_config), node_config)


PROGRAM = Program(
    make_server,
    make_client,
    check_simulation=lambda run_config, source: check_simulation(run_config_tree(run_config), source),
)
"""The built-in federated program, registered as ``"geofm"`` in :data:`federation.runtime.contract.PROGRAMS`."""


__all__ = ["PROGRAM", "make_client", "make_server", "run_config_tree"]
