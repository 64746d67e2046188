"""FedDiff as a federated program (registered as ``feddiff``): one round of diffusion models, then a classifier.

One-shot federated classification after Mendieta, Sun and Chen (WACV 2025); the method's pieces are
:mod:`geofm.federated.feddiff`, the config :class:`~geofm.config.feddiff.FedDiffConfig`.

1. Each client (its share of the train split under ``federation.partition``, or a deployed node's
   whole train split) trains a class-conditional diffusion model on every band of its images and
   uploads, once, its weights, its per-class counts and its mean Fourier magnitude.
2. The server keeps the uploads (``uploads/<client>.safetensors``, ``uploads/clients.json``, see
   :mod:`federation.oneshot`) and logs the round to ``rounds.jsonl``: each client's examples, uplink bytes, loss and, under privacy, its
   epsilons (``epsilon``: the largest client's composed total).
3. After the round the server samples every client's model per class (``samples/``, resumable),
   keeps what Fourier magnitude filtering keeps (``synthetic/``, ``fmf.json``) and finetunes the
   configured backbone and head on it with central finetuning, validated and tested on the real
   splits (``classifier/``: ``eval.json``, ``best/``, so ``geofm eval`` and ``geofm report`` read it).

A rerun of a run whose uploads are kept runs no round: it continues the sampling and the finetuning.
"""

from __future__ import annotations

import logging
from pathlib import Path

from federation.oneshot import OneShotServer
from federation.runtime import DATA_ROOT, INSTITUTION, Program, Scalar, Scalars, program_config
from geofm import engine as ds
from geofm.config.feddiff import FedDiffConfig
from geofm.federated.feddiff import LabelledImages, Upload, filter_samples, generate, train_client
from geofm.tasks import TASKS

log = logging.getLogger("geofm.federated")


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


class FedDiffServer(OneShotServer):
    """The server program: one round of uploads, then sampling, filtering and the classifier (``finish``)."""

    upload_sections = ("data", "model", "federation", "diffusion", "seed")

    def round_record(self, clients: dict[str, dict]) -> dict:
        """Under privacy, each client's epsilons and the largest client's composed total."""
        if self.cfg.diffusion.privacy is None:
            return {}
        keys = ("epsilon", "epsilon_model", "epsilon_fmf")
        return {
            "clients_epsilon": {n: {k: c[k] for k in keys if k in c} for n, c in clients.items()},
            "epsilon": max(c["epsilon"] for c in clients.values()),
            "delta": self.cfg.diffusion.privacy.delta,
        }

    def finish(self) -> None:
        """Sample every client's model, filter, and finetune the classifier on what is kept."""
        uploads = [Upload(name, arrays) for name, arrays in self.kept_uploads().items()]
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
