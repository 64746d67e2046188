"""The claims of ``geofm bench fed-benefit``, tested on pretraining seeds (:func:`claims`).

The unit is the pretraining seed: each arm's score per pretraining seed is its mean test mIoU over
the same finetuning draws. Two arms are paired by pretraining seed (the seeds both ran); an arm without
pretraining (``random``, ``released``) has one score, which every seed of the other arm is paired with.

* "as good as": two one-sided paired t-tests (TOST) of the differences against ``-margin`` and
  ``+margin``, the margin a share (``margin``) of the reference's mean declared in the settings.
* "above": a one-sided paired t-test of the differences against 0.

Both report the mean difference (``estimate``), the ``1 - 2 alpha`` confidence interval of it (the
interval that matches a one-sided test at ``alpha``: TOST holds when it lies inside the margins, "above"
when it lies above 0), ``p`` and ``holds`` (None where fewer than 2 seeds pair up).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from scipy import stats

from benchmarks.fed_benefit_dino import BASELINES as DINO_BASELINES

CENTRAL_ARMS = ("central", "central:federated")
FEDERATED = ("fedavg", "fedsense")
ABLATIONS = ("fedavg", "fedavg_1bit", "fedsense_no_scg", "fedsense_no_csg", "fedsense_no_distill")


def paired_gain(values: list[float], reference: list[float]) -> tuple[float, float]:
    """Mean and standard deviation of the per-seed gains ``values - reference`` (seeds in the same order)."""
    gains = [v - r for v, r in zip(values, reference, strict=True)]
    return statistics.fmean(gains), statistics.stdev(gains) if len(gains) > 1 else 0.0


def differences(arm: dict[str, Any], reference: dict[str, Any]) -> list[float]:
    """``arm``'s score minus ``reference``'s, per pretraining seed both ran (an unpretrained reference: its one score)."""
    if not reference["pretrain_seeds"]:
        return [v - reference["per_pretrain_seed"][0] for v in arm["per_pretrain_seed"]]
    theirs = dict(zip(reference["pretrain_seeds"], reference["per_pretrain_seed"], strict=True))
    return [v - theirs[s] for s, v in zip(arm["pretrain_seeds"], arm["per_pretrain_seed"], strict=True) if s in theirs]


def _t(diffs: list[float], alpha: float) -> tuple[float, float, int, list[float]]:
    """Mean, standard error, degrees of freedom and ``1 - 2 alpha`` interval of the differences."""
    mean, df = statistics.fmean(diffs), len(diffs) - 1
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    half = stats.t.ppf(1 - alpha, df) * se
    return mean, se, df, [mean - half, mean + half]


def _p_above(mean: float, bound: float, se: float, df: int) -> float:
    """One-sided p of "the mean difference is above ``bound``"."""
    if se == 0:
        return 0.0 if mean > bound else 1.0
    return float(stats.t.sf((mean - bound) / se, df))


def tost(diffs: list[float], margin: float, alpha: float = 0.05) -> dict[str, Any]:
    """Two one-sided tests that the mean difference lies within ``(-margin, margin)``."""
    if len(diffs) < 2:
        return _untested("paired TOST", diffs, margin)
    mean, se, df, ci = _t(diffs, alpha)
    p = max(_p_above(mean, -margin, se, df), _p_above(-mean, -margin, se, df))
    return {
        "test": "paired TOST",
        "n": len(diffs),
        "estimate": mean,
        "margin": margin,
        "ci": ci,
        "p": p,
        "holds": p < alpha,
    }


def above(diffs: list[float], alpha: float = 0.05) -> dict[str, Any]:
    """One-sided paired t-test that the mean difference is above 0."""
    if len(diffs) < 2:
        return _untested("paired t-test, one-sided", diffs, None)
    mean, se, df, ci = _t(diffs, alpha)
    p = _p_above(mean, 0.0, se, df)
    return {
        "test": "paired t-test, one-sided",
        "n": len(diffs),
        "estimate": mean,
        "margin": None,
        "ci": ci,
        "p": p,
        "holds": p < alpha,
    }


def _untested(test: str, diffs: list[float], margin: float | None) -> dict[str, Any]:
    estimate = statistics.fmean(diffs) if diffs else None
    return {"test": test, "n": len(diffs), "estimate": estimate, "margin": margin, "ci": None, "p": None, "holds": None}


def claims(arms: dict[str, dict[str, Any]], margin: float, alpha: float) -> list[dict[str, Any]]:
    """Every claim whose arms ran, in the order the doc discusses them.

    Equivalence: FedAvg and FedSense to each central arm, the continual ones to central continual
    (margin: ``margin`` of the reference's mean). Superiority: every arm with pretraining seeds over random; FedAvg
    and FedSense (continual or not) over each institution alone; each continual arm over the released
    model and over its arm from scratch; FedSense over FedAvg, FedAvg 1-bit and its ablations. On DINO
    (FedSense's Table 1): FedSense as good as central; each baseline over SSL-FL (``dino:fedavg``), and
    FedSense over SSL-FL and each baseline.
    """
    alone = [a for a in arms if a.startswith("alone:")]
    pairs: list[tuple[str, str, str]] = []  # (kind, arm, reference)
    for central in CENTRAL_ARMS:
        pairs += [("equivalent", fed, central) for fed in FEDERATED]
    pairs += [("equivalent", f"{fed}_continual", "central_continual") for fed in FEDERATED]
    pairs += [("above", arm, "random") for arm, row in arms.items() if row["pretrain_seeds"]]
    for fed in FEDERATED:
        pairs += [("above", name, a) for name in (fed, f"{fed}_continual") for a in alone]
    for arm in ("central", *FEDERATED):
        pairs += [("above", f"{arm}_continual", "released"), ("above", f"{arm}_continual", arm)]
    pairs += [("above", "fedsense", other) for other in ABLATIONS]
    pairs += [("equivalent", "dino:fedsense", "dino:central")]
    pairs += [("above", baseline, "dino:fedavg") for baseline in DINO_BASELINES]
    pairs += [("above", "dino:fedsense", other) for other in ("dino:fedavg", *DINO_BASELINES)]
    found = []
    for kind, arm, reference in pairs:
        if arm not in arms or reference not in arms:
            continue
        diffs = differences(arms[arm], arms[reference])
        if kind == "equivalent":
            share = margin * arms[reference]["mean"]
            found.append({"claim": f"{arm} as good as {reference} (within {margin:.0%})", **tost(diffs, share, alpha)})
        else:
            found.append({"claim": f"{arm} above {reference}", **above(diffs, alpha)})
    return found
