"""Run outputs a person and a machine read: JSON-lines metrics, a progress bar, loss curves."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from geofm.errors import GeoFMError

LOSS_KEYS = ("loss", "loss_mim", "loss_distill")
METRICS_LOG = "metrics.jsonl"
"""A run's step records, in its run folder."""
ROUNDS_LOG = "rounds.jsonl"
"""A federated run's log in its run folder: one record per round, written by the server of every federated program."""


class MetricsLog:
    """Appends one JSON object per logged step (or round: ``key``) to a JSON-lines file.

    On resume, records beyond the resumed step (written after the last checkpoint by a run that
    was then killed) are dropped, so the file reads as one uninterrupted run.
    """

    def __init__(self, path: Path, resume_step: int = 0, key: str = "step") -> None:
        self.path = path
        if path.exists():
            kept = [record for record in self.read() if record[key] <= resume_step]
            path.write_text("".join(json.dumps(record) + "\n" for record in kept))

    def write(self, record: dict) -> None:
        """Append one record as strict JSON: a NaN or infinite number is written as null."""
        with self.path.open("a") as f:
            f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")

    def read(self) -> list[dict]:
        """The records so far; a last line cut short (a run killed while writing it) is left out.

        Raises:
            GeoFMError: a line before the last is not a JSON record (naming the file and line).
        """
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                if number < len(lines) and line:
                    raise GeoFMError(f"{self.path}, line {number}: not a JSON record ({err})") from None
        return records


def strict_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, so that it is valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def figure(width: float, height: float):
    """A matplotlib figure drawn off screen, without pyplot: imported only when a plot is drawn
    (half a second of start-up otherwise) and never registered with a GUI backend."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=120)


def loss_lines(records: list[dict], keys: Sequence[str]) -> list[tuple[str, str]]:
    """The ``(key, label)`` of each loss worth a line: logged and not zero throughout. A component equal
    to the total in every record (a run without distillation) is named in the total's label rather
    than drawn under it."""
    drawn = [key for key in keys if any(r.get(key) not in (None, 0) for r in records)]
    same = [key for key in drawn[1:] if all(r.get(key) == r.get(drawn[0]) for r in records)]
    lines = [(key, key) for key in drawn if key not in same]
    if lines and same:
        lines[0] = (drawn[0], f"{drawn[0]} (= {', '.join(same)})")
    return lines


def plot_loss_curve(records: list[dict], path: Path, title: str = "") -> None:
    """Loss components and learning rate against step, as a PNG (records without ``lr`` are skipped)."""
    records = [r for r in records if "lr" in r]
    if not records:
        return
    steps = [r["step"] for r in records]
    fig = figure(7, 4)
    ax = fig.subplots()
    for key, label in loss_lines(records, LOSS_KEYS):
        ax.plot(steps, [r.get(key) for r in records], label=label, linewidth=1.4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r["lr"] for r in records], color="grey", linestyle=":", label="lr")
    lr_ax.set_ylabel("learning rate", color="grey")
    lines = ax.get_legend_handles_labels()[0] + lr_ax.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def plot_rounds(records: list[dict], path: Path, title: str = "") -> None:
    """A federated run's rounds as a PNG: losses with the learning rate, and bytes on the wire per round.

    Bytes use a log axis, so that a compressed uplink's saving against the downlink shows. Rounds
    where a client failed or an upload was rejected are marked, as are rounds whose update was
    discarded (no accepted upload, or a non-finite result).
    """
    if not records:
        return
    from matplotlib.ticker import MaxNLocator

    rounds = [r["round"] for r in records]
    fig = figure(11, 4)
    loss_ax, bytes_ax = fig.subplots(1, 2)
    lines = loss_lines(records, (*LOSS_KEYS, "loss_similarity"))
    for key, label in lines:
        values = [r.get(key) for r in records]
        loss_ax.plot(rounds, [math.nan if v is None else v for v in values], label=label, linewidth=1.4, marker=".")
    troubled = [r["round"] for r in records if r.get("failed") or r.get("rejected")]
    discarded = [r["round"] for r in records if r.get("discarded") or not r.get("clients", [None])]
    for marked, label, style in (
        (troubled, "a client failed or was rejected", {"color": "tab:orange", "alpha": 0.25}),
        (discarded, "no update applied", {"color": "tab:red", "alpha": 0.4}),
    ):
        for number, rnd in enumerate(marked):
            loss_ax.axvspan(rnd - 0.4, rnd + 0.4, label=label if not number else None, linewidth=0, **style)
    loss_ax.set_xlabel("round")
    server = " and the server's distillation" if any(key == "loss_similarity" for key, _ in lines) else ""
    loss_ax.set_ylabel(f"loss (clients' mean{server})")
    loss_ax.grid(alpha=0.3)
    if any("lr" in r for r in records):
        lr_ax = loss_ax.twinx()
        lr_ax.plot(rounds, [r.get("lr", math.nan) for r in records], color="grey", linestyle=":", label="lr")
        lr_ax.set_ylabel("learning rate", color="grey")
        handles = loss_ax.get_legend_handles_labels()[0] + lr_ax.get_legend_handles_labels()[0]
    else:
        handles = loss_ax.get_legend_handles_labels()[0]
    loss_ax.legend(handles, [h.get_label() for h in handles], fontsize=8)
    uplink, downlink = ([r.get(key) or math.nan for r in records] for key in ("uplink_bytes", "downlink_bytes"))
    if uplink == downlink:  # an uncompressed uplink: one line, not one hidden under the other
        bytes_ax.plot(rounds, uplink, label="uplink = downlink", linewidth=1.4, marker=".")
    else:
        bytes_ax.plot(rounds, uplink, label="uplink", linewidth=1.4, marker=".")
        bytes_ax.plot(rounds, downlink, label="downlink", linewidth=1.4, marker="x", linestyle="--")
    bytes_ax.set_yscale("log")
    bytes_ax.set_xlabel("round")
    bytes_ax.set_ylabel("bytes on the wire per round (all clients)")
    bytes_ax.grid(alpha=0.3, which="both")
    bytes_ax.legend(fontsize=8)
    for ax in (loss_ax, bytes_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def plot_metric_curve(
    records: list[dict],
    section: str,
    keys: list[str],
    path: Path,
    title: str = "",
    x: str = "step",
    kept: int | None = None,
) -> None:
    """Metrics logged under ``record[section]`` (e.g. the validation metrics) against ``x`` (step or
    round), as a PNG; ``kept``: the ``x`` of the kept (best) weights, marked."""
    records = [r for r in records if section in r]
    if not records:
        return
    from matplotlib.ticker import MaxNLocator

    steps = [r[x] for r in records]
    fig = figure(7, 4)
    ax = fig.subplots()
    for key in keys:
        ax.plot(steps, [r[section].get(key) for r in records], marker="o", markersize=3, linewidth=1.4, label=key)
    if kept is not None:
        ax.axvline(kept, color="grey", linestyle="--", linewidth=1, label=f"kept weights ({x} {kept})")
    ax.set_xlabel("optimizer step" if x == "step" else x)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{section} {', '.join(keys)}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


class Throughput:
    """Images per second over the interval since the last :meth:`rate` call."""

    def __init__(self) -> None:
        self._since = time.perf_counter()
        self._images = 0

    def add(self, images: int) -> None:
        self._images += images

    def rate(self) -> float:
        value = self._images / max(time.perf_counter() - self._since, 1e-9)
        self.restart()
        return value

    def restart(self) -> None:
        """Start a new interval (e.g. after time spent writing a checkpoint)."""
        self._since, self._images = time.perf_counter(), 0


class Phases:
    """Seconds spent in the named phases of a start-up, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Close ``phase``: the time since the previous lap (or the start) is its time."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        self._mark = now

    def describe(self) -> str:
        """``total s: phase s, phase s, ...`` for a log line."""
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.seconds.items())
        return f"{sum(self.seconds.values()):.1f} s ({parts})"


def progress_bar(total: int, initial: int, enabled: bool, desc: str, unit: str = "step") -> tqdm:
    """A progress bar with ETA, counting ``unit``; plain lines instead of redraws when stderr is no terminal."""
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        desc=desc,
        unit=unit,
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 10.0,
        file=sys.stderr,
    )


def final_metrics(records: list[dict]) -> dict | None:
    """The losses of a run's last epoch: means of the ``metrics.jsonl`` records logged in it.

    One logged interval is noisy; a model card reports the mean over the records whose ``epoch``
    lies within one epoch of the last record's, and says which steps that covers.
    """
    if not records:
        return None
    last = records[-1]
    window = [r for r in records if "epoch" in r and r["epoch"] > last["epoch"] - 1] if "epoch" in last else [last]
    means = {k: sum(r[k] for r in window) / len(window) for k in LOSS_KEYS if all(k in r for r in window)}
    first_step = records[len(records) - len(window) - 1]["step"] + 1 if len(window) < len(records) else 1
    return {
        **{k: round(v, 6) for k, v in means.items()},
        "averaged_over": f"steps {first_step}-{last['step']} (the last epoch, {len(window)} logged intervals)",
        "step": last["step"],
        "epoch": last.get("epoch"),
    }


def is_finite(record: dict) -> bool:
    """Whether every loss the record holds is a finite number (a null loss, written for NaN, is not)."""
    return all(record[k] is not None and math.isfinite(record[k]) for k in LOSS_KEYS if k in record)
