"""Federated runs side by side: the metric per algorithm per scenario and what each run cost.

A run directory of ``geofm fed simulate`` (or a cell of ``geofm fed sweep``) holds ``config.yaml``,
``rounds.jsonl`` and, for finetuning, ``eval.json``. Its *score* is the test metric of ``eval.json``
when there is one, else the last round's validation metric, else the last round's loss (federated
pretraining); every test and validation metric geofm logs is better higher (accuracy, mAP, F1,
IoU, PSNR, SSIM), a loss lower. Its costs are the ones the federated-learning literature compares, here as measured:
bytes per round each way, the server's own seconds per round, client seconds per local step (and
relative to FedAvg's in the same scenario and uplink) and the clients' peak memory.

:func:`compare_runs` reads them; :func:`write_comparison` writes ``comparison.md`` (a table of
scores, scenarios as columns, and a table of costs), ``comparison.json`` and ``comparison.png``
(grouped bars: the score of each algorithm in each scenario, one panel per uplink).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from geofm.errors import ConfigError
from geofm.runlog import ROUNDS_LOG, figure

SWEEP_LABELS = "sweep_cell.json"  # written by a sweep into each cell: its algorithm, scenario and uplink labels


@dataclass(frozen=True)
class RunSummary:
    """One federated run's score and costs (None where the run did not log a figure)."""

    run: str
    algorithm: str
    scenario: str
    uplink: str
    rounds: int
    metric: str
    score: float | None
    higher_is_better: bool
    uplink_bytes_per_round: float
    downlink_bytes_per_round: float
    server_seconds_per_round: float | None
    client_seconds_per_step: float | None
    client_peak_memory_mib: float | None
    step_cost_vs_fedavg: float | None = None


def _mean(values: Iterable[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(finite) if finite else None


def _score(run: Path, records: list[dict]) -> tuple[str, float | None, bool]:
    """(metric, value, higher is better) of a run: test metric, else last validation metric, else last loss."""
    evaluation = run / "eval.json"
    if evaluation.is_file():
        record = json.loads(evaluation.read_text())
        metric = record["primary_metric"]
        return f"test {metric}", float(record["score"]), True
    for record in reversed(records):
        if isinstance(record.get("val"), dict) and record["val"]:
            metric, value = next(iter(record["val"].items()))
            return f"val {metric}", float(value), True
    losses = [r["loss"] for r in records if isinstance(r.get("loss"), int | float)]
    return "loss", (float(losses[-1]) if losses else None), False


def _labels(run: Path, config: dict) -> tuple[str, str, str]:
    """The run's (algorithm, scenario, uplink) labels: a sweep's own, else read from its config."""
    labels = run / SWEEP_LABELS
    if labels.is_file():
        saved = json.loads(labels.read_text())
        return saved["algorithm"], saved["scenario"], saved["uplink"]
    algorithm = config.get("algorithm", {})
    uplink = algorithm.get("uplink", {})
    bits = uplink.get("bits", 32)
    ef = "_ef" if uplink.get("error_feedback") and bits != 32 else ""
    return (
        algorithm.get("name", "fedsense"),
        config.get("federation", {}).get("partition", "by_source"),
        f"{bits}bit{ef}",
    )


def summarise_run(run: str | Path) -> RunSummary:
    """The score and costs of one federated run directory.

    Raises:
        ConfigError: the folder holds no ``rounds.jsonl`` or ``config.yaml`` (not a federated run).
    """
    run = Path(run)
    log, config_file = run / ROUNDS_LOG, run / "config.yaml"
    if not log.is_file() or not config_file.is_file():
        raise ConfigError(f"{run}: not a federated run directory (expected {ROUNDS_LOG} and config.yaml)")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    config = yaml.safe_load(config_file.read_text()) or {}
    algorithm, scenario, uplink = _labels(run, config)
    metric, score, higher = _score(run, records)
    step_seconds = [v for r in records for v in r.get("client_seconds_per_step", {}).values()]
    memory = [v for r in records for v in r.get("client_peak_memory_bytes", {}).values()]
    return RunSummary(
        run=str(run),
        algorithm=algorithm,
        scenario=scenario,
        uplink=uplink,
        rounds=len(records),
        metric=metric,
        score=score,
        higher_is_better=higher,
        uplink_bytes_per_round=_mean(r["uplink_bytes"] for r in records) or 0.0,
        downlink_bytes_per_round=_mean(r["downlink_bytes"] for r in records) or 0.0,
        server_seconds_per_round=_mean(r.get("server_seconds") for r in records),
        client_seconds_per_step=_mean(step_seconds),
        client_peak_memory_mib=max(memory) / 2**20 if memory else None,
    )


def runs_below(paths: Sequence[str | Path]) -> list[Path]:
    """The federated run directories among ``paths`` and below them (a sweep's output folder), sorted."""
    found: set[Path] = set()
    for path in map(Path, paths):
        if not path.is_dir():
            raise ConfigError(f"{path}: no such folder (expected a federated run directory or a sweep's output)")
        found.update(log.parent for log in path.rglob(ROUNDS_LOG))
    if not found:
        raise ConfigError(f"no federated run ({ROUNDS_LOG}) in or below {', '.join(map(str, paths))}")
    return sorted(found)


def compare_runs(paths: Sequence[str | Path]) -> list[RunSummary]:
    """Summaries of every run in or below ``paths``, each with its step cost relative to FedAvg's run
    of the same scenario and uplink (when there is one)."""
    summaries = [summarise_run(run) for run in runs_below(paths)]
    fedavg = {(s.scenario, s.uplink): s.client_seconds_per_step for s in summaries if s.algorithm == "fedavg"}
    out = []
    for s in summaries:
        base = fedavg.get((s.scenario, s.uplink))
        ratio = s.client_seconds_per_step / base if base and s.client_seconds_per_step is not None else None
        out.append(RunSummary(**{**asdict(s), "step_cost_vs_fedavg": ratio}))
    return out


def _cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _best(runs: Sequence[RunSummary]) -> RunSummary | None:
    """The run with the best score (higher or lower, as its metric says), None without a score."""
    scored = [r for r in runs if r.score is not None]
    if not scored:
        return None
    return max(scored, key=lambda r: r.score if r.higher_is_better else -r.score)


def comparison_markdown(summaries: Sequence[RunSummary]) -> str:
    """Two Markdown tables: scores (algorithms x scenarios, one block per uplink, the best of each scenario in
    bold) and costs (one row per run)."""
    scenarios = sorted({s.scenario for s in summaries})
    lines = ["# Federated comparison", ""]
    for uplink in sorted({s.uplink for s in summaries}):
        rows = [s for s in summaries if s.uplink == uplink]
        metrics = sorted({s.metric for s in rows})
        lines += [f"## Scores, uplink {uplink} ({', '.join(metrics)})", ""]
        lines += ["| algorithm | " + " | ".join(scenarios) + " |", "| --- |" + " --- |" * len(scenarios)]
        best = {c: _best([s for s in rows if s.scenario == c]) for c in scenarios}
        for algorithm in sorted({s.algorithm for s in rows}):
            by_scenario = {s.scenario: s for s in rows if s.algorithm == algorithm}
            cells = []
            for c in scenarios:
                run = by_scenario.get(c)
                text = "" if run is None else _cell(run.score, ".4f")
                cells.append(f"**{text}**" if run is not None and run is best[c] else text)
            lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Costs per run",
        "",
        "| algorithm | scenario | uplink | rounds | up KiB/round | down KiB/round | server s/round "
        "| client s/step | vs FedAvg | client peak MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in sorted(summaries, key=lambda s: (s.scenario, s.uplink, s.algorithm)):
        lines.append(
            f"| {s.algorithm} | {s.scenario} | {s.uplink} | {s.rounds} | {s.uplink_bytes_per_round / 1024:.1f} "
            f"| {s.downlink_bytes_per_round / 1024:.1f} | {_cell(s.server_seconds_per_round, '.3f')} "
            f"| {_cell(s.client_seconds_per_step, '.4f')} | {_cell(s.step_cost_vs_fedavg, '.2f')} "
            f"| {_cell(s.client_peak_memory_mib, '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def plot_comparison(summaries: Sequence[RunSummary], path: Path) -> None:
    """Grouped bars of each algorithm's score per scenario, one panel per uplink."""
    uplinks = sorted({s.uplink for s in summaries})
    scenarios = sorted({s.scenario for s in summaries})
    algorithms = sorted({s.algorithm for s in summaries})
    fig = figure(max(5.0, 1.2 * len(scenarios) * len(uplinks) + 2), 3.6)
    width = 0.8 / max(len(algorithms), 1)
    for index, uplink in enumerate(uplinks):
        ax = fig.add_subplot(1, len(uplinks), index + 1)
        for a, algorithm in enumerate(algorithms):
            scores = {s.scenario: s.score for s in summaries if s.uplink == uplink and s.algorithm == algorithm}
            xs = [i + (a - (len(algorithms) - 1) / 2) * width for i in range(len(scenarios))]
            ax.bar(xs, [scores.get(c) or 0.0 for c in scenarios], width, label=algorithm)
        ax.set_xticks(range(len(scenarios)), scenarios)
        ax.set_title(f"uplink {uplink}")
        ax.set_ylabel(" / ".join(sorted({s.metric for s in summaries if s.uplink == uplink})))
    fig.axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)


def write_comparison(paths: Sequence[str | Path], out: str | Path) -> Path:
    """Compare the runs in or below ``paths``; write ``comparison.md``, ``.json`` and ``.png`` into ``out``."""
    summaries = compare_runs(paths)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(comparison_markdown(summaries))
    (out / "comparison.json").write_text(json.dumps([asdict(s) for s in summaries], indent=2) + "\n")
    plot_comparison(summaries, out / "comparison.png")
    return out / "comparison.md"


__all__ = ["RunSummary", "compare_runs", "comparison_markdown", "runs_below", "summarise_run", "write_comparison"]
