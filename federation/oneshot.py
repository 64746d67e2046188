"""What every one-shot federated program's server shares: one round of uploads, kept on disk, and the rerun.

A one-shot server (:class:`OneShotServer`, subclassed by :mod:`federation.feddiff` and
:mod:`federation.ensemble`) runs one round in which every client uploads once, keeps each upload
(``uploads/<client>.safetensors``) and the round's record (``rounds.jsonl``: each client's examples,
uplink bytes and the metrics the program names), and writes ``uploads/clients.json`` last: once it
exists a rerun runs no round and goes straight to the program's ``finish``. A rerun with other
settings of what the uploads depend on is refused.
"""

from __future__ import annotations

import json
import logging
from typing import ClassVar

import numpy as np
import yaml
from safetensors.numpy import load_file, save_file

from federation.runtime import Failure, Reply, Scalars
from geofm.config.base import CONFIG_FILE, config_to_dict
from geofm.config.oneshot import OneShotConfig
from geofm.errors import ConfigError
from geofm.runlog import MetricsLog

log = logging.getLogger("geofm.federated")

UPLOADS = "uploads"
CLIENTS_FILE = "clients.json"  # in UPLOADS: every client's metrics, written last: the round is done
ROUNDS_LOG = "rounds.jsonl"


class OneShotServer:
    """The server of a one-shot program: one round, its uploads kept; the subclass's ``finish`` builds the classifier.

    Subclasses name the config sections their uploads depend on (``upload_sections``) and the client
    metrics logged per client in ``rounds.jsonl`` (``logged_metrics``), and may add to the round's
    record (:meth:`round_record`).
    """

    num_rounds = 1
    fraction = 1.0
    upload_sections: ClassVar[tuple[str, ...]] = ("data", "model", "federation", "seed")
    logged_metrics: ClassVar[tuple[str, ...]] = ("loss",)

    def __init__(self, cfg: OneShotConfig) -> None:
        fed = cfg.federation
        self.cfg, self.run_dir = cfg, cfg.run.output_dir
        self.min_clients, self.expected_clients = fed.min_clients, fed.clients
        self.round_timeout_s, self.connect_timeout_s, self.round_retries = (
            fed.round_timeout_s,
            fed.connect_timeout_s,
            fed.round_retries,
        )
        self.upload_dir = self.run_dir / UPLOADS
        self._check_resume()

    def _check_resume(self) -> None:
        """Refuse to continue a run whose uploads came from other settings.

        Raises:
            ConfigError: naming the changed section.
        """
        path = self.run_dir / CONFIG_FILE
        if not path.exists():
            return
        saved, current = yaml.safe_load(path.read_text()), config_to_dict(self.cfg)
        saved["seed"], current["seed"] = saved["run"]["seed"], current["run"]["seed"]
        for key in self.upload_sections:
            if saved.get(key) != current[key]:
                raise ConfigError(
                    f"{self.run_dir} holds the uploads of a {self.cfg.program_name} run with other {key} settings; "
                    "rerun with the same settings to continue it, or choose a new run.output_dir"
                )

    def start_round(self) -> int:
        return 2 if (self.upload_dir / CLIENTS_FILE).exists() else 1

    def register(self, node_id: int, identity: Scalars) -> None:
        """Nothing to learn: a reply names its client."""

    def configure(self, rnd: int, node_ids: list[int]) -> dict[int, tuple[dict, Scalars]]:
        return {node: ({}, {"round": rnd}) for node in node_ids}

    def round_record(self, clients: dict[str, dict]) -> dict:
        """What the program adds to the round's record in ``rounds.jsonl`` (nothing here)."""
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
            log.info(
                "round %d: %s uploaded %.2f MiB (%d images%s)",
                rnd,
                name,
                clients[name]["uplink_bytes"] / 2**20,
                reply.metrics["num_examples"],
                privacy,
            )
        record = {
            "round": rnd,
            "clients": sorted(clients),
            "failures": [f.reason for f in failures],
            **{key: {name: c[key] for name, c in clients.items()} for key in ("uplink_bytes", "num_examples")},
            **{key: {name: c[key] for name, c in clients.items() if key in c} for key in self.logged_metrics},
            **self.round_record(clients),
        }
        MetricsLog(self.run_dir / ROUNDS_LOG, resume_step=rnd - 1, key="round").write(record)
        (self.upload_dir / CLIENTS_FILE).write_text(json.dumps(clients, indent=1))

    def clients(self) -> dict[str, dict]:
        """Each client's metrics in the round (``num_examples``, ``uplink_bytes``...), in name order."""
        return json.loads((self.upload_dir / CLIENTS_FILE).read_text())

    def kept_uploads(self) -> dict[str, dict[str, np.ndarray]]:
        """The kept uploads by client name, in name order."""
        return {name: load_file(self.upload_dir / f"{name}.safetensors") for name in self.clients()}


__all__ = ["CLIENTS_FILE", "ROUNDS_LOG", "UPLOADS", "OneShotServer"]
