"""Federated continual pretraining: the server and client programs the runtime runs on Flower.

Every client trains the GFM objective (SimMIM without a teacher) on its own imagery with the very
step of central pretraining (:func:`pretrain.central.mim_forward` in :class:`geofm.loop.TrainLoop`:
same objective, parameter groups, clipping, engine), wrapped by its algorithm's hooks; the algorithm
(:mod:`geofm.federated.algorithms`) decides what is uploaded, how the server combines it and
what is sent down. Each round:

1. the server sends each selected client the global model (or its quantised change), the round
   and its learning rate;
2. the client trains its local steps from there, uploads its update (quantised, with error
   feedback), and keeps its state (error residual, its copy of a compressed downlink) in Flower's
   client state and in its state folder, from which a restarted run recovers it;
3. the server screens, decodes and averages the uploads, applies the algorithm's server rule
   (FedSense: clustering and similarity distillation on its public source), logs the round to
   ``rounds.jsonl``, redraws ``rounds.png`` and checkpoints.

After the last round the global student's backbone is exported like a central run's, with the
federation recorded in its sidecar. Rerunning the same config resumes from the server's last
checkpoint, with the same clients selected, the same data and the same result.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import re
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from geofm import engine as ds
from geofm.checkpoints.io import DEEPSPEED_MODEL_STATES, load_training_file
from geofm.config import TeacherConfig, config_to_dict
from geofm.config.federated import FederatedConfig
from geofm.data.pile import PileSampler, PretrainPile
from geofm.data.sources import list_images
from geofm.errors import ConfigError, DatasetNotFoundError, GeoFMError
from geofm.federated.aggregation import ClientUpload, RoundAggregate
from geofm.federated.algorithms import build_algorithm
from geofm.federated.algorithms.base import Algorithm, ServerRound, payload_arrays
from geofm.federated.feedback import UplinkReport
from geofm.federated.flat import ParameterLayout
from geofm.federated.partition import ClientFile, partition_by_region, partition_by_source, partition_dirichlet
from geofm.federated.similarity import distill_similarity
from geofm.loop import TrainLoop
from geofm.models.backbones import patch_size_of
from geofm.models.masking import MaskGenerator
from geofm.models.mim import MaskedImageModel
from geofm.models.teacher import FrozenTeacher, build_teacher
from geofm.runlog import LOSS_KEYS, MetricsLog, plot_rounds
from geofm.training import InputPath, Progress, RunCheckpoints, check_inputs, check_resume
from pretrain.central import RESUME_INVARIANTS, build_student, export_student, mim_forward, prepare_models
from pretrain.federated.runtime import DATA_ROOT, INSTITUTION, Arrays, Failure, Reply, Scalars, program_config

log = logging.getLogger("geofm.federated")

ROUNDS_LOG = "rounds.jsonl"
TEACHER = "teacher"  # node config: this machine's copy of the teacher weights
STATE_DIR = "state-dir"  # node config: where this institution keeps its client state between runs
FEDERATED_INVARIANTS = (
    *RESUME_INVARIANTS,
    "federation.partition",
    "federation.clients",
    "federation.public_sources",
    "algorithm",
)
FEDERATED_SCHEDULE = (
    "federation.rounds",
    "train.base_lr",
    "train.lr_reference_batch",
    "train.lr_schedule",
    "train.warmup_rounds",
    "train.min_lr_ratio",
    "train.local_epochs",
    "train.local_steps",
)


def make_server(run_config: dict) -> FederatedServer:
    """The runtime's server factory."""
    return FederatedServer(FederatedConfig.from_tree(program_config(run_config), "the run's config"))


def make_client(run_config: dict, node_config: dict) -> FederatedClient:
    """The runtime's client factory."""
    return FederatedClient(FederatedConfig.from_tree(program_config(run_config), "the run's config"), node_config)


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


def _stable_id(*parts: object) -> int:
    """A seed from names and numbers that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _source_files(cfg: FederatedConfig) -> list[list[Path]]:
    return [list_images(s.root, s.pattern) for s in cfg.data.sources]


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
    try:
        if fed.partition == "by_source":
            index = [s.name for s in cfg.data.sources].index(name)
            files = [[] for _ in cfg.data.sources]
            files[index] = list_images(cfg.data.sources[index].root, cfg.data.sources[index].pattern)
            return files
        sources = _source_files(cfg)
    except DatasetNotFoundError as err:
        raise DatasetNotFoundError(f"client {name}: {err}") from None
    if fed.partition == "by_region":
        clients = partition_by_region(sources, fed.clients, seed=cfg.run.seed, public=public)
    elif fed.partition == "dirichlet":
        clients = partition_dirichlet(sources, fed.clients, fed.dirichlet_alpha, seed=cfg.run.seed, public=public)
    else:
        clients = partition_by_source(sources, fed.clients, public=public)
    return _per_source(clients[names.index(name)], len(sources))


def _per_source(files: list[ClientFile], count: int) -> list[list[Path]]:
    shares: list[list[Path]] = [[] for _ in range(count)]
    for item in files:
        shares[item.source].append(Path(item.path))
    return shares


def share_pile(cfg: FederatedConfig, shares: list[list[Path]], mask_fn) -> PretrainPile:
    """A pile over the sources that have files in ``shares``, with only those files."""
    keep = [i for i, files in enumerate(shares) if files]
    data = cfg.data.model_copy(update={"sources": [cfg.data.sources[i] for i in keep]})
    return PretrainPile(data, cfg.model.img_size, mask_fn=mask_fn, files=[shares[i] for i in keep])


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


@functools.cache
def _teacher(teacher_json: str, bands_json: str) -> FrozenTeacher:
    """The frozen teacher, built once per process (clients sharing a simulation worker share it)."""
    return build_teacher(TeacherConfig.model_validate(json.loads(teacher_json)), json.loads(bands_json))


def frozen_teacher(cfg: FederatedConfig) -> FrozenTeacher | None:
    """The run's frozen teacher (None for plain SimMIM), loaded from this machine's weights file."""
    if cfg.teacher is None:
        return None
    return _teacher(
        json.dumps(config_to_dict(cfg)["teacher"], sort_keys=True), json.dumps(cfg.data.teacher_band_indices)
    )


class FederatedClient:
    """One institution: trains on its own imagery only, uploads compressed updates.

    Args:
        cfg: the run's config.
        node_config: the node's config (``institution``, optionally ``data-root``, ``teacher``,
            ``state-dir``).
    """

    def __init__(self, cfg: FederatedConfig, node_config: dict) -> None:
        self.name = str(node_config[INSTITUTION])
        self.cfg = local_config(cfg, node_config)
        self.shares = client_shares(self.cfg, self.name)
        self.num_examples = sum(len(files) for files in self.shares)
        check_inputs(
            [InputPath("teacher.checkpoint", self.cfg.teacher.checkpoint)] if self.cfg.teacher else [],
            f"client {self.name}",
        )
        self.state_dir = Path(node_config.get(STATE_DIR) or self.cfg.run.output_dir / "clients" / self.name)
        # Each round's student is built fresh and overwritten by the global model: no initial weights to read.
        self.student_cfg = self.cfg.model_copy(
            update={"model": self.cfg.model.model_copy(update={"init_checkpoint": None})}
        )

    def identity(self) -> Scalars:
        return {"client": self.name, "num_examples": self.num_examples}

    def train(self, arrays: Arrays, config: Scalars, state: Arrays) -> tuple[Arrays, Scalars, Arrays]:
        """One round: receive the model, train the local steps, upload the update."""
        started = time.perf_counter()
        cfg, rnd, lr = self.cfg, int(config["round"]), float(config["lr"])
        model = build_student(self.student_cfg)
        algorithm = build_algorithm(cfg.algorithm, ParameterLayout.of(model))
        received, state = algorithm.receive(self.name, arrays, config, state or self._recover(rnd))
        algorithm.shared.assign(model, received["model"])
        algorithm.restore_local(model, state)
        teacher = frozen_teacher(cfg)
        dev, dtype = ds.device(), ds.compute_dtype(cfg.train)
        prepare_models(model, teacher, cfg, dev)
        engine = ds.initialize(model, cfg.train, 1, None, lr)
        local = algorithm.local_round(self.name, received, engine.module, state, lr)
        hooks = algorithm.local_hooks(local)

        loop = TrainLoop(
            engine,
            mim_forward(engine, teacher, dev, dtype),
            LOSS_KEYS,
            seed_of=lambda step: _stable_id(cfg.run.seed, self.name, rnd, step),
            around_gradient=hooks.around_gradient,
            regulariser=hooks.regulariser,
        )
        means, steps = loop.local_steps(self._batches(rnd))

        update = algorithm.finish_local(local, algorithm.shared.flatten_module(engine.module).cpu(), steps)
        algorithm.keep_local(engine.module, state)
        generator = torch.Generator().manual_seed(_stable_id(cfg.run.seed, self.name, rnd, "uplink"))
        upload, reports = algorithm.upload(update, state, generator)
        state["round"] = np.array([rnd], dtype=np.int64)
        self._persist(rnd, state)
        metrics = {
            "client": self.name,
            "num_examples": self.num_examples,
            "steps": steps,
            **means,
            **update.metadata,
            **uplink_metrics(reports),
            "seconds": time.perf_counter() - started,
        }
        return upload, metrics, state

    def _batches(self, rnd: int) -> Iterator[list[dict]]:
        """This round's local steps, each a list of micro-batches, in an order fixed by (seed, client, round)."""
        cfg = self.cfg
        patch = patch_size_of(cfg.model.arch, cfg.model.timm_kwargs)
        masks = MaskGenerator(cfg.model.img_size, cfg.masking.mask_patch_size, patch, cfg.masking.mask_ratio)
        pile = share_pile(cfg, self.shares, masks)
        micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
        images = micro * accum
        if cfg.train.local_steps is not None:
            steps = cfg.train.local_steps
        else:
            steps = max(1, int(cfg.train.local_epochs * self.num_examples) // images)
        seed = _stable_id(cfg.run.seed, self.name)
        per_epoch = max(images, pile.samples_per_epoch // images * images)
        sampler = PileSampler(pile.source_sizes, pile.weights, per_epoch, seed=seed)
        done, epoch = 0, 0
        while done < steps:
            sampler.set_epoch(rnd * 100_003 + epoch)
            loader = DataLoader(
                pile, batch_size=micro, sampler=sampler, num_workers=cfg.data.num_workers, drop_last=True
            )
            batches = iter(loader)
            for _ in range(per_epoch // images):
                if done == steps:
                    break
                yield [next(batches) for _ in range(accum)]
                done += 1
            epoch += 1

    def _persist(self, rnd: int, state: Arrays) -> None:
        """Keep the state on this institution's disk too; a restarted run (new Flower context) reads it back."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / f"state_round_{rnd:06d}.npz"
        partial = path.with_name(path.name + ".partial")  # not a state_round_*.npz until complete
        with partial.open("wb") as f:
            np.savez(f, **state)
        partial.replace(path)
        for _, old in self._saved()[:-2]:
            old.unlink()

    def _saved(self) -> list[tuple[int, Path]]:
        """The complete states on disk, oldest first, as (round, path); anything else there is ignored."""
        found = (re.fullmatch(r"state_round_(\d+)\.npz", p.name) for p in self.state_dir.glob("state_round_*"))
        return sorted((int(m.group(1)), self.state_dir / m.group(0)) for m in found if m)

    def _recover(self, rnd: int) -> Arrays:
        """The newest state saved before round ``rnd`` (empty: a first round, or none kept)."""
        earlier = [path for saved, path in self._saved() if saved < rnd]
        if not earlier:
            return {}
        with np.load(earlier[-1]) as data:
            return {key: data[key] for key in data.files}


class FederatedServer:
    """The server of a federated pretraining run: selection, aggregation, guidance, logs, checkpoints."""

    def __init__(self, cfg: FederatedConfig) -> None:
        self.cfg = cfg
        fed = cfg.federation
        self.min_clients = fed.min_clients
        self.fraction = fed.fraction
        self.round_timeout_s = fed.round_timeout_s
        self.expected_clients = cfg.num_clients
        self.connect_timeout_s = fed.connect_timeout_s
        self.round_retries = fed.round_retries
        self.run_dir = cfg.run.output_dir
        check_inputs(federated_inputs(cfg), "the run's config")
        self.checkpoints = RunCheckpoints(self.run_dir, cfg.run.keep_checkpoints, rank=0, unit="round")
        self.clients: dict[int, tuple[str, int]] = {}  # node id -> (institution, examples)
        self._round_started, self._round_downlink = time.perf_counter(), 0

        # The server decodes, averages and sketches model-sized CPU vectors every round: keeping
        # freed memory spares it faulting them in afresh (about a quarter of its per-client cost).
        ds.keep_freed_memory()
        torch.manual_seed(cfg.run.seed)
        self.model = build_student(cfg)
        self.algorithm: Algorithm = build_algorithm(
            cfg.algorithm, ParameterLayout.of(self.model), fed.declared_examples, cfg.num_clients
        )
        self.layout = self.algorithm.shared  # what travels; parameters local to the clients keep their start
        self.global_model = self.layout.flatten_module(self.model)
        self.distill_optimizer = torch.optim.AdamW(self.model.encoder.parameters(), lr=cfg.algorithm.distill_lr)
        self.done = self._resume()
        self.checkpoints.start(cfg)
        stop = fed.stop_after_rounds
        self.num_rounds = fed.rounds if stop is None else min(fed.rounds, self.done + stop)
        if self.done < self.num_rounds < fed.rounds:
            log.info(
                "this invocation runs rounds %d-%d of %d (federation.stop_after_rounds=%d counts from where it "
                "resumes); rerun to continue",
                self.done + 1,
                self.num_rounds,
                fed.rounds,
                stop,
            )
        self.rounds_log = MetricsLog(self.run_dir / ROUNDS_LOG, resume_step=self.done, key="round")

    # ---- plan --------------------------------------------------------------------------
    def start_round(self) -> int:
        return self.done + 1

    def register(self, node_id: int, identity: Scalars) -> None:
        self.clients[node_id] = (str(identity["client"]), int(identity["num_examples"]))

    def select(self, rnd: int, attempt: int, node_ids: list[int]) -> list[int]:
        """A seeded ``fraction`` of the institutions, by name, so that a restarted run selects the same ones."""
        by_name = sorted(node_ids, key=lambda node: self.clients[node][0])
        count = min(len(by_name), max(self.min_clients, math.ceil(self.fraction * len(by_name))))
        return random.Random(_stable_id(self.cfg.run.seed, rnd, attempt)).sample(by_name, count)

    # ---- rounds --------------------------------------------------------------------------
    def configure(self, rnd: int, node_ids: list[int]) -> dict[int, tuple[Arrays, Scalars]]:
        """The global model for each selected client, whole or as a quantised change to its copy."""
        self._round_started = time.perf_counter()
        lr = round_lr(self.cfg, rnd)
        generator = torch.Generator().manual_seed(_stable_id(self.cfg.run.seed, rnd, "downlink"))
        sent = self.algorithm.send(self.global_model, rnd, [self.clients[node][0] for node in node_ids], generator)
        payloads = {}
        for node in node_ids:
            arrays, how = sent[self.clients[node][0]]
            payloads[node] = (arrays, {"round": rnd, "lr": lr, **how})
        self._round_downlink = sum(a.nbytes for arrays, _ in payloads.values() for a in arrays.values())
        return payloads

    def aggregate(self, rnd: int, replies: list[Reply], failures: list[Failure]) -> None:
        """Screen and combine the uploads, apply the server rule, log the round and checkpoint it."""
        # In institution order, not arrival order: float sums and the clustering then give the same
        # global model whichever client answers first.
        replies = sorted(replies, key=lambda r: self.clients[r.node_id][0])
        uploads = [
            ClientUpload(self.clients[r.node_id][0], payload_arrays(r.arrays), self.clients[r.node_id][1], r.metrics)
            for r in replies
        ]
        payloads = self.algorithm.aggregate(uploads)
        aggregate = payloads[self.algorithm.uplink[0]]  # every payload's aggregate has the same clients
        for rejection in aggregate.rejected:
            log.warning("round %d: rejected the upload of %s: %s", rnd, rejection.client, rejection.reason)
        for client, (claimed, counted) in aggregate.bounded.items():
            log.warning("round %d: %s claims %d examples; weighted as %d", rnd, client, claimed, counted)
        server_metrics: dict[str, float] = {}
        discarded = None
        if aggregate.update is not None:
            outcome = self.algorithm.server_update(self.global_model, payloads, self._distil(rnd))
            discarded = non_finite_model(outcome, payloads)
            if discarded is None:
                self.global_model, server_metrics = outcome.model, outcome.metrics
                self.algorithm.commit(outcome, payloads)
            else:
                self.algorithm.discard()
                log.error("round %d: %s; the global model stays as it was", rnd, discarded)
        else:
            log.warning("round %d: no upload was accepted; the global model stays as it was", rnd)
        accepted = {a.client for a in aggregate.accepted} if discarded is None else set()
        self.algorithm.note_replies(rnd, [self.clients[r.node_id][0] for r in replies])
        # Keyed by the institution each node registered as, never by what a reply claims to be.
        metrics = {self.clients[r.node_id][0]: r.metrics for r in replies if self.clients[r.node_id][0] in accepted}
        weights = {a.client: w for a, w in zip(aggregate.accepted, aggregate.weights, strict=True)}
        record = {
            "round": rnd,
            "clients": sorted(accepted),
            **{
                key: sum(weights[c] * float(m.get(key, "nan")) for c, m in metrics.items()) if metrics else None
                for key in LOSS_KEYS
            },
            **server_metrics,
            "lr": round_lr(self.cfg, rnd),
            "uplink_bytes": sum(sum(a.nbytes for a in r.arrays.values()) for r in replies),
            "downlink_bytes": self._round_downlink,
            "seconds": round(time.perf_counter() - self._round_started, 3),
            "rejected": {r.client: r.reason for r in aggregate.rejected},
            "bounded_examples": {c: {"claimed": a, "counted": b} for c, (a, b) in aggregate.bounded.items()},
            **({"discarded": discarded} if discarded else {}),
            "failed": {str(self.clients.get(f.node_id, (f.node_id,))[0]): f.reason for f in failures},
            "feedback_resets": {c: m["feedback_reset"] for c, m in metrics.items() if m.get("feedback_reset")},
        }
        self.rounds_log.write(record)
        for client, kind in record["feedback_resets"].items():
            log.warning("round %d: %s reset its error-feedback buffer (%s)", rnd, client, kind)
        losses = (
            "no update applied" if not metrics else "loss {loss:.4f} (mim {loss_mim:.4f}, distill {loss_distill:.4f})"
        )
        log.info(
            "round %d/%d: %s, %d clients, up %.1f KiB, down %.1f KiB",
            rnd,
            self.cfg.federation.rounds,
            losses.format(**record),
            len(accepted),
            record["uplink_bytes"] / 1024,
            record["downlink_bytes"] / 1024,
        )
        self._checkpoint(rnd)
        plot_rounds(self.rounds_log.read(), self.run_dir / "rounds.png", self.run_dir.name)

    def finish(self) -> None:
        """Export the global backbone once the last round is done."""
        if self.num_rounds < self.cfg.federation.rounds:
            log.info("stopped after round %d of %d; rerun to resume", self.num_rounds, self.cfg.federation.rounds)
            return
        records = self.rounds_log.read()
        final = {"round": records[-1]["round"], **{key: records[-1][key] for key in LOSS_KEYS}} if records else None
        up, down = sum(r["uplink_bytes"] for r in records), sum(r["downlink_bytes"] for r in records)
        alg = self.cfg.algorithm
        federation = {
            "algorithm": alg.name,
            "clients": self.cfg.client_names,
            "partition": self.cfg.federation.partition,
            "rounds": self.cfg.federation.rounds,
            "uplink_bits": alg.uplink.bits,
            "error_feedback": alg.uplink.error_feedback,
            "downlink_bits": alg.downlink.bits,
            "uplink_bytes": up,
            "downlink_bytes": down,
            "public_sources": list(self.cfg.federation.public_sources),
        }
        self.layout.assign(self.model, self.global_model)
        export_student(self.cfg, self.model, self.run_dir, self.num_rounds, final, {"federation": federation})

    # ---- server guidance -------------------------------------------------------------------
    def _distil(self, rnd: int):
        """FedSense's refinement: similarity distillation of the new global model on the public source."""
        cfg = self.cfg
        if not cfg.algorithm.distill_steps:
            return None

        def refine(model: torch.Tensor, groups: list[torch.Tensor], weights: list[float]) -> tuple[torch.Tensor, float]:
            self.layout.assign(self.model, model)
            self.model.eval()
            params = [self.layout.unflatten(g) for g in groups]
            loss = distill_similarity(
                self.model,
                params,
                weights,
                self._public_batches(rnd),
                pooled_features,
                self.distill_optimizer,
                cfg.algorithm.distill_steps,
            )
            return self.layout.flatten_module(self.model), loss

        return refine

    def _public_batches(self, rnd: int) -> Iterator[torch.Tensor]:
        cfg = self.cfg
        shares = [
            list_images(s.root, s.pattern) if s.name in cfg.federation.public_sources else [] for s in cfg.data.sources
        ]
        pile = share_pile(cfg, shares, None)
        p = cfg.algorithm.distill_batch_size
        sampler = PileSampler(pile.source_sizes, pile.weights, max(p, pile.samples_per_epoch), seed=cfg.run.seed)
        epoch = 0
        while True:
            sampler.set_epoch(rnd * 100_003 + epoch)
            for batch in DataLoader(pile, batch_size=p, sampler=sampler, drop_last=True):
                yield batch["image"]
            epoch += 1

    # ---- checkpoints -------------------------------------------------------------------------
    def _checkpoint(self, rnd: int) -> None:
        self.layout.assign(self.model, self.global_model)
        tag = self.checkpoints.tag(rnd)
        folder = self.checkpoints.directory / tag
        folder.mkdir(parents=True, exist_ok=True)
        server = {
            "round": rnd,
            "distill_optimizer": self.distill_optimizer.state_dict(),
            "algorithm": self.algorithm.state_dict(),
        }
        torch.save({"module": self.model.state_dict(), "server": server}, folder / DEEPSPEED_MODEL_STATES)
        self.checkpoints.commit(tag, self._progress(rnd))

    def _progress(self, rnd: int) -> Progress:
        return Progress.of(rnd, self.cfg.federation.rounds, self.cfg.train, world_size=1)

    def _resume(self) -> int:
        """Load the last server checkpoint, if any; return the rounds it completed."""
        progress = self.checkpoints.progress()
        if progress is None:
            return 0
        check_resume(
            self.run_dir,
            self.checkpoints.saved_config(),
            config_to_dict(self.cfg),
            progress,
            invariants=FEDERATED_INVARIANTS,
            schedule_keys=FEDERATED_SCHEDULE,
            global_batch=self._progress(0).global_batch,
            world_size=1,
            zero_stage=0,
            extend=False,
        )
        saved = load_training_file(self.checkpoints.latest() / DEEPSPEED_MODEL_STATES, "cpu", {})
        self.model.load_state_dict(saved["module"])
        self.global_model = self.layout.flatten_module(self.model)
        server = saved["server"]
        self.distill_optimizer.load_state_dict(server["distill_optimizer"])
        # Checkpoints written before the algorithm kept its own state hold FedAvg's at the top level.
        self.algorithm.load_state_dict(server.get("algorithm", server))
        if not bool(torch.isfinite(self.global_model).all()):
            raise GeoFMError(
                f"{self.checkpoints.latest().resolve()} holds a global model with non-finite values; "
                "delete that checkpoint folder to resume from the one before it"
            )
        log.info("resumed from %s after round %d", self.checkpoints.latest().resolve(), progress.step)
        return progress.step


def uplink_metrics(reports: dict[str, UplinkReport]) -> dict[str, float | str]:
    """A client's log of its upload: the first payload's norms as ``update_norm`` and ``error_norm``,
    another's as ``<payload>.update_norm`` and ``<payload>.error_norm``, and the residuals it reset."""
    metrics: dict[str, float | str] = {}
    resets = []
    for index, (payload, report) in enumerate(reports.items()):
        prefix = f"{payload}." if index else ""
        metrics[f"{prefix}update_norm"], metrics[f"{prefix}error_norm"] = report.update_norm, report.error_norm
        kind = "guard" if report.guard_reset else "periodic" if report.periodic_reset else ""
        if kind:
            resets.append(f"{payload}: {kind}" if len(reports) > 1 else kind)
    return {**metrics, "feedback_reset": ", ".join(resets)}


def non_finite_model(outcome: ServerRound, payloads: dict[str, RoundAggregate]) -> str | None:
    """Why a round's outcome cannot be kept (its model or state holds NaN or Inf), naming the likely culprit;
    None if finite.

    Every accepted update is finite on its own, so the culprit is the largest one: its values,
    added to the model (or through the server's distillation), overflowed.
    """
    tensors = {"global model": outcome.model, **{f"algorithm's {k}": v for k, v in outcome.state.items()}}
    bad = {what: int((~torch.isfinite(t)).sum()) for what, t in tensors.items()}
    if not any(bad.values()):
        return None
    what = next(what for what, count in bad.items() if count)
    accepted = [a for aggregate in payloads.values() for a in aggregate.accepted]
    largest = max(accepted, key=lambda a: float(a.update.abs().max()))
    return (
        f"the new {what} holds {bad[what]} NaN or Inf values; the largest accepted update was "
        f"{largest.client}'s (max |value| {float(largest.update.abs().max()):.4g}, norm {largest.norm:.4g})"
    )


def pooled_features(model: MaskedImageModel, images: torch.Tensor) -> torch.Tensor:
    """Average-pooled final encoder features (p, d) of unmasked images: the similarity distillation's Z."""
    features = model.encoder.forward_features(images)
    return features.mean(dim=(1, 2)) if features.ndim == 4 else features[:, model.encoder.num_prefix_tokens :].mean(1)


def federated_inputs(cfg: FederatedConfig) -> list[InputPath]:
    """The paths the server itself reads: its public sources (clients check their own data)."""
    return [
        InputPath(f"data.sources.{i}.root ({s.name}, public)", s.root, s.pattern)
        for i, s in enumerate(cfg.data.sources)
        if s.name in cfg.federation.public_sources
    ]


__all__ = [
    "FederatedClient",
    "FederatedServer",
    "client_shares",
    "federated_inputs",
    "make_client",
    "make_server",
    "pooled_features",
    "round_lr",
]
