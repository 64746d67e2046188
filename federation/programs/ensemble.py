"""Ensemble distillation as a federated program (registered as ``ensemble``): one round of finetuned models, then a student.

The one-shot baseline of FedDF and of DENSE without its generator (:mod:`geofm.fl.oneshot.ensemble`); the
config :class:`~geofm.config.ensemble.EnsembleConfig`; what it shares with the other one-shot programs
:mod:`federation.programs.oneshot`.

1. Each client finetunes the configured backbone and head on its share of the train split (under
   ``federation.partition``; a deployed node: its whole train split) with central finetuning (the
   ``train`` section; no validation: its final weights), in ``clients/<client>`` of the run
   directory (its share linked into ``clients/<client>/share``), and uploads the weights once.
2. The server keeps the uploads and logs the round (``rounds.jsonl``: each client's examples and uplink bytes).
3. After the round the server computes each client's class probabilities at ``ensemble.temperature``
   on the public unlabelled images (``ensemble.public``), averages them (by example counts, or
   plainly) and trains the student (the clients' averaged weights, or ``checkpoint``) to match them,
   validating it on the real validation split and testing the best on the test split
   (``classifier/``: ``eval.json``, ``best/``, ``metrics.jsonl``, so ``geofm eval`` and ``geofm report``
   read it).

A rerun of a run whose uploads are kept runs no round: it distils the student again from them.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import yaml

from federation.programs.oneshot import OneShotClient, OneShotServer, one_shot_program
from federation.runtime.contract import Scalars
from geofm.config.base import CONFIG_FILE, config_to_dict
from geofm.config.ensemble import EnsembleConfig
from geofm.config.oneshot import CLASSIFIER
from geofm.errors import ConfigError, DatasetTooSmallError
from geofm.fl.oneshot.ensemble import (
    average_state,
    distill,
    ensemble_probabilities,
    predict_logits,
    public_tiles,
)
from geofm.fl.partitions.samples import PARTITION_FILE, read_partition
from geofm.loggers import RunLoggers
from geofm.tasks import federated_task, train_central

log = logging.getLogger("geofm.fl")

WEIGHTS = "model."  # upload keys: the finetuned model's state dict under this prefix


def link_share(root: Path, sample_ids: list[str], folder: Path) -> Path:
    """A classification split folder of a client's samples: ``folder/<class>/<file>`` linked to each sample's file
    (``data.root``-relative ids of ``partition.json``, their parent folder the class), rebuilt."""
    if folder.exists():
        shutil.rmtree(folder)
    for sample in sample_ids:
        if "[" in sample:
            raise ConfigError(f"ensemble: sample {sample!r} is a window of a scene; the clients train on whole scenes")
        source = (root / sample).resolve()
        target = folder / source.parent.name / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(source, target)
    return folder


class EnsembleClient(OneShotClient):
    """A node's client program: finetunes the model on its share once and uploads its weights."""

    cfg: EnsembleConfig

    def train(self, arrays: dict, config: Scalars, state: dict) -> tuple[dict, Scalars, dict]:
        if not len(self.indices):
            raise DatasetTooSmallError(f"{self.name} holds no training samples")
        out = self.cfg.run.output_dir / "clients" / self.name
        share = None
        if not self.own_data:
            ids = read_partition(self.cfg.run.output_dir / PARTITION_FILE)[self.name]
            share = link_share(self.cfg.data.root, ids, out / "share")
        local = self.cfg.central(share, out / "run", validate=False)
        epoch = len(self.indices) * self.cfg.data.crops_per_scene  # a batch no larger than the share's epoch
        micro = min(local.train.micro_batch_size, epoch)
        local = local.model_copy(update={"train": local.train.model_copy(update={"micro_batch_size": micro})})
        run_dir = train_central(local)
        model = self.data.build_model(initial_weights=False)
        self.data.load_kept(model, run_dir)
        upload = {WEIGHTS + k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        log.info("%s: finetuned on its %d examples (%s)", self.name, len(self.indices), run_dir)
        return upload, self.identity(), {}


class EnsembleServer(OneShotServer):
    """The server program: one round of finetuned models, then the student distilled from them (``finish``)."""

    cfg: EnsembleConfig
    resume_sections = ("task", "checkpoint", "model", "head", "data", "finetune", "train", "federation")

    def finish(self) -> None:
        """Distil the student from the clients' averaged soft labels on the public images, validate and test it."""
        cfg, ens = self.cfg, self.cfg.ensemble
        uploads, clients = self.kept_uploads(), self.clients()
        counts = [float(clients[upload.name]["num_examples"]) for upload in uploads]
        states = [{k.removeprefix(WEIGHTS): v for k, v in upload.arrays.items()} for upload in uploads]
        out = self.run_dir / CLASSIFIER
        if out.exists():
            shutil.rmtree(out)
        student_cfg = cfg.classifier()
        out.mkdir(parents=True)
        (out / CONFIG_FILE).write_text(yaml.safe_dump(config_to_dict(student_cfg), sort_keys=False))
        task = federated_task(student_cfg)
        images = public_tiles(ens.public, cfg.data, cfg.model.img_size)
        logits = []
        for state in states:
            teacher = task.build_model(initial_weights=False)
            teacher.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
            logits.append(predict_logits(teacher, images, ens.batch_size, task.device))
        weights = counts if ens.weighting == "examples" else [1.0] * len(states)
        targets = ensemble_probabilities(logits, weights, ens.temperature)
        student = task.build_model(initial_weights=ens.student_init == "checkpoint")
        if ens.student_init == "average":
            student.load_state_dict(average_state(states, counts))
        # The student's run folder, with its loggers: closed as finished, or as the error that ended it.
        with RunLoggers(out / "metrics.jsonl", student_cfg.run, config=config_to_dict(student_cfg)) as metrics:
            every = cfg.finetune.eval_every

            def after_epoch(epoch: int, loss: float) -> None:
                metrics.write({"step": epoch, "epoch": epoch, "loss": loss})
                if epoch % every == 0 or epoch == ens.epochs:
                    values = task.evaluate_round(student, epoch)
                    if values is not None:
                        metrics.write({"step": epoch, "epoch": epoch, "val": values})

            log.info("distilling %d teachers on %d public images", len(states), len(images))
            losses = distill(
                student,
                images,
                targets,
                temperature=ens.temperature,
                epochs=ens.epochs,
                batch_size=ens.batch_size,
                lr=ens.lr,
                device=task.device,
                seed=cfg.run.seed,
                after_epoch=after_epoch,
            )
            extra = {
                "teachers": [upload.name for upload in uploads],
                "public_images": len(images),
                "distill_loss": losses[-1],
            }
            path = task.export(student, out, ens.epochs, None, extra)
            metrics.artifacts(task.products(out))
            log.info("student distilled from the ensemble: %s", path)


PROGRAM = one_shot_program(EnsembleConfig, EnsembleServer, EnsembleClient)
"""Ensemble distillation (FedDF-style, one-shot): registered as ``"ensemble"`` in :data:`federation.runtime.contract.PROGRAMS`."""

__all__ = ["PROGRAM", "EnsembleClient", "EnsembleServer", "link_share"]
