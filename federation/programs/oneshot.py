"""What the one-shot federated programs share: the clients' data, the round of uploads, the classifier.

FedDiff (:mod:`federation.programs.feddiff`), OSCAR (:mod:`federation.programs.oscar`) and ensemble distillation
(:mod:`federation.programs.ensemble`) run one round in which every client uploads once. A client takes its
share of the train split under ``federation.partition``, or a deployed node its whole train split
(:class:`OneShotClient`). The server (:class:`OneShotServer`, on the server base of every federated
program, :class:`~federation.programs.base.ProgramServer`) keeps the uploads (``uploads/<client>.safetensors``,
``uploads/clients.json``, written last: the round is done, and a rerun runs no round but goes straight
to the program's ``finish``), logs the round to ``rounds.jsonl`` (each client's examples and uplink
bytes, and what the program adds), refuses to continue a run whose settings of what the uploads
depend on changed, and builds the global classifier
in ``classifier/`` (FedDiff and OSCAR: the configured backbone and head finetuned on their synthetic
split, :meth:`OneShotServer.train_classifier`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml
from safetensors.numpy import load_file, save_file

from federation.programs.base import ProgramServer, check_simulation, local_config
from federation.runtime.contract import DATA_ROOT, INSTITUTION, Failure, Program, Reply, Scalar, Scalars, program_config
from geofm.config.base import CONFIG_FILE, config_to_dict
from geofm.config.oneshot import OneShotConfig
from geofm.fl.oneshot.feddiff import Upload
from geofm.tasks import federated_task, train_central

log = logging.getLogger("geofm.fl")

UPLOADS = "uploads"
CLIENTS_FILE = "clients.json"  # in UPLOADS: every client's metrics, written last: the round is done


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


class OneShotClient:
    """A node's client: the config it sees and its share of the train split (``indices``; ``own_data``: a
    deployed node's whole split), in every dataset band where ``every_band`` (what a diffusion model learns)."""

    every_band = False

    def __init__(self, cfg: OneShotConfig, node_config: dict[str, Scalar]) -> None:
        self.name = str(node_config[INSTITUTION])
        self.own_data = bool(node_config.get(DATA_ROOT))
        self.cfg = local_config(cfg, node_config)
        if self.every_band:
            self.cfg = self.cfg.all_bands()
        self.data = federated_task(self.cfg)
        self.indices = self.data.client_share(self.name, self.own_data).data

    def identity(self) -> Scalars:
        return {"client": self.name, "num_examples": len(self.indices)}


class OneShotServer(ProgramServer):
    """One round of uploads kept on disk; a subclass names the sections its uploads depend on
    (``resume_sections``), adds its metrics to the round's record (:meth:`round_record`) and does its
    work after the round (``finish``)."""

    cfg: OneShotConfig
    resume_sections: tuple[str, ...] = ("data", "model", "federation")

    def __init__(self, cfg: OneShotConfig) -> None:
        super().__init__(cfg)
        self.upload_dir = self.run_dir / UPLOADS
        self.resume()
        cfg.check_server_inputs()

    def rounds_done(self) -> int:
        return 1 if (self.upload_dir / CLIENTS_FILE).exists() else 0

    def resume_invariants(self) -> tuple[str, ...]:
        return (*self.resume_sections, "run.seed")

    def restore(self, saved: dict | None, current: dict, done: int) -> None:
        """Nothing to load: :meth:`kept_uploads` reads the round's uploads where ``finish`` uses them."""

    def register(self, node_id: int, identity: Scalars) -> None:
        """Nothing to learn: a reply names its client."""

    def configure(self, rnd: int, node_ids: list[int]) -> dict[int, tuple[dict, Scalars]]:
        return {node: ({}, {"round": rnd}) for node in node_ids}

    def round_record(self, clients: dict[str, dict]) -> dict:
        """What the program adds to the round's record from its clients' metrics (by name)."""
        return {}

    def aggregate(self, rnd: int, replies: list[Reply], failures: list[Failure]) -> None:
        """Keep each upload on disk and log the round; ``clients.json``, written last, marks it done."""
        self.upload_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / CONFIG_FILE).write_text(yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False))
        clients = {}
        for reply in sorted(replies, key=lambda r: str(r.metrics["client"])):
            name = str(reply.metrics["client"])
            arrays = {key: np.ascontiguousarray(value) for key, value in reply.arrays.items()}
            save_file(arrays, self.upload_dir / f"{name}.safetensors")
            clients[name] = {**reply.metrics, "uplink_bytes": sum(a.nbytes for a in arrays.values())}
            privacy = f", epsilon {reply.metrics['epsilon']:.2f}" if "epsilon" in reply.metrics else ""
            size = _size(clients[name]["uplink_bytes"])
            log.info("round %d: %s uploaded %s (%d images%s)", rnd, name, size, reply.metrics["num_examples"], privacy)
        record = {
            "round": rnd,
            "clients": sorted(clients),
            "failures": [f.reason for f in failures],
            "uplink_bytes": {name: c["uplink_bytes"] for name, c in clients.items()},
            "num_examples": {name: c["num_examples"] for name, c in clients.items()},
            **self.round_record(clients),
        }
        self.write_round(record)  # the round's loggers; the classifier's run has its own
        (self.upload_dir / CLIENTS_FILE).write_text(json.dumps(clients, indent=1))

    def clients(self) -> dict[str, dict]:
        """Each client's metrics in the round (``num_examples``, ``uplink_bytes``...), in name order."""
        return json.loads((self.upload_dir / CLIENTS_FILE).read_text())

    def kept_uploads(self) -> list[Upload]:
        """The kept uploads, in client name order."""
        return [Upload(name, load_file(self.upload_dir / f"{name}.safetensors")) for name in self.clients()]

    def train_classifier(self, synthetic: Path) -> None:
        """Finetune the configured backbone and head on the ``synthetic`` split (``classifier/``)."""
        run_dir = train_central(self.cfg.classifier(synthetic))
        log.info("classifier trained on the synthetic set: %s", Path(run_dir) / "eval.json")


def one_shot_program(
    config: type[OneShotConfig],
    server: Callable[[OneShotConfig], OneShotServer],
    client: Callable[[OneShotConfig, dict[str, Scalar]], OneShotClient],
) -> Program:
    """The program of a one-shot config class: its server, a node's client, the simulated institutions
    (``federation.clients`` of them) of a config tree and the check before a simulation
    (:func:`check_one_shot_simulation`)."""

    def read(run_config: dict[str, Scalar]) -> OneShotConfig:
        return config.from_tree(program_config(run_config), "the run's config")

    return Program(
        lambda run_config: server(read(run_config)),
        lambda run_config, node_config: client(read(run_config), node_config),
        lambda tree: config.from_tree(tree).client_names,
        lambda run_config, source: check_one_shot_simulation(read(run_config), source),
    )


def check_one_shot_simulation(cfg: OneShotConfig, source: str) -> None:
    """What a simulation of a one-shot config needs of this machine, checked before the simulation engine
    starts: what the round-based program checks (:func:`federation.programs.base.check_simulation`), then the
    files only the server reads (its public images, ``check_server_inputs``).

    Raises:
        ConfigError, OutputPathError: naming the field or file at fault.
    """
    check_simulation(cfg, source)
    cfg.check_server_inputs()


__all__ = [
    "CLIENTS_FILE",
    "UPLOADS",
    "OneShotClient",
    "OneShotServer",
    "check_one_shot_simulation",
    "one_shot_program",
]
