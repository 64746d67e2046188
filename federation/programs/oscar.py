"""OSCAR as a federated program (registered as ``oscar``): one round of class embeddings, then a classifier.

One-shot federated classification with a classifier-free diffusion model, after OSCAR (Zaland et
al., 2025); the method's pieces are :mod:`geofm.fl.oneshot.oscar`, the config
:class:`~geofm.config.oscar.OscarConfig`, what it shares with the other one-shot programs
:mod:`federation.programs.oneshot`.

1. Each client (its share of the train split under ``federation.partition``, or a deployed node's
   whole train split; evaluation views, no augmentation) trains nothing: it encodes its images with
   the shared encoder and uploads, once, the mean embedding of each class it holds and its per-class
   counts (``rounds.jsonl``: its examples and uplink bytes).
2. After the round the server takes its diffusion model (``oscar.diffusion_checkpoint``, or the one
   this run trained, ``server_model.safetensors``, or trains one now on ``oscar.public``), draws per
   client and class as many samples as the client holds, guided by the uploaded mean embedding
   (``synthetic/``, resumable), and finetunes the configured backbone and head on them, validated and
   tested on the real splits (``classifier/``: ``eval.json``, ``best/``).

A rerun of a run whose uploads are kept runs no round and trains no server model again: it
continues the sampling and the finetuning.
"""

from __future__ import annotations

import logging

from federation.programs.oneshot import OneShotClient, OneShotServer, one_shot_program
from federation.runtime.contract import Scalars
from geofm.config.oscar import OscarConfig
from geofm.data.finetune import build_finetune_dataset
from geofm.fl.oneshot.feddiff import LabelledImages
from geofm.fl.oneshot.oscar import build_encoder, class_embeddings, generate, server_model
from geofm.training import engine as ds

log = logging.getLogger("geofm.fl")


class OscarClient(OneShotClient):
    """A node's client program: the mean embedding of each class of its share of the train split, once."""

    cfg: OscarConfig

    def train(self, arrays: dict, config: Scalars, state: dict) -> tuple[dict, Scalars, dict]:
        cfg = self.cfg  # the train split's samples in its evaluation views: unaugmented
        views = build_finetune_dataset(cfg.data, cfg.task, "train", cfg.model.img_size, train=False)
        device = ds.device()
        images = LabelledImages(views, self.indices)
        upload = class_embeddings(
            build_encoder(cfg, device), images, cfg.data.num_classes, cfg.train.micro_batch_size, device
        )
        log.info("%s: embedded %d images, %d classes", self.name, len(images), len(upload["class_embeddings"]))
        return upload, {"client": self.name, "num_examples": len(images)}, {}


class OscarServer(OneShotServer):
    """The server program: one round of class embeddings, then its guided samples and the classifier (``finish``)."""

    cfg: OscarConfig
    resume_sections = (*OneShotServer.resume_sections, "diffusion", "oscar")

    def finish(self) -> None:
        """Take the server model, sample every client's classes, and finetune the classifier on the samples."""
        device = ds.device()
        model = server_model(self.cfg, build_encoder(self.cfg, device), self.run_dir, device)
        synthetic = self.run_dir / "synthetic"
        records = generate(self.cfg, self.kept_uploads(), model, synthetic)
        log.info("OSCAR: %d synthetic samples in %s", sum(len(r["files"]) for r in records), synthetic)
        self.train_classifier(synthetic)


PROGRAM = one_shot_program(OscarConfig, OscarServer, OscarClient)
"""OSCAR: one round of per-class mean embeddings, then a classifier trained on the server's guided samples;
registered as ``"oscar"`` in :data:`federation.runtime.contract.PROGRAMS`."""

__all__ = ["PROGRAM", "OscarClient", "OscarServer"]
