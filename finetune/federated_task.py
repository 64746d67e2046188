"""A finetuning task as a federated program runs it: every client finetunes on its share of the train split.

The federated program (:mod:`federation`) asks the task for the model, a client's share and
batches, the forward of one micro-batch, the global model's validation each round and the end of
the run. Each piece is central finetuning's own (:mod:`finetune.run`): the model and its loaded
backbone, the heads, the parameter groups with layer decay, the loss and label mixing, the
evaluation, the kept best weights (``best/``) and ``eval.json``; so ``geofm eval``, ``geofm report``
and ``geofm predict`` read a federated run directory as they read a central one.

A client's share is its part of the train split under the configured sample partitioner
(:mod:`geofm.fl.partitions.samples`, written to ``partition.json``); a deployed node given its own
``data-root`` trains on all of its train split instead.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from finetune.best import BEST_DIR, load_best_weights, read_best, save_best
from finetune.evaluate import eval_record, evaluate, format_metrics, write_json
from finetune.run import EVAL_FILE, RESUME_INVARIANTS, checkpoint_provenance, finetune_inputs
from finetune.splits import build_split
from geofm.checkpoints import LoadReport
from geofm.config.fedfinetune import FederatedFinetuneConfig
from geofm.data.finetune import FinetuneDataset
from geofm.errors import DatasetTooSmallError
from geofm.fl.partitions.samples import (
    PARTITION_FILE,
    SAMPLE_PARTITIONERS,
    SampleTable,
    read_metadata,
    write_partition,
)
from geofm.tasks import ClientShare, StepOutput
from geofm.tasks.finetuning import FinetuneTask, task_of
from geofm.tasks.finetuning.model import FinetuneModel, build_finetune_model
from geofm.training import engine as ds
from geofm.training.rundir import InputPath

log = logging.getLogger("geofm.fl")


def _sample_id(source, index: int, root: Path, split: str) -> str:
    """A folder dataset's first file relative to ``data.root`` (``train/forest/3.tif``), else
    ``<split>/<index>`` (a torchgeo dataset's sample)."""
    items = getattr(source, "items", None)
    if items is None:
        return f"{split}/{index}"
    first = next(p for p in items[index].values() if isinstance(p, Path))
    try:
        return first.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:  # a split folder outside data.root
        return first.as_posix()


def sample_table(dataset, root: Path, split: str, metadata: Path | None = None) -> SampleTable:
    """A split's samples as partitioners see them: their ids (a window of a scene adds its rows and
    columns, ``train/images/a.tif[0:64,64:128]``), labels where cheaply known, and the fields of the
    ``metadata`` CSV for their scenes (see :func:`~geofm.fl.partitions.samples.read_metadata`)."""
    if not isinstance(dataset, FinetuneDataset):
        return SampleTable([f"{split}/{i}" for i in range(len(dataset))])
    windows = [dataset.sample_window(i) for i in range(len(dataset))]
    scenes = [scene for scene, _ in windows]
    scene_ids = [_sample_id(dataset.source, scene, root, split) for scene in scenes]
    ids = [
        scene_id if w is None else f"{scene_id}[{w.row}:{w.row + w.height},{w.col}:{w.col + w.width}]"
        for scene_id, (_, w) in zip(scene_ids, windows, strict=True)
    ]
    labels = dataset.source.labels()
    return SampleTable(
        ids,
        None if labels is None else np.asarray(labels)[scenes],
        read_metadata(metadata, scene_ids) if metadata is not None else {},
    )


class FederatedFinetuning:
    """One finetuning task (:class:`~geofm.tasks.finetuning.base.FinetuneTask`) on one machine's view of a federated run:
    what a federated program holds of a finetuning task (:data:`geofm.tasks.FEDERATED_TASKS`).

    Args:
        cfg: the run's config as this machine sees it, to which the task it names is bound.
    """

    kind = "finetuning"
    log_keys = ("loss",)
    resume_invariants = RESUME_INVARIANTS

    def __init__(self, cfg: FederatedFinetuneConfig) -> None:
        self.task: FinetuneTask = task_of(cfg)
        self.cfg = cfg
        self.device, self.dtype = ds.device(), ds.compute_dtype(self.cfg.train)
        self.report: LoadReport | None = None

    # ---- files ------------------------------------------------------------------------------
    def inputs(self) -> list[InputPath]:
        """The files a client reads besides its data: none (its backbone arrives with the global model)."""
        return []

    def server_inputs(self) -> list[InputPath]:
        """The backbone checkpoint the server starts the global model from; the held-out splits the
        server evaluates the global model on (validation each round, test at the end) are listed now,
        so that a server without them stops before the first round, naming the missing folder."""
        _ = self.val_set, self.test_set
        return finetune_inputs(self.cfg)

    def client_inputs(self) -> list[InputPath]:
        """The train split, which every client takes its share of: listed now, so that a simulation without
        it stops before it starts, naming the missing folder."""
        _ = self.train_set
        return []

    @functools.cached_property
    def train_set(self):
        return build_split(self.cfg, "train", train=True)

    @functools.cached_property
    def val_set(self):
        split = self.cfg.finetune.val_split
        return build_split(self.cfg, split, train=False) if split else None

    @functools.cached_property
    def test_set(self):
        return build_split(self.cfg, "test", train=False)

    def client_share(self, name: str, own_data: bool) -> ClientShare:
        """Client ``name``'s indices into the train split: its part under the sample partitioner, or
        the whole split of a node with its own data (``own_data``); each counts ``data.crops_per_scene``
        examples, as in an epoch of central finetuning."""
        indices = np.arange(len(self.train_set)) if own_data else self.partition()[name]
        return ClientShare(len(indices) * self.cfg.data.crops_per_scene, indices)

    @functools.cache  # noqa: B019 (one task object per run and process)
    def partition(self, split: str = "train") -> dict[str, np.ndarray]:
        """Every client's indices into ``split`` (train, or the validation split for the clients' own
        validation) under ``federation.partition`` of the samples ``federation.where`` keeps, seeded by
        ``run.seed``; written to ``partition.json`` (``partition_val.json``)."""
        fed, seed = self.cfg.federation, self.cfg.run.seed
        dataset, name = (self.train_set, "train") if split == "train" else (self.val_set, self.cfg.finetune.val_split)
        table = sample_table(dataset, self.cfg.data.root, name, fed.metadata)
        kept, indices = table.where(fed.where) if fed.where else (table, np.arange(len(table)))
        options = {"alpha": fed.dirichlet_alpha, "field": fed.partition_field}
        dealt = SAMPLE_PARTITIONERS.get(fed.partition)(kept, fed.clients, seed=seed, **options)
        assignment = {name: indices[held] for name, held in dealt.items()}
        path = self.cfg.run.output_dir / (PARTITION_FILE if split == "train" else f"partition_{split}.json")
        if not path.exists():
            write_partition(path, assignment, table, partitioner=fed.partition, seed=seed, where=fed.where, **options)
        return assignment

    # ---- model --------------------------------------------------------------------------------
    def build_model(self, initial_weights: bool = True) -> FinetuneModel:
        """The finetuning model; with ``initial_weights`` its backbone loaded from ``checkpoint`` (the
        server's starting global model), without (a client overwrites it with the global model)."""
        model, report = build_finetune_model(self.cfg, load_weights=initial_weights)
        if initial_weights:
            self.report = report
            log.info("backbone: %s", report if report is not None else "random initialisation (no checkpoint)")
        return model

    def load_kept(self, model: FinetuneModel, run_dir: Path) -> dict:
        """Load a finetuning run's kept weights (``best/``) into ``model``; returns their record."""
        return load_best_weights(model, run_dir)

    def prepare(self, model: FinetuneModel) -> None:
        """Move the model to this machine's device for training."""
        model.to(self.device)

    def param_groups(self, model: FinetuneModel) -> list[dict]:
        """Central finetuning's AdamW groups: layer-wise lr decay, no weight decay on norms and biases."""
        return model.param_groups(self.cfg.train.weight_decay, self.cfg.finetune.layer_decay)

    def local_batches(self, indices: np.ndarray, steps: int, rnd: int, seed: int) -> Iterator[list[dict]]:
        """``steps`` local steps, each a list of micro-batches, drawn in turn from an endless stream of
        the client's samples reshuffled every pass in an order fixed by (``seed``, round, pass): a
        batch may span two passes, and a client with fewer samples than one step's batch repeats them
        (under label skew a client may hold a handful). Each step's augmentations (and the loader's
        workers) draw from torch's generator seeded by (``seed``, round, step), so a resumed run trains
        on the same crops as an unbroken one. Over several processes (``federation.local_processes``)
        each takes every ``world_size``-th sample of the order, so a step's micro-batches over all
        processes hold the samples of one process's step at the same global batch."""
        if not len(indices):
            raise DatasetTooSmallError("this client holds no training samples")
        train = self.cfg.train
        rank, world_size = ds.data_parallel_rank()
        passes = (np.random.default_rng([seed, rnd, p]).permutation(indices) for p in itertools.count())
        order = itertools.islice(itertools.chain.from_iterable(passes), steps * ds.global_batch(train, world_size))
        shard = [int(i) for i in itertools.islice(order, rank, None, world_size)]
        loader = DataLoader(
            self.train_set, batch_size=train.micro_batch_size, sampler=shard, num_workers=self.cfg.data.num_workers
        )
        batches = None
        for step in range(steps):
            torch.manual_seed(int(np.random.SeedSequence([seed, rnd, step]).generate_state(1)[0]))
            batches = batches or iter(loader)
            yield [next(batches) for _ in range(train.grad_accum_steps)]

    def forward(self, model, batch: dict) -> StepOutput:
        """The task's loss of one micro-batch (label mixing included where the task mixes)."""
        return self.task.forward(model, batch, self.device, self.dtype)

    def after_step(self, model: FinetuneModel, progress: float) -> None:
        """Nothing follows a finetuning step beyond the optimizer's."""
        return None

    def public_images(self) -> None:
        """Finetuning offers the server no public images (the config refuses ``distill_steps``)."""
        return None

    def evaluate_client(self, model: FinetuneModel, name: str, own_data: bool) -> dict[str, float] | None:
        """Client ``name``'s model on its own validation data: its part of the validation split under
        the same partitioner and seed as its training share (a node with its own data: all of it)."""
        if self.val_set is None:
            return None
        indices = np.arange(len(self.val_set)) if own_data else self.partition("val")[name]
        return evaluate(model, Subset(self.val_set, indices.tolist()), self.cfg, self.device, self.dtype).metrics

    # ---- rounds and the end --------------------------------------------------------------------
    def evaluate_round(self, model: FinetuneModel, rnd: int) -> dict[str, float] | None:
        """The global model's metrics on the validation split; a better one is kept in ``best/``."""
        if self.val_set is None:
            return None
        model.to(self.device)
        values = evaluate(model, self.val_set, self.cfg, self.device, self.dtype).metrics
        metric, best = self.cfg.primary_metric, read_best(self.cfg.run.output_dir)
        if best is None or self.task.improves(metric, values[metric], best["value"]):
            record = {"round": rnd, "step": rnd, "split": self.cfg.finetune.val_split, "metric": metric}
            save_best(model, self.cfg.run.output_dir, {**record, "value": values[metric], "metrics": values})
        log.info("round %d: %s %s", rnd, self.cfg.finetune.val_split, format_metrics(values))
        return values

    def export(self, model: FinetuneModel, run_dir: Path, step: int, final: dict | None, extra: dict) -> Path:
        """Evaluate the kept weights (the best validated global model, else the last) on the test split
        and write ``eval.json`` as central finetuning does, with the federation in it."""
        if self.val_set is None:
            record = {"round": step, "step": step, "split": None, "metric": None, "value": None, "metrics": {}}
            save_best(model, run_dir, record)
        model.to(self.device)
        selected = load_best_weights(model, run_dir)
        test = evaluate(model, self.test_set, self.cfg, self.device, self.dtype)
        evaluation = eval_record(
            self.cfg,
            "test",
            test,
            checkpoint=checkpoint_provenance(self.cfg, self.report),
            arch=self.cfg.model.arch,
            bands=list(self.cfg.data.bands),
            frozen=self.cfg.model.frozen,
            rounds=step,
            final=final,
            selected=selected,
            run_dir=str(run_dir),
            **extra,
        )
        log.info(
            "test %s (weights of round %s): %s",
            self.cfg.dataset_name,
            selected.get("round"),
            format_metrics(test.metrics),
        )
        return write_json(evaluation, run_dir / EVAL_FILE)

    def products(self, run_dir: Path) -> list[Path]:
        """The kept weights (``best/``) and their test evaluation (``eval.json``)."""
        return [run_dir / BEST_DIR, run_dir / EVAL_FILE]


__all__ = ["FederatedFinetuning", "sample_table"]
