"""Ensemble distillation as a federated program (registered as ``ensemble``): one round of finetuned models, then a student.

The one-shot baseline of FedDF and of DENSE without its generator (:mod:`geofm.federated.ensemble`); the
config :class:`~geofm.config.oneshot.EnsembleConfig`.

1. Each client finetunes the configured backbone and head on its share of the train split (under
   ``federation.partition``; a deployed node: its whole train split) with central finetuning (the
   ``train`` section; no validation: its final weights), in ``clients/<client>`` of the run
   directory (its share linked into ``clients/<client>/share``), and uploads the weights once.
2. The server keeps the uploads and logs the round (:mod:`federation.oneshot`).
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

from federation.oneshot import OneShotServer
from federation.runtime import DATA_ROOT, INSTITUTION, Program, Scalar, Scalars, program_config
from geofm.config.base import CONFIG_FILE, config_to_dict
from geofm.config.oneshot import EnsembleConfig
from geofm.errors import ConfigError, DatasetTooSmallError
from geofm.federated.ensemble import average_state, distill, ensemble_probabilities, predict_logits, public_images
from geofm.federated.scenarios import PARTITION_FILE, read_partition
from geofm.runlog import MetricsLog
from geofm.tasks import TASKS

log = logging.getLogger("geofm.federated")

WEIGHTS = "model."  # upload keys: the finetuned model's state dict under this prefix


def read_config(run_config: dict[str, Scalar]) -> EnsembleConfig:
    """The run's validated config from the run config's ``config`` entry."""
    return EnsembleConfig.from_tree(program_config(run_config), "the run's config")


def client_names(tree: dict) -> list[str]:
    """The simulated institutions of an ensemble config tree (``federation.clients`` of them)."""
    return EnsembleConfig.from_tree(tree).client_names


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


class EnsembleClient:
    """A node's client program: finetunes the model on its share once and uploads its weights."""

    def __init__(self, cfg: EnsembleConfig, node_config: dict[str, Scalar]) -> None:
        self.name = str(node_config[INSTITUTION])
        data_root = node_config.get(DATA_ROOT)
        self.own_data = bool(data_root)
        self.cfg = cfg.for_node(self.name, str(data_root) if data_root else None, None)
        self.task = TASKS.get(self.cfg.task).federated(self.cfg)
        self.num_examples = self.task.client_share(self.name, self.own_data).num_examples

    def identity(self) -> Scalars:
        return {"client": self.name, "num_examples": self.num_examples}

    def train(self, arrays: dict, config: Scalars, state: dict) -> tuple[dict, Scalars, dict]:
        if not self.num_examples:
            raise DatasetTooSmallError(f"{self.name} holds no training samples")
        out = self.cfg.run.output_dir / "clients" / self.name
        share = None
        if not self.own_data:
            ids = read_partition(self.cfg.run.output_dir / PARTITION_FILE)[self.name]
            share = link_share(self.cfg.data.root, ids, out / "share")
        local = self.cfg.central(share, out / "run", validate=False)
        micro = min(local.train.micro_batch_size, self.num_examples)
        local = local.model_copy(update={"train": local.train.model_copy(update={"micro_batch_size": micro})})
        run_dir = TASKS.get(local.task).central(local)
        model = self.task.build_model(initial_weights=False)
        self.task.load_kept(model, run_dir)
        upload = {WEIGHTS + k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
        log.info("%s: finetuned on its %d examples (%s)", self.name, self.num_examples, run_dir)
        return upload, {"client": self.name, "num_examples": self.num_examples}, {}


class EnsembleServer(OneShotServer):
    """The server program: one round of finetuned models, then the student distilled from them (``finish``)."""

    upload_sections = ("task", "checkpoint", "model", "head", "data", "finetune", "train", "federation", "seed")
    logged_metrics = ()

    def finish(self) -> None:
        """Distil the student from the clients' averaged soft labels on the public images, validate and test it."""
        cfg, ens = self.cfg, self.cfg.ensemble
        uploads, clients = self.kept_uploads(), self.clients()
        counts = [float(clients[name]["num_examples"]) for name in uploads]
        states = [{k.removeprefix(WEIGHTS): v for k, v in arrays.items()} for arrays in uploads.values()]
        out = self.run_dir / "classifier"
        if out.exists():
            shutil.rmtree(out)
        student_cfg = cfg.central(None, out)
        out.mkdir(parents=True)
        (out / CONFIG_FILE).write_text(yaml.safe_dump(config_to_dict(student_cfg), sort_keys=False))
        task = TASKS.get(cfg.task).federated(student_cfg)
        images = public_images(ens.public, cfg.data, cfg.model.img_size)
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
        metrics = MetricsLog(out / "metrics.jsonl")
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
        extra = {"teachers": list(uploads), "public_images": len(images), "distill_loss": losses[-1]}
        path = task.export(student, out, ens.epochs, None, extra)
        log.info("student distilled from the ensemble: %s", path)


def make_server(run_config: dict[str, Scalar]) -> EnsembleServer:
    return EnsembleServer(read_config(run_config))


def make_client(run_config: dict[str, Scalar], node_config: dict[str, Scalar]) -> EnsembleClient:
    return EnsembleClient(read_config(run_config), node_config)


PROGRAM = Program(make_server, make_client, client_names)
"""Ensemble distillation (FedDF-style, one-shot): registered as ``"ensemble"`` in :data:`federation.runtime.PROGRAMS`."""

__all__ = ["PROGRAM", "EnsembleClient", "EnsembleServer", "client_names", "link_share", "make_client", "make_server"]
