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
import zlib
from collections.abc import Sequence
from pathlib import Path

from federation.runtime import DATA_ROOT, INSTITUTION, Program, Scalar, program_config
from geofm import engine as ds
from geofm.config import config_to_dict
from geofm.config.federated import FederatedConfig
from geofm.data.sources import list_images
from geofm.errors import ConfigError, DatasetNotFoundError
from geofm.federated.partition import PARTITIONERS
from geofm.tasks import TASKS
from geofm.training import InputPath

TEACHER = "teacher"  # node config: this machine's copy of the teacher weights
STATE_DIR = "state-dir"  # node config: where this institution keeps its client state between runs


def run_config_tree(run_config: dict[str, Scalar]) -> FederatedConfig:
    """The run's validated config from the run config's ``config`` entry."""
    return FederatedConfig.from_tree(program_config(run_config), "the run's config")


def make_server(run_config: dict[str, Scalar]):
    """The runtime's server program for this run."""
    from federation.server import FederatedServer

    return FederatedServer(run_config_tree(run_config))


def make_client(run_config: dict[str, Scalar], node_config: dict[str, Scalar]):
    """The runtime's client program for this run on one node."""
    from federation.client import FederatedClient

    return FederatedClient(run_config_tree(run_config), node_config)


PROGRAM = Program(make_server, make_client)
"""The built-in federated program, registered as ``"geofm"`` in :data:`federation.runtime.PROGRAMS`."""


def build_task(cfg: FederatedConfig):
    """The task the config names, built on ``cfg``."""
    return TASKS.get(cfg.task)(cfg)


def round_lr(cfg: FederatedConfig, rnd: int) -> float:
    """The clients' learning rate in round ``rnd`` (1-based): warm-up, then constant or cosine to ``min_lr_ratio``."""
    train, rounds = cfg.train, cfg.federation.rounds
    peak = ds.scaled_lr(train, 1)
    if rnd <= train.warmup_rounds:
        return peak * rnd / (train.warmup_rounds + 1)
    if train.lr_schedule == "constant":
        return peak
    progress = (rnd - 1 - train.warmup_rounds) / max(rounds - 1 - train.warmup_rounds, 1)
    return peak * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def stable_id(*parts: object) -> int:
    """A seed from names and numbers that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


class _ListedSources(Sequence):
    """Each configured source's files, listed when first indexed (a node reads only the folders it needs)."""

    def __init__(self, cfg: FederatedConfig) -> None:
        self.sources = cfg.data.sources
        self.listed: dict[int, list[Path]] = {}

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> list[Path]:
        if index not in self.listed:
            self.listed[index] = list_images(self.sources[index].root, self.sources[index].pattern)
        return self.listed[index]


def client_shares(cfg: FederatedConfig, name: str) -> list[list[Path]]:
    """The files client ``name`` trains on, per source of ``cfg.data.sources`` (empty lists for the others).

    Raises:
        ConfigError: ``name`` is not one of the config's clients.
        DatasetNotFoundError: a source folder the client reads is missing or empty, naming the client.
    """
    names = cfg.client_names
    if name not in names:
        raise ConfigError(f"institution {name!r} is not a client of this federation; its clients are {names}")
    fed = cfg.federation
    public = [i for i, s in enumerate(cfg.data.sources) if s.name in fed.public_sources]
    partitioner = PARTITIONERS.get(fed.partition)
    try:
        files = partitioner(
            _ListedSources(cfg),
            len(names),
            names.index(name),
            seed=cfg.run.seed,
            public=public,
            alpha=fed.dirichlet_alpha,
        )
    except DatasetNotFoundError as err:
        raise DatasetNotFoundError(f"client {name}: {err}") from None
    shares: list[list[Path]] = [[] for _ in cfg.data.sources]
    for item in files:
        shares[item.source].append(Path(item.path))
    return shares


def local_config(cfg: FederatedConfig, node_config: dict) -> FederatedConfig:
    """The config as one institution's machine sees it: its ``data-root`` and ``teacher`` paths.

    ``data-root`` replaces the root of the institution's own source (``by_source``), or is the
    folder relative source roots are resolved against (other partitions); ``teacher`` replaces the
    teacher's weights file.
    """
    tree = config_to_dict(cfg)
    root = node_config.get(DATA_ROOT)
    if root:
        for source in tree["data"]["sources"]:
            if cfg.federation.partition == "by_source":
                if source["name"] == node_config.get(INSTITUTION):
                    source["root"] = str(root)
            elif not Path(source["root"]).is_absolute():
                source["root"] = str(Path(root) / source["root"])
    if node_config.get(TEACHER) and tree.get("teacher"):
        tree["teacher"]["checkpoint"] = str(node_config[TEACHER])
    return FederatedConfig.from_tree(tree, f"the run's config at {node_config.get(INSTITUTION)}")


def federated_inputs(cfg: FederatedConfig) -> list[InputPath]:
    """The paths the server itself reads: its public sources (clients check their own data)."""
    return [
        InputPath(f"data.sources.{i}.root ({s.name}, public)", s.root, s.pattern)
        for i, s in enumerate(cfg.data.sources)
        if s.name in cfg.federation.public_sources
    ]


__all__ = [
    "PROGRAM",
    "build_task",
    "client_shares",
    "federated_inputs",
    "local_config",
    "make_client",
    "make_server",
    "round_lr",
    "stable_id",
]
