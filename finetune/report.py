"""Average relative performance (ARP) of a model against a baseline over downstream tasks (``geofm report``).

As defined in GFM (Mendieta et al., ICCV 2023): over the N tasks both were evaluated on,

    ARP(M) = 100 / N * sum_i (score(M, task_i) - score(baseline, task_i)) / score(baseline, task_i)

where a task's score is its own metric (``primary_metric`` of the evaluation records, e.g. accuracy,
micro mAP, mIoU, change F1, PSNR). Records are matched by task, dataset and train fraction
(BigEarthNet at 10% and at 1% are two tasks); records of one side without a partner are listed, not
counted. The report is ``report.md`` (a table per task and the overall ARP), ``arp.json`` and a bar
chart ``arp.png`` of the relative differences.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from geofm.errors import ConfigError
from geofm.runlog import figure

REQUIRED_KEYS = ("task", "dataset", "train_fraction", "primary_metric", "score")


@dataclass(frozen=True)
class TaskComparison:
    """One task's score for the model and the baseline."""

    task: str
    dataset: str
    train_fraction: float
    metric: str
    score: float
    baseline: float

    @property
    def name(self) -> str:
        """``dataset`` with its train fraction when below 1, e.g. ``BigEarthNet 10%``."""
        fraction = "" if self.train_fraction >= 1 else f" {self.train_fraction * 100:g}%"
        return f"{self.dataset}{fraction}"

    @property
    def relative(self) -> float:
        """(score - baseline) / baseline."""
        return (self.score - self.baseline) / self.baseline


def read_eval(path: str | Path) -> dict[str, Any]:
    """An evaluation record (``eval.json``).

    Raises:
        ConfigError: if the file is missing, not JSON, or lacks the keys a comparison needs.
    """
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"evaluation record {path.resolve()} cannot be read: {err.strerror}") from None
    except ValueError as err:
        raise ConfigError(f"{path}: not JSON ({err})") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(record, dict) or k not in record]
    if missing:
        raise ConfigError(f"{path}: not an evaluation record of geofm finetune/eval: missing {missing}")
    return {**record, "path": str(path)}


def _by_task(records: Sequence[dict[str, Any]], side: str) -> dict[tuple, dict[str, Any]]:
    keyed: dict[tuple, dict[str, Any]] = {}
    for record in records:
        key = (record["task"], record["dataset"], float(record["train_fraction"]))
        if key in keyed:
            raise ConfigError(
                f"{side}: {keyed[key]['path']} and {record['path']} both evaluate {key[0]} on {key[1]} "
                f"(train fraction {key[2]}); give one record per task"
            )
        keyed[key] = record
    return keyed


def compare(
    models: Sequence[dict[str, Any]], baselines: Sequence[dict[str, Any]]
) -> tuple[list[TaskComparison], list[str]]:
    """Pair the model's and the baseline's records by task, dataset and train fraction.

    Returns:
        The comparisons, and a note for each record without a partner.

    Raises:
        ConfigError: no task in common, a task scored by different metrics, a baseline score of 0,
            or two records of one side for the same task.
    """
    mine, theirs = _by_task(models, "model"), _by_task(baselines, "baseline")
    rows = []
    for key in sorted(mine.keys() & theirs.keys()):
        m, b = mine[key], theirs[key]
        if m["primary_metric"] != b["primary_metric"]:
            raise ConfigError(
                f"{m['path']} scores {key[0]} on {key[1]} by {m['primary_metric']}, {b['path']} by {b['primary_metric']}"
            )
        if not b["score"]:
            raise ConfigError(f"{b['path']}: baseline score 0 on {key[1]}: the relative difference is undefined")
        rows.append(TaskComparison(key[0], key[1], key[2], m["primary_metric"], float(m["score"]), float(b["score"])))
    if not rows:
        raise ConfigError(
            f"the model's records ({sorted(mine)}) and the baseline's ({sorted(theirs)}) share no task, dataset "
            "and train fraction"
        )
    unmatched = [f"model only: {mine[k]['path']}" for k in sorted(mine.keys() - theirs.keys())]
    unmatched += [f"baseline only: {theirs[k]['path']}" for k in sorted(theirs.keys() - mine.keys())]
    return rows, unmatched


def average_relative_performance(rows: Sequence[TaskComparison]) -> float:
    """ARP in percent: 100 times the mean relative difference over the tasks."""
    return 100.0 * sum(r.relative for r in rows) / len(rows)


def write_report(
    rows: Sequence[TaskComparison],
    out_dir: str | Path,
    *,
    model: str = "model",
    baseline: str = "baseline",
    unmatched: Sequence[str] = (),
) -> dict[str, Path]:
    """Write ``report.md``, ``arp.json`` and ``arp.png`` into ``out_dir``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arp = average_relative_performance(rows)
    lines = [
        f"# ARP of {model} against {baseline}",
        "",
        f"| task | dataset | metric | {model} | {baseline} | relative (%) |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r.task} | {r.name} | {r.metric} | {r.score:.4f} | {r.baseline:.4f} | {100 * r.relative:+.2f} |"
        for r in rows
    ]
    lines += ["", f"**ARP over {len(rows)} tasks: {arp:+.2f}%**", ""]
    lines += [f"- not compared, {note}" for note in unmatched]
    paths = {"markdown": out_dir / "report.md", "json": out_dir / "arp.json", "chart": out_dir / "arp.png"}
    paths["markdown"].write_text("\n".join(lines).rstrip() + "\n")
    summary = {
        "model": model,
        "baseline": baseline,
        "arp": arp,
        "tasks": [{**asdict(r), "relative_percent": 100 * r.relative} for r in rows],
        "unmatched": list(unmatched),
    }
    paths["json"].write_text(json.dumps(summary, indent=2) + "\n")
    _chart(rows, arp, paths["chart"], f"{model} vs {baseline}")
    return paths


def _chart(rows: Sequence[TaskComparison], arp: float, path: Path, title: str) -> None:
    labels = [f"{r.name} ({r.metric})" for r in rows] + ["ARP"]
    values = [100 * r.relative for r in rows] + [arp]
    colours = ["tab:green" if v >= 0 else "tab:red" for v in values[:-1]] + ["black"]
    fig = figure(7, 0.45 * len(labels) + 1.2)
    ax = fig.subplots()
    ax.barh(labels[::-1], values[::-1], color=colours[::-1])
    ax.axvline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("relative to baseline (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
