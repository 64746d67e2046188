"""FedDiff as a federated program (registered as ``feddiff``): one round of diffusion models, then a classifier.

One-shot federated classification after Mendieta, Sun and Chen (WACV 2025); the method's pieces are
:mod:`geofm.federated.feddiff`, the config :class:`~geofm.config.feddiff.FedDiffConfig`.

1. Each client (its share of the train split under ``federation.partition``, or a deployed node's
   whole train split) trains a class-conditional diffusion model on every band of its images and
   uploads, once, its weights, its per-class counts and its mean Fourier magnitude.
2. The server keeps the uploads (``uploads/<client>.safetensors``, ``uploads/clients.json``) and logs
   the round to ``rounds.jsonl``: each client's examples, uplink bytes, loss and, under privacy, its
   epsilons (``epsilon``: the largest client's composed total).
3. After the round the server samples every client's model per class (``samples/``, resumable),
   keeps what Fourier magnitude filtering keeps (``synthetic/``, ``fmf.json``) and finetunes the
   configured backbone and head on it with central finetuning, validated and tested on the real
   splits (``classifier/``: ``eval.json``, ``best/``, so ``geofm eval`` and ``geofm report`` read it).

A rerun of a run whose uploads are kept runs no round: it continues the sampling and the finetuning.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import yaml
from safetensors.numpy import load_file, save_file

from federation.runtime import DATA_ROOT, INSTITUTION, Failure, Program, Reply, Scalar, Scalars, program_config
from geofm import engine as ds
from geofm.config.base import CONFIG_FILE, config_to_dict
from geofm.config.feddiff import FedDiffConfig
from geofm.errors import ConfigError
from geofm.federated.feddiff import LabelledImages, Upload, filter_samples, generate, train_client
from geofm.runlog import MetricsLog
from geofm.tasks import TASKS

log = logging.getLogger("geofm.federated")

UPLOADS = "uploads"
CLIENTS_FILE = "clients.json"  # in UPLOADS: every client's metrics, written last: the round is done
ROUNDS_LOG = "rounds.jsonl"


def read_config(run_config: dict[str, Scalar]) -> FedDiffConfig:
    """The run's validated FedDiff config from the run config's ``config`` entry."""
    return FedDiffConfig.from_tree(program_config(run_config), "the run's config")


def client_names(tree: dict) -> list[str]:
    """The simulated institutions of a FedDiff config tree (``federation.clients`` of them)."""
    return FedDiffConfig.from_tree(tree).client_names


class FedDiffClient:
    """A node's client program: trains its diffusion model on its share of the train split, once."""

    def __init__(self, cfg: FedDiffConfig, node_config: dict[str, Scalar]) -> None:
        self.name = str(node_config[INSTITUTION])
        data_root = node_config.get(DATA_ROOT)
        self.cfg = cfg.for_node(self.name, str(data_root) if data_root else None, None).all_bands()
        self.data = TASKS.get(self.cfg.task).federated(self.cfg)
        self.indices = self.data.client_share(self.name, bool(data_root)).data

    def identity(self) -> Scalars:
        return {"client": self.name, "num_examples": len(self.indices)}

    def train(self, arrays: dict, config: Scalars, state: dict) -> tuple[dict, Scalars, dict]:
        images = LabelledImages(self.data.train_set, self.indices)
        upload, metrics = train_client(self.cfg, images, self.name, ds.device())
        log.info("%s: trained its diffusion model, %d steps, loss %.4f", self.name, metrics["steps"], metrics["loss"])
        return upload, {"client": self.name, **metrics}, {}


class FedDiffServer:
    """The server program: one round of uploads, then sampling, filtering and the classifier (``finish``)."""

    num_rounds = 1
    fraction = 1.0

    def __init__(self, cfg: FedDiffConfig) -> None:
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
        """Refuse to continue a run whose uploads or samples came from other settings.

        Raises:
            ConfigError: naming the changed section.
        """
        path = self.run_dir / CONFIG_FILE
        if not path.exists():
            return
        saved, current = yaml.safe_load(path.read_text()), config_to_dict(self.cfg)
        saved["seed"], current["seed"] = saved["run"]["seed"], current["run"]["seed"]
        for key in ("data", "model", "federation", "diffusion", "seed"):
            if saved.get(key) != current[key]:
                raise ConfigError(
                    f"{self.run_dir} holds the uploads of a FedDiff run with other {key} settings; rerun with the "
                    "same settings to continue it, or choose a new run.output_dir"
                )

    def start_round(self) -> int:
        return 2 if (self.upload_dir / CLIENTS_FILE).exists() else 1

    def register(self, node_id: int, identity: Scalars) -> None:
        """Nothing to learn: a reply names its client."""

    def configure(self, rnd: int, node_ids: list[int]) -> dict[int, tuple[dict, Scalars]]:
        return {node: ({}, {"round": rnd}) for node in node_ids}

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
            "uplink_bytes": {name: c["uplink_bytes"] for name, c in clients.items()},
            "num_examples": {name: c["num_examples"] for name, c in clients.items()},
            "loss": {name: c["loss"] for name, c in clients.items()},
        }
        if self.cfg.diffusion.privacy is not None:
            keys = ("epsilon", "epsilon_model", "epsilon_fmf")
            record["clients_epsilon"] = {n: {k: c[k] for k in keys if k in c} for n, c in clients.items()}
            record["epsilon"] = max(c["epsilon"] for c in clients.values())
            record["delta"] = self.cfg.diffusion.privacy.delta
        MetricsLog(self.run_dir / ROUNDS_LOG, resume_step=rnd - 1, key="round").write(record)
        (self.upload_dir / CLIENTS_FILE).write_text(json.dumps(clients, indent=1))

    def finish(self) -> None:
        """Sample every client's model, filter, and finetune the classifier on what is kept."""
        clients = json.loads((self.upload_dir / CLIENTS_FILE).read_text())
        uploads = [Upload(name, load_file(self.upload_dir / f"{name}.safetensors")) for name in clients]
        samples, synthetic = self.run_dir / "samples", self.run_dir / "synthetic"
        records = generate(self.cfg, uploads, samples, ds.device())
        summary = filter_samples(self.cfg, records, samples, synthetic)
        for name, kept in summary.items():
            log.info("FMF: %s kept %d of %d samples", name, kept["samples"] - len(kept["dropped"]), kept["samples"])
        run_dir = TASKS.get(self.cfg.task).central(self.cfg.classifier(synthetic))
        log.info("classifier trained on the synthetic set: %s", Path(run_dir) / "eval.json")


def make_server(run_config: dict[str, Scalar]) -> FedDiffServer:
    return FedDiffServer(read_config(run_config))


def make_client(run_config: dict[str, Scalar], node_config: dict[str, Scalar]) -> FedDiffClient:
    return FedDiffClient(read_config(run_config), node_config)


PROGRAM = Program(make_server, make_client, client_names)
"""FedDiff (WACV 2025): one round of class-conditional diffusion models, then a classifier trained on their
samples; registered as ``"feddiff"`` in :data:`federation.runtime.PROGRAMS`."""

__all__ = ["PROGRAM", "FedDiffClient", "FedDiffServer", "client_names", "make_client", "make_server", "read_config"]
