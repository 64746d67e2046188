"""A federated round's line of ``rounds.jsonl``: what the server combined, what it cost and what went wrong."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from federation.programs.base import OWN_VALIDATION
from federation.runtime.contract import Scalars
from geofm.fl.aggregation.uploads import RoundAggregate


@dataclass(kw_only=True)
class RoundRecord:
    """One round as the server logs it.

    Attributes:
        rnd: the round (1-based).
        log_keys: the task's losses, each the accepted clients' mean weighted as the aggregate weighs them.
        metrics: the reply metrics of each accepted client (none when the round's update was discarded).
        examples: each accepted client's training samples, as it registered them (its weight before the bounds).
        weights: each accepted client's weight in the aggregate.
        aggregate: the screening of the uploads (rejections, bounded example counts).
        server_metrics: what the algorithm's server rule logs.
        privacy: the privacy accountant's report (empty without privacy).
        validation: the global model's validation metrics (finetuning), or None.
        lr: the clients' learning rate of the round.
        local_optimizer: the clients' local optimiser, as recorded.
        uplink_bytes, downlink_bytes: what the round put on the wire each way.
        seconds: the round from the sending of the models to this record.
        server_seconds: the server's own work in it (sending, combining, its update rule, validation).
        discarded: why the round's new global model was not kept, if it was not.
        failed: the reason of each node that did not answer, by institution.
    """

    rnd: int
    log_keys: tuple[str, ...]
    metrics: dict[str, Scalars]
    examples: dict[str, int]
    weights: dict[str, float]
    aggregate: RoundAggregate
    server_metrics: dict[str, float]
    privacy: dict
    validation: dict | None
    lr: float
    local_optimizer: dict
    uplink_bytes: int
    downlink_bytes: int
    seconds: float
    server_seconds: float
    discarded: str | None
    failed: dict[str, str]

    @property
    def clients(self) -> list[str]:
        """The clients whose updates made the round's global model."""
        return sorted(self.metrics)

    def losses(self) -> dict[str, float | None]:
        """The task's losses, each the accepted clients' weighted sum (None when no update was applied)."""
        metrics = self.metrics
        return {
            key: sum(self.weights[c] * float(m.get(key, "nan")) for c, m in metrics.items()) if metrics else None
            for key in self.log_keys
        }

    def feedback_resets(self) -> dict[str, str]:
        """The clients that reset an error-feedback residual this round, with which."""
        return {c: m["feedback_reset"] for c, m in self.metrics.items() if m.get("feedback_reset")}

    def to_dict(self) -> dict:
        """The line of ``rounds.jsonl``."""
        aggregate = self.aggregate
        return {
            "round": self.rnd,
            "clients": self.clients,
            "examples": self.examples,
            **self.losses(),
            "client_losses": {key: per_client(self.metrics, key) for key in self.log_keys},
            **self.server_metrics,
            **self.privacy,
            **({"val": self.validation} if self.validation is not None else {}),
            "lr": self.lr,
            "local_optimizer": self.local_optimizer,
            "uplink_bytes": self.uplink_bytes,
            "downlink_bytes": self.downlink_bytes,
            "seconds": round(self.seconds, 3),
            "server_seconds": round(self.server_seconds, 3),
            "client_seconds_per_step": per_client(self.metrics, "seconds_per_step"),
            "client_peak_memory_bytes": per_client(self.metrics, "peak_memory_bytes"),
            "local_world_size": per_client(self.metrics, "local_world_size"),  # each client's training processes
            **own_validation(self.metrics),
            "rejected": {r.client: r.reason for r in aggregate.rejected},
            "bounded_examples": {c: {"claimed": a, "counted": b} for c, (a, b) in aggregate.bounded.items()},
            **({"discarded": self.discarded} if self.discarded else {}),
            "failed": self.failed,
            "feedback_resets": self.feedback_resets(),
        }


def per_client(metrics: dict[str, Scalars], key: str) -> dict[str, float]:
    """``key`` of each client's reply that reported it."""
    return {client: m[key] for client, m in metrics.items() if isinstance(m.get(key), int | float)}


def own_validation(metrics: dict[str, Scalars]) -> dict[str, dict]:
    """``clients_val``: per metric, each client's own model on its own validation data, their mean and
    spread (personalised algorithms; nothing otherwise)."""
    keys = sorted({k for m in metrics.values() for k in m if k.startswith(OWN_VALIDATION)})
    summary = {}
    for key in keys:
        values = per_client(metrics, key)
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


__all__ = ["RoundRecord", "own_validation", "per_client"]
