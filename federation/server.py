"""A federated program's server: selects clients, combines their uploads, guides, logs, checkpoints, exports."""

from __future__ import annotations

import json
import logging
import math
import random
import time

import numpy as np
import torch

from federation.program import OWN_VALIDATION, build_task, round_lr, stable_id
from federation.runtime import Arrays, Failure, Reply, Scalars
from geofm.checkpoints.io import DEEPSPEED_MODEL_STATES, load_training_file
from geofm.config import config_to_dict
from geofm.config.algorithm import MOVED_TO_OPTIONS, AlgorithmConfig
from geofm.config.federated import FederatedConfig
from geofm.errors import GeoFMError
from geofm.federated.aggregation.uploads import ClientUpload, RoundAggregate
from geofm.federated.algorithms import ALGORITHMS, build_algorithm, local_optimizer
from geofm.federated.algorithms.base import Algorithm
from geofm.federated.algorithms.context import ServerContext
from geofm.federated.algorithms.fedsense import DISTILL_OPTIMIZER
from geofm.federated.algorithms.rounds import ServerRound, payload_arrays
from geofm.federated.communication.spill import SPILL_FOLDER, UPLOADS_FOLDER, UploadStore, clear_spill
from geofm.federated.parameter_vectors import (
    RUNNING_STATISTICS,
    ParameterLayout,
    load_running_statistics,
    running_statistics,
)
from geofm.federated.privacy.client_level import PrivacyAccountant, check_statistics
from geofm.memory import keep_freed_memory
from geofm.paths import check_writable
from geofm.rundir import Progress, RunCheckpoints, check_inputs, check_resume
from geofm.runlog import MetricsLog, plot_metric_curve, plot_rounds

log = logging.getLogger("geofm.federated")

ROUNDS_LOG = "rounds.jsonl"
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


def comparable_algorithm(tree: dict | None) -> dict | None:
    """``tree`` with its algorithm's options as the algorithm reads them (defaults left out), so that a
    resumed run compares settings, not how they were written; a config saved before each algorithm
    kept its settings in ``options`` has them moved there (the algorithm's own; the others' dropped)."""
    if tree is None or not isinstance(tree.get("algorithm"), dict):
        return tree
    algorithm = dict(tree["algorithm"])
    moved = {key: algorithm.pop(key) for key in MOVED_TO_OPTIONS if key in algorithm}
    options = dict(algorithm.get("options") or {})
    rule = ALGORITHMS.get(algorithm.get("name", AlgorithmConfig.model_fields["name"].default))
    if rule.Options is not None:
        own = {key: value for key, value in moved.items() if key in rule.Options.model_fields}
        options = rule.Options.model_validate({**own, **options}).model_dump(exclude_defaults=True)
    return {**tree, "algorithm": {**algorithm, "options": options}}


def saved_config(tree: dict | None) -> dict | None:
    """A checkpoint's saved config, with the ``task`` of runs written before configs named one (they all pretrained)."""
    if tree is None or "task" in tree:
        return tree
    return {**tree, "task": FederatedConfig.model_fields["task"].default}


class FederatedServer:
    """The server of a federated run: selection, aggregation, guidance, logs, checkpoints."""

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
        self.checkpoints = RunCheckpoints(self.run_dir, cfg.run.keep_checkpoints, rank=0, unit="round")
        self.clients: dict[int, tuple[str, int]] = {}  # node id -> (institution, examples)
        self._round_started, self._round_downlink, self._server_seconds = time.perf_counter(), 0, 0.0

        # The server decodes, averages and sketches model-sized CPU vectors every round: keeping
        # freed memory spares it faulting them in afresh (about a quarter of its per-client cost).
        keep_freed_memory()
        torch.manual_seed(cfg.run.seed)
        self.task = build_task(cfg)
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
        if self.done < self.num_rounds:
            log.info("server ready; round %d starts once the %d clients are ready", self.done + 1, cfg.num_clients)

    # ---- plan --------------------------------------------------------------------------
    def start_round(self) -> int:
        return self.done + 1

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
        statistics = {self.clients[r.node_id][0]: r.arrays.get(RUNNING_STATISTICS) for r in replies}
        uploads = [
            ClientUpload(
                self.clients[r.node_id][0],
                payload_arrays(r.arrays, skip=(RUNNING_STATISTICS,)),
                self.clients[r.node_id][1],
                r.metrics,
            )
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
            outcome = self.algorithm.server_update(self.global_model, payloads)
            discarded = non_finite_model(outcome, payloads)
            if discarded is None:
                self.global_model, server_metrics = outcome.model, outcome.metrics
                self.algorithm.commit(outcome, payloads)
            else:
                self.algorithm.discard()
                log.error("round %d: %s; the global model stays as it was", rnd, discarded)
        else:
            log.warning("round %d: no upload was accepted; the global model stays as it was", rnd)
        if self.accountant is not None:  # every upload was released (local), the round's mean too (central)
            self.accountant.step([u.client for u in uploads])
        accepted = {a.client for a in aggregate.accepted} if discarded is None else set()
        self.algorithm.note_replies(rnd, [self.clients[r.node_id][0] for r in replies])
        # Keyed by the institution each node registered as, never by what a reply claims to be.
        metrics = {self.clients[r.node_id][0]: r.metrics for r in replies if self.clients[r.node_id][0] in accepted}
        weights = {a.client: w for a, w in zip(aggregate.accepted, aggregate.weights, strict=True)}
        self.layout.assign(self.model, self.algorithm.evaluated_model(self.global_model))
        local = self.algorithm.server_local()
        if local is not None:
            self.algorithm.local.assign(self.model, local)
        self._average_statistics(statistics, weights if discarded is None else {})
        validation = self.task.evaluate_round(self.model, rnd)  # finetuning: the global model's val metrics
        record = {
            "round": rnd,
            "clients": sorted(accepted),
            **{
                key: sum(weights[c] * float(m.get(key, "nan")) for c, m in metrics.items()) if metrics else None
                for key in self.task.log_keys
            },
            **server_metrics,
            **(self.accountant.report() if self.accountant is not None else {}),
            **({"val": validation} if validation is not None else {}),
            "lr": round_lr(self.cfg, rnd),
            "local_optimizer": self.local_optimizer,
            "uplink_bytes": sum(sum(a.nbytes for a in r.arrays.values()) for r in replies),
            "downlink_bytes": self._round_downlink,
            "seconds": round(time.perf_counter() - self._round_started, 3),
            # the server's own work (sending, combining, its update rule, validation): not waiting, checkpoints, plots
            "server_seconds": round(self._server_seconds + time.perf_counter() - aggregating, 3),
            "client_seconds_per_step": _per_client(metrics, "seconds_per_step"),
            "client_peak_memory_bytes": _per_client(metrics, "peak_memory_bytes"),
            "local_world_size": _per_client(metrics, "local_world_size"),  # each client's training processes
            **_own_validation(metrics),
            "rejected": {r.client: r.reason for r in aggregate.rejected},
            "bounded_examples": {c: {"claimed": a, "counted": b} for c, (a, b) in aggregate.bounded.items()},
            **({"discarded": discarded} if discarded else {}),
            "failed": {str(self.clients.get(f.node_id, (f.node_id,))[0]): f.reason for f in failures},
            "feedback_resets": {c: m["feedback_reset"] for c, m in metrics.items() if m.get("feedback_reset")},
        }
        self.rounds_log.write(record)
        for client, kind in record["feedback_resets"].items():
            log.warning("round %d: %s reset its error-feedback buffer (%s)", rnd, client, kind)
        losses = ", ".join(f"{k} {record[k]:.4f}" for k in self.task.log_keys) if metrics else "no update applied"
        log.info(
            "round %d/%d: %s, %d clients, up %.1f KiB, down %.1f KiB",
            rnd,
            self.cfg.federation.rounds,
            losses,
            len(accepted),
            record["uplink_bytes"] / 1024,
            record["downlink_bytes"] / 1024,
        )
        self._checkpoint(rnd)
        records = self.rounds_log.read()
        plot_rounds(records, self.run_dir / "rounds.png", self.run_dir.name)
        if validation:  # the first metric is the task's own
            title = f"{self.run_dir.name}: global model"
            plot_metric_curve(records, "val", [next(iter(validation))], self.run_dir / "val_curve.png", title, "round")
        self.uploads.clear()

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

    def _resume(self) -> int:
        """Load the last server checkpoint, if any; return the rounds it completed."""
        progress = self.checkpoints.progress()
        if progress is None:
            return 0
        check_resume(
            self.run_dir,
            comparable_algorithm(saved_config(self.checkpoints.saved_config())),
            comparable_algorithm(config_to_dict(self.cfg)),
            progress,
            invariants=(*self.task.resume_invariants, *FEDERATED_INVARIANTS),
            schedule_keys=FEDERATED_SCHEDULE,
            global_batch=self._progress(0).global_batch,
            world_size=1,
            zero_stage=0,
            extend=False,
        )
        rounds_log = self.run_dir / ROUNDS_LOG
        lines = rounds_log.read_text().splitlines() if rounds_log.exists() else []
        last_round = json.loads(lines[-1]) if lines else None
        local_optimizer.check_resumed(last_round, self.local_optimizer, self.cfg.algorithm.name, str(rounds_log))
        saved = load_training_file(self.checkpoints.latest() / DEEPSPEED_MODEL_STATES, "cpu", {})
        self.model.load_state_dict(saved["module"])
        self.global_model = self.layout.flatten_module(self.model)
        self.statistics = running_statistics(self.model)
        server = saved["server"]
        self.algorithm.load_state_dict(_algorithm_state(server))
        if self.accountant is not None:  # the algorithm section, privacy included, is kept on resume
            self.accountant.load_state_dict(server["privacy"])
        if not bool(torch.isfinite(self.global_model).all()):
            raise GeoFMError(
                f"{self.checkpoints.latest().resolve()} holds a global model with non-finite values; "
                "delete that checkpoint folder to resume from the one before it"
            )
        log.info("resumed from %s after round %d", self.checkpoints.latest().resolve(), progress.step)
        return progress.step


def _algorithm_state(server: dict) -> dict:
    """The algorithm's state in a server checkpoint. Checkpoints written before the algorithm kept its own
    state hold FedAvg's at the top level; those written before FedSense kept its distillation optimiser
    hold that beside the algorithm's state (every run's, empty where nothing was distilled)."""
    state = dict(server.get("algorithm", server))
    if DISTILL_OPTIMIZER in server:
        state[DISTILL_OPTIMIZER] = server[DISTILL_OPTIMIZER]
    return state


def _per_client(metrics: dict[str, Scalars], key: str) -> dict[str, float]:
    """``key`` of each client's reply that reported it."""
    return {client: m[key] for client, m in metrics.items() if isinstance(m.get(key), int | float)}


def _own_validation(metrics: dict[str, Scalars]) -> dict[str, dict]:
    """``clients_val``: per metric, each client's own model on its own validation data, their mean and
    spread (personalised algorithms; nothing otherwise)."""
    keys = sorted({k for m in metrics.values() for k in m if k.startswith(OWN_VALIDATION)})
    summary = {}
    for key in keys:
        values = _per_client(metrics, key)
        if values:
            v = np.asarray(list(values.values()), dtype=np.float64)
            summary[key.removeprefix(OWN_VALIDATION)] = {
                "mean": float(v.mean()),
                "std": float(v.std()),
                "min": float(v.min()),
                "max": float(v.max()),
                "clients": values,
            }
    return {"clients_val": summary} if summary else {}


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


__all__ = ["FederatedServer", "comparable_algorithm", "non_finite_model", "saved_config"]
