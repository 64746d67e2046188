"""A federated program's server: selects clients, combines their uploads, guides, logs, checkpoints, exports."""

from __future__ import annotations

import logging
import math
import random
import time

import numpy as np
import torch

from federation.programs.base import ProgramServer
from federation.programs.resume import note_file_weights
from federation.programs.roundrecord import RoundRecord
from federation.runtime.contract import Arrays, Failure, Reply, Scalars
from geofm.checkpoints.io import DEEPSPEED_MODEL_STATES, load_training_file
from geofm.config.federated import FederatedConfig
from geofm.errors import GeoFMError
from geofm.fl.aggregation.uploads import ClientUpload, RoundAggregate
from geofm.fl.algorithms import build_algorithm, local_optimizer
from geofm.fl.algorithms.base import Algorithm
from geofm.fl.algorithms.context import ServerContext
from geofm.fl.algorithms.rounds import ServerRound, payload_arrays
from geofm.fl.client_round import stable_id
from geofm.fl.communication.spill import SPILL_FOLDER, UPLOADS_FOLDER, UploadStore, clear_spill
from geofm.fl.parameter_vectors import (
    RUNNING_STATISTICS,
    ParameterLayout,
    load_running_statistics,
    running_statistics,
)
from geofm.fl.privacy.client_level import PrivacyAccountant, check_statistics
from geofm.memory import keep_freed_memory
from geofm.paths import check_writable
from geofm.runlog import ROUNDS_LOG, plot_metric_curve, plot_rounds
from geofm.tasks import federated_task
from geofm.tasks.mim.figures import RECONSTRUCTION_FIGURE
from geofm.training import engine as ds
from geofm.training.rundir import Progress, RunCheckpoints, check_inputs, check_resume

log = logging.getLogger("geofm.fl")

FEDERATED_INVARIANTS = (
    "task",
    "federation.partition",
    "federation.clients",
    "federation.public_sources",
    "algorithm",
)
"""Keys a resumed run keeps, besides its task's own (``resume_invariants``)."""
FEDERATED_SCHEDULE = (
    "federation.rounds",
    "train.base_lr",
    "train.optimizer",
    "train.lr_reference_batch",
    "train.lr_schedule",
    "train.warmup_rounds",
    "train.min_lr_ratio",
    "train.local_epochs",
    "train.local_steps",
)


def round_lr(cfg: FederatedConfig, rnd: int) -> float:
    """The clients' learning rate in round ``rnd`` (1-based): warm-up, then constant or cosine to ``min_lr_ratio``,
    from the peak scaled to a client's global batch (``federation.local_processes`` processes), with the
    base rate of the run's local optimiser (:func:`geofm.fl.algorithms.local_optimizer.resolve`)."""
    train, rounds = cfg.train, cfg.federation.rounds
    base_lr = local_optimizer.resolve(train, cfg.algorithm.name).base_lr
    peak = base_lr * ds.global_batch(train, cfg.federation.local_processes) / train.lr_reference_batch
    if rnd <= train.warmup_rounds:
        return peak * rnd / (train.warmup_rounds + 1)
    if train.lr_schedule == "constant":
        return peak
    progress = (rnd - 1 - train.warmup_rounds) / max(rounds - 1 - train.warmup_rounds, 1)
    return peak * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class FederatedServer(ProgramServer):
    """The server of a federated run: selection, aggregation, guidance, logs, checkpoints."""

    cfg: FederatedConfig

    def __init__(self, cfg: FederatedConfig) -> None:
        super().__init__(cfg)
        fed = cfg.federation
        self.checkpoints = RunCheckpoints(self.run_dir, cfg.run.keep_checkpoints, rank=0, unit="round")
        self.clients: dict[int, tuple[str, int]] = {}  # node id -> (institution, examples)
        self._round_started, self._round_downlink, self._server_seconds = time.perf_counter(), 0, 0.0

        # The server decodes, averages and sketches model-sized CPU vectors every round: keeping
        # freed memory spares it faulting them in afresh (about a quarter of its per-client cost).
        keep_freed_memory()
        torch.manual_seed(cfg.run.seed)
        self.task = federated_task(cfg)
        check_writable(self.run_dir, "run.output_dir", folder=True)
        clear_spill(self.run_dir)  # a killed round's spilled updates: that round is redone from the checkpoint
        self.uploads = UploadStore(self.run_dir / SPILL_FOLDER / UPLOADS_FOLDER)  # the transport fills it
        check_inputs(self.task.server_inputs(), "the run's config")
        self.model = self.task.build_model()
        self.algorithm: Algorithm = build_algorithm(
            cfg.algorithm, ParameterLayout.of(self.model), fed.declared_examples, cfg.num_clients, fed.rounds
        )
        self.algorithm.spill_to(self.run_dir / SPILL_FOLDER)
        local_optimizer.warn_override(cfg.train, cfg.algorithm.name)
        self.local_optimizer = local_optimizer.record(local_optimizer.resolve(cfg.train, cfg.algorithm.name))
        log.info("clients' local optimiser: %s", self.local_optimizer)
        # What travels; the parameters local to the clients hold the algorithm's server_local, else their start.
        self.layout = self.algorithm.shared
        self.global_model = self.layout.flatten_module(self.model)
        self.statistics = running_statistics(self.model)  # batch-norm buffers, averaged beside the payloads
        privacy = cfg.algorithm.privacy
        check_statistics(privacy, self.statistics)
        n = cfg.num_clients
        self.accountant = PrivacyAccountant(privacy, self.selected_count(n) / n) if privacy else None
        # What clients that keep their own statistics and local parameters start from (FedBN): the
        # freshly built model's, the same on every invocation of the run.
        self.start_statistics = self.statistics
        self.algorithm.start_local(self.algorithm.local.flatten_module(self.model))
        self.algorithm.attach(ServerContext(self.model, self.layout, self.task.public_images()))
        self.resume()
        self.checkpoints.start(cfg)
        self.open_rounds_log()
        if self.done < self.num_rounds:
            log.info("server ready; round %d starts once the %d clients are ready", self.done + 1, cfg.num_clients)

    # ---- plan --------------------------------------------------------------------------
    def register(self, node_id: int, identity: Scalars) -> None:
        self.clients[node_id] = (str(identity["client"]), int(identity["num_examples"]))

    def select(self, rnd: int, attempt: int, node_ids: list[int]) -> list[int]:
        """A seeded ``fraction`` of the institutions, by name, so that a restarted run selects the same ones."""
        by_name = sorted(node_ids, key=lambda node: self.clients[node][0])
        return random.Random(stable_id(self.cfg.run.seed, rnd, attempt)).sample(
            by_name, self.selected_count(len(by_name))
        )

    def selected_count(self, available: int) -> int:
        """How many of ``available`` institutions a round selects: ``fraction`` of them, at least ``min_clients``."""
        return min(available, max(self.min_clients, math.ceil(self.fraction * available)))

    # ---- rounds --------------------------------------------------------------------------
    def configure(self, rnd: int, node_ids: list[int]) -> dict[int, tuple[Arrays, Scalars]]:
        """The global model for each selected client, whole or as a quantised change to its copy."""
        self._round_started = time.perf_counter()
        lr = round_lr(self.cfg, rnd)
        self.algorithm.begin_round(rnd)
        generator = torch.Generator().manual_seed(stable_id(self.cfg.run.seed, rnd, "downlink"))
        sent = self.algorithm.send(self.global_model, rnd, [self.clients[node][0] for node in node_ids], generator)
        payloads = {}
        for node in node_ids:
            arrays, how = sent[self.clients[node][0]]
            statistics = self.start_statistics if self.algorithm.keeps_local_statistics else self.statistics
            if statistics is not None:
                arrays = {**arrays, RUNNING_STATISTICS: statistics}
            payloads[node] = (arrays, {"round": rnd, "lr": lr, **how})
        self._round_downlink = sum(a.nbytes for arrays, _ in payloads.values() for a in arrays.values())
        self._server_seconds = time.perf_counter() - self._round_started
        return payloads

    def aggregate(self, rnd: int, replies: list[Reply], failures: list[Failure]) -> None:
        """Screen and combine the uploads, apply the server rule, log the round and checkpoint it."""
        aggregating = time.perf_counter()
        # In institution order, not arrival order: float sums and the clustering then give the same
        # global model whichever client answers first.
        replies = sorted(replies, key=lambda r: self.clients[r.node_id][0])
        uploads = [self._upload(r) for r in replies]
        payloads = self.algorithm.aggregate(uploads)
        aggregate = payloads[self.algorithm.uplink[0]]  # every payload's aggregate has the same clients
        self._warn_screened(rnd, aggregate)
        server_metrics, discarded = self._apply(rnd, payloads, aggregate)
        if self.accountant is not None:  # every upload was released (local), the round's mean too (central)
            self.accountant.step([u.client for u in uploads])
        self.algorithm.note_replies(rnd, [u.client for u in uploads])
        accepted = {a.client for a in aggregate.accepted} if discarded is None else set()
        # Keyed by the institution each node registered as, never by what a reply claims to be.
        metrics = {u.client: u.metadata for u in uploads if u.client in accepted}
        weights = {a.client: w for a, w in zip(aggregate.accepted, aggregate.weights, strict=True)}
        statistics = {self.clients[r.node_id][0]: r.arrays.get(RUNNING_STATISTICS) for r in replies}
        validation = self._evaluate(rnd, statistics, weights if discarded is None else {})
        record = RoundRecord(
            rnd=rnd,
            log_keys=self.task.log_keys,
            metrics=metrics,
            examples={u.client: u.num_examples for u in uploads if u.client in metrics},
            weights=weights,
            aggregate=aggregate,
            server_metrics=server_metrics,
            privacy=self.accountant.report() if self.accountant is not None else {},
            validation=validation,
            lr=round_lr(self.cfg, rnd),
            local_optimizer=self.local_optimizer,
            uplink_bytes=sum(sum(a.nbytes for a in r.arrays.values()) for r in replies),
            downlink_bytes=self._round_downlink,
            seconds=time.perf_counter() - self._round_started,
            server_seconds=self._server_seconds + time.perf_counter() - aggregating,
            discarded=discarded,
            failed={str(self.clients.get(f.node_id, (f.node_id,))[0]): f.reason for f in failures},
        )
        self.write_round(record.to_dict())
        self._report(record)
        self._checkpoint(rnd)
        self._plot(validation)
        self.uploads.clear()

    def _upload(self, reply: Reply) -> ClientUpload:
        """A reply as the algorithm screens it: its payloads (the batch-norm statistics apart), the examples
        its node registered with, its metrics."""
        name, examples = self.clients[reply.node_id]
        return ClientUpload(name, payload_arrays(reply.arrays, skip=(RUNNING_STATISTICS,)), examples, reply.metrics)

    def _warn_screened(self, rnd: int, aggregate: RoundAggregate) -> None:
        """Warn of each rejected upload and each client weighted by fewer examples than it claims."""
        for rejection in aggregate.rejected:
            log.warning("round %d: rejected the upload of %s: %s", rnd, rejection.client, rejection.reason)
        for client, (claimed, counted) in aggregate.bounded.items():
            log.warning("round %d: %s claims %d examples; weighted as %d", rnd, client, claimed, counted)

    def _apply(
        self, rnd: int, payloads: dict[str, RoundAggregate], aggregate: RoundAggregate
    ) -> tuple[dict[str, float], str | None]:
        """The server rule on the accepted uploads, kept when its result is finite; returns what it logs and
        why its result was discarded (None: kept, or nothing accepted)."""
        if aggregate.update is None:
            log.warning("round %d: no upload was accepted; the global model stays as it was", rnd)
            return {}, None
        outcome = self.algorithm.server_update(self.global_model, payloads)
        discarded = non_finite_model(outcome, payloads)
        if discarded is not None:
            self.algorithm.discard()
            log.error("round %d: %s; the global model stays as it was", rnd, discarded)
            return {}, discarded
        self.global_model = outcome.model
        self.algorithm.commit(outcome, payloads)
        return outcome.metrics, None

    def _evaluate(
        self, rnd: int, statistics: dict[str, np.ndarray | None], weights: dict[str, float]
    ) -> dict[str, float] | None:
        """The model the server evaluates (the global one, its local parameters, the clients' averaged
        batch-norm statistics) into ``self.model``, and the task's validation of it (finetuning)."""
        self.layout.assign(self.model, self.algorithm.evaluated_model(self.global_model))
        local = self.algorithm.server_local()
        if local is not None:
            self.algorithm.local.assign(self.model, local)
        self._average_statistics(statistics, weights)
        return self.task.evaluate_round(self.model, rnd)

    def _report(self, record: RoundRecord) -> None:
        """Log the round: resets of error feedback, then its losses, clients and traffic."""
        rnd = record.rnd
        for client, kind in record.feedback_resets().items():
            log.warning("round %d: %s reset its error-feedback buffer (%s)", rnd, client, kind)
        losses = record.losses()
        described = (
            ", ".join(f"{k} {losses[k]:.4f}" for k in record.log_keys) if record.metrics else "no update applied"
        )
        log.info(
            "round %d/%d: %s, %d clients, up %.1f KiB, down %.1f KiB",
            rnd,
            self.cfg.federation.rounds,
            described,
            len(record.metrics),
            record.uplink_bytes / 1024,
            record.downlink_bytes / 1024,
        )

    def _plot(self, validation: dict[str, float] | None) -> None:
        """Redraw ``rounds.png`` and, with validation, the global model's ``val_curve.png``."""
        records = self.rounds_log.read()
        plot_rounds(records, self.run_dir / "rounds.png", self.run_dir.name)
        if validation:  # the first metric is the task's own
            title = f"{self.run_dir.name}: global model"
            plot_metric_curve(records, "val", [next(iter(validation))], self.run_dir / "val_curve.png", title, "round")

    def finish(self) -> None:
        """Export the global backbone once the last round is done."""
        if self.num_rounds < self.cfg.federation.rounds:
            log.info("stopped after round %d of %d; rerun to resume", self.num_rounds, self.cfg.federation.rounds)
            return
        records = self.rounds_log.read()
        final = (
            {"round": records[-1]["round"], **{key: records[-1][key] for key in self.task.log_keys}}
            if records
            else None
        )
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
        self.layout.assign(self.model, self.algorithm.evaluated_model(self.global_model))
        self.task.export(self.model, self.run_dir, self.num_rounds, final, {"federation": federation})
        self.rounds_log.figure(self.run_dir / RECONSTRUCTION_FIGURE, self.num_rounds)
        self.rounds_log.artifacts(self.task.products(self.run_dir))

    def _average_statistics(self, statistics: dict[str, np.ndarray | None], weights: dict[str, float]) -> None:
        """The accepted clients' batch-norm statistics, averaged by their weights, into the global model;
        a client's that are missing, misshapen or not finite are left out (its upload was accepted)."""
        if self.statistics is None:
            return
        usable = {
            client: statistics[client]
            for client in weights
            if isinstance(statistics.get(client), np.ndarray)
            and statistics[client].shape == self.statistics.shape
            and np.isfinite(statistics[client]).all()
        }
        if not usable:
            return
        total = sum(weights[c] for c in usable)
        self.statistics = sum(weights[c] / total * usable[c].astype(np.float64) for c in usable).astype(np.float32)
        load_running_statistics(self.model, self.statistics)

    # ---- checkpoints -------------------------------------------------------------------------
    def _checkpoint(self, rnd: int) -> None:
        self.layout.assign(self.model, self.global_model)
        tag = self.checkpoints.tag(rnd)
        folder = self.checkpoints.directory / tag
        folder.mkdir(parents=True, exist_ok=True)
        server = {
            "round": rnd,
            "algorithm": self.algorithm.state_dict(),
            **({"privacy": self.accountant.state_dict()} if self.accountant is not None else {}),
        }
        torch.save({"module": self.model.state_dict(), "server": server}, folder / DEEPSPEED_MODEL_STATES)
        self.checkpoints.commit(tag, self._progress(rnd))

    def _progress(self, rnd: int) -> Progress:
        return Progress.of(rnd, self.cfg.federation.rounds, self.cfg.train, world_size=1)

    def rounds_done(self) -> int:
        progress = self.checkpoints.progress()
        return 0 if progress is None else progress.step

    def resume_invariants(self) -> tuple[str, ...]:
        return (*self.task.resume_invariants, *FEDERATED_INVARIANTS)

    def restore(self, saved: dict | None, current: dict, done: int) -> None:
        """Check the schedule and the rounds' weighting, then load the last server checkpoint."""
        check_resume(
            self.run_dir,
            saved,
            current,
            self.checkpoints.progress(),
            invariants=(),
            schedule_keys=FEDERATED_SCHEDULE,
            global_batch=self._progress(0).global_batch,
            world_size=1,
            zero_stage=0,
            extend=False,
        )
        last_round, rounds_log = self.last_round(), str(self.run_dir / ROUNDS_LOG)
        local_optimizer.check_resumed(last_round, self.local_optimizer, self.cfg.algorithm.name, rounds_log)
        note_file_weights(last_round, getattr(self.task, "kind", None), rounds_log)
        checkpoint = load_training_file(self.checkpoints.latest() / DEEPSPEED_MODEL_STATES, "cpu", {})
        self.model.load_state_dict(checkpoint["module"])
        self.global_model = self.layout.flatten_module(self.model)
        self.statistics = running_statistics(self.model)
        server = checkpoint["server"]
        self.algorithm.load_checkpoint(server)
        if self.accountant is not None:  # the algorithm section, privacy included, is kept on resume
            self.accountant.load_state_dict(server["privacy"])
        if not bool(torch.isfinite(self.global_model).all()):
            raise GeoFMError(
                f"{self.checkpoints.latest().resolve()} holds a global model with non-finite values; "
                "delete that checkpoint folder to resume from the one before it"
            )
        log.info("resumed from %s after round %d", self.checkpoints.latest().resolve(), done)


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


__all__ = ["FEDERATED_INVARIANTS", "FEDERATED_SCHEDULE", "FederatedServer", "non_finite_model", "round_lr"]
