"""FedDiff as a federated program (registered as ``feddiff``): one round of diffusion models, then a classifier.

One-shot federated classification after Mendieta, Sun and Chen (WACV 2025); the method's pieces are
:mod:`geofm.fl.oneshot.feddiff`, the config :class:`~geofm.config.feddiff.FedDiffConfig`.

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
What FedDiff shares with the other one-shot programs (the clients' data, the round, the classifier) is
:mod:`federation.programs.oneshot`.
"""

from __future__ import annotations

import logging

from federation.programs.oneshot import OneShotClient, OneShotServer, one_shot_program
from federation.runtime.contract import Scalars
from geofm.config.feddiff import FedDiffConfig
from geofm.fl.oneshot.feddiff import LabelledImages, filter_samples, generate, train_client
from geofm.training import engine as ds

log = logging.getLogger("geofm.fl")


class FedDiffClient(OneShotClient):
    """A node's client program: trains its diffusion model on its share of the train split, once."""

    every_band = True  # the diffusion model learns and generates the dataset's every band

    def train(self, arrays: dict, config: Scalars, state: dict) -> tuple[dict, Scalars, dict]:
        images = LabelledImages(self.data.train_set, self.indices)
        upload, metrics = train_client(self.cfg, images, self.name, ds.device())
        log.info("%s: trained its diffusion model, %d steps, loss %.4f", self.name, metrics["steps"], metrics["loss"])
        return upload, {"client": self.name, **metrics}, {}


class FedDiffServer(OneShotServer):
    """The server program: one round of uploads, then sampling, filtering and the classifier (``finish``)."""

    cfg: FedDiffConfig
    resume_sections = (*OneShotServer.resume_sections, "diffusion")

    def round_record(self, clients: dict[str, dict]) -> dict:
        """Each client's loss and, under privacy, its epsilons and the largest client's."""
        record = {"loss": {name: c["loss"] for name, c in clients.items()}}
        privacy = self.cfg.diffusion.privacy
        if privacy is not None:
            keys = ("epsilon", "epsilon_model", "epsilon_fmf")
            record["clients_epsilon"] = {n: {k: c[k] for k in keys if k in c} for n, c in clients.items()}
            record["epsilon"] = max(c["epsilon"] for c in clients.values())
            record["delta"] = privacy.delta
        return record

    def finish(self) -> None:
        """Sample every client's model, filter, and finetune the classifier on what is kept."""
        samples, synthetic = self.run_dir / "samples", self.run_dir / "synthetic"
        records = generate(self.cfg, self.kept_uploads(), samples, ds.device())
        summary = filter_samples(self.cfg, records, samples, synthetic)
        for name, kept in summary.items():
            log.info("FMF: %s kept %d of %d samples", name, kept["samples"] - len(kept["dropped"]), kept["samples"])
        self.train_classifier(synthetic)


PROGRAM = one_shot_program(FedDiffConfig, FedDiffServer, FedDiffClient)
"""FedDiff (WACV 2025): one round of class-conditional diffusion models, then a classifier trained on their
samples; registered as ``"feddiff"`` in :data:`federation.runtime.contract.PROGRAMS`."""

__all__ = ["PROGRAM", "FedDiffClient", "FedDiffServer"]
