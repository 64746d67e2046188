"""The arms of ``geofm bench fed-benefit`` compared over paired seeds (:func:`compare`), and FedSense's claims
checked against them (:func:`claims`)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks import pretrain_benefit as benefit


def paired_gain(values: list[float], reference: list[float]) -> tuple[float, float]:
    """Mean and standard deviation of the per-seed gains ``values - reference`` (seeds in the same order)."""
    gains = [v - r for v, r in zip(values, reference, strict=True)]
    return statistics.fmean(gains), statistics.stdev(gains) if len(gains) > 1 else 0.0


def compare(scores: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per arm: mean, std, per seed, and paired gains over random and over the best institution alone."""
    best_alone = max(
        (a for a in scores if a.startswith("alone:")), key=lambda a: statistics.fmean(scores[a]), default=None
    )
    table = {}
    for arm, values in scores.items():
        row: dict[str, Any] = {**benefit.mean_std(values), "per_seed": values}
        for name, reference in (("random", "random"), ("best_alone", best_alone)):
            if reference in scores and reference != arm:
                row[f"gain_over_{name}"], row[f"gain_over_{name}_std"] = paired_gain(values, scores[reference])
        table[arm] = row
    if best_alone is not None:
        table[best_alone]["best_alone"] = True
    return table


def claims(table: dict[str, dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """FedSense's claims at this scale, each (claim, held beyond the spread or None where an arm is missing, figures).

    "Beyond the spread": the paired gain's mean exceeds the standard deviation of the paired gains.
    """

    def paired(a: str, b: str) -> tuple[float, float] | None:
        if a not in table or b not in table:
            return None
        return paired_gain(table[a]["per_seed"], table[b]["per_seed"])

    found = []
    central = table.get("central")
    if "fedsense" in table and central is not None:
        gap = (central["mean"] - table["fedsense"]["mean"]) / central["mean"]
        side = "below" if gap > 0 else "above"
        found.append(("FedSense within 2% (relative) of central", gap <= 0.02, f"{abs(gap):.1%} {side} central"))
    best = next((a for a, row in table.items() if row.get("best_alone")), None)
    for arm, other, claim in (
        ("fedsense", best, "FedSense above the best institution alone"),
        ("fedsense", "fedavg", "FedSense above FedAvg fp32"),
        ("fedsense", "fedsense_no_scg", "server-to-client guidance helps"),
        ("fedsense", "fedsense_no_csg", "client-to-server guidance helps"),
        ("fedsense", "fedsense_no_distill", "the similarity distillation helps"),
        ("fedsense", "fedavg_1bit", "error feedback and guidance beat plain 1-bit FedAvg"),
    ):
        result = paired(arm, other) if other else None
        if result is None:
            found.append((claim, None, "arm not run"))
        else:
            mean, std = result
            found.append((claim, mean > std, f"paired gain {mean:+.3f} +- {std:.3f} over {other}"))
    return found
