"""A comparison as one command: one federated run per algorithm x scenario (x uplink) (``geofm fed sweep``).

A sweep file names a federated ``config`` (the base of every cell) and the settings it varies::

    config: bigearthnet_s2_multilabel__fedavg__k7_ds1.yaml   # relative to this file
    output_dir: runs/sweep_bigearthnet_k7
    algorithms:                  # label: its ``algorithm`` settings (``name`` defaults to the label)
      fedavg: {}
      fedprox: {options: {proximal_beta: 0.01}}
    scenarios:                   # label: its ``federation`` settings, merged over the base's
      ds1: {partition: bigearthnet_ds1}
      ds2: {partition: bigearthnet_ds2}
    uplinks:                     # optional; label: its ``algorithm.uplink`` settings
      32bit: {bits: 32}
      1bit_ef: {bits: 1, error_feedback: true}

A cell's ``algorithm`` section is its own settings over the base's communication and screening
settings (:data:`SHARED_ALGORITHM_KEYS`: codecs, norm rules, server optimiser, aggregator, privacy): the
base's algorithm-specific settings (FedSense's perturbation, FedProx's beta, ...) do not carry over,
so ``fedavg: {}`` is plain FedAvg whatever the base runs. Each cell's whole config is written to
``OUTPUT/configs/`` and run with ``geofm fed simulate`` in a process of its own, into
``OUTPUT/<scenario>/<algorithm>[__<uplink>]``; ``OUTPUT/sweep.json`` records which cells finished. Rerunning the sweep skips them and resumes the others from their
checkpoints. After every cell the comparison (:mod:`geofm.fl.comparison`) is written to
``OUTPUT/comparison/``.
"""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, field_validator

from geofm.config.base import ProgramConfig, read_config_tree, set_dotted
from geofm.errors import ConfigError, GeoFMError
from geofm.fl.comparison import SWEEP_LABELS, write_comparison
from geofm.paths import check_writable

log = logging.getLogger("geofm.fl")

STATUS = "sweep.json"
SHARED_ALGORITHM_KEYS = (
    "uplink",
    "downlink",
    "uplink_payloads",
    "downlink_payloads",
    "norm_factor",
    "norm_history_rounds",
    "examples_factor",
    "server_optimizer",
    "aggregator",
    "privacy",
)
"""The base's ``algorithm`` settings every cell keeps: how updates travel, are screened and combined, and
their differential privacy."""


class SweepConfig(ProgramConfig):
    """A sweep file (see the module docstring)."""

    config: Path = Field(description="the federated config every cell starts from (relative to the sweep file)")
    output_dir: Path
    algorithms: dict[str, dict[str, Any]] = Field(min_length=1, description="label: algorithm settings")
    scenarios: dict[str, dict[str, Any]] = Field(
        default_factory=lambda: {"base": {}}, min_length=1, description="label: federation settings"
    )
    uplinks: dict[str, dict[str, Any]] = Field(default_factory=dict, description="label: algorithm.uplink settings")

    @field_validator("algorithms", "scenarios", "uplinks")
    @classmethod
    def _labels_name_folders(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for label in value:
            if not label or "/" in label or label.startswith(".") or "__" in label:
                raise ValueError(f"label {label!r} must be a plain folder name without '/' or '__'")
        return value


@dataclass(frozen=True)
class SweepCell:
    """One run of a sweep: its labels, its whole config tree and where it runs."""

    algorithm: str
    scenario: str
    uplink: str | None
    tree: dict
    run_dir: Path

    @property
    def name(self) -> str:
        """``<scenario>__<algorithm>[__<uplink>]``, the file name of its config."""
        return "__".join(part for part in (self.scenario, self.algorithm, self.uplink) if part)

    def labels(self) -> dict[str, str]:
        return {"algorithm": self.algorithm, "scenario": self.scenario, "uplink": self.uplink or "base"}


def sweep_cells(cfg: SweepConfig, base_dir: Path) -> list[SweepCell]:
    """Every cell of the sweep, scenarios outermost, then uplinks, then algorithms (the file's order)."""
    base = read_config_tree(base_dir / cfg.config)
    cells = []
    for scenario, federation in cfg.scenarios.items():
        for uplink, codec in (cfg.uplinks or {None: {}}).items():
            for algorithm, settings in cfg.algorithms.items():
                tree = copy.deepcopy(base)
                shared = {k: v for k, v in (tree.get("algorithm") or {}).items() if k in SHARED_ALGORITHM_KEYS}
                tree["algorithm"] = shared
                set_dotted(tree, "algorithm", {"name": algorithm, **settings})
                if federation:  # an empty mapping would clear the section
                    set_dotted(tree, "federation", dict(federation))
                if codec:
                    set_dotted(tree, "algorithm.uplink", dict(codec))
                run_dir = cfg.output_dir / scenario / (f"{algorithm}__{uplink}" if uplink else algorithm)
                set_dotted(tree, "run.output_dir", str(run_dir))
                cells.append(SweepCell(algorithm, scenario, uplink, tree, run_dir))
    return cells


def read_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[SweepConfig, list[SweepCell]]:
    """The sweep file's settings and cells; every cell's config is validated now, before any runs.

    Raises:
        ConfigError: the sweep file or a cell's config is invalid (naming the cell).
    """
    from geofm.config.federated import read_federated_config

    path = Path(path)
    cfg = SweepConfig.from_file(path, overrides)
    cells = sweep_cells(cfg, path.parent)
    for cell in cells:
        read_federated_config(cell.tree, f"{path} cell {cell.name}")
    return cfg, cells


def _status(output_dir: Path) -> dict[str, Any]:
    path = output_dir / STATUS
    return json.loads(path.read_text()) if path.is_file() else {"finished": {}, "failed": {}}


def _write_status(output_dir: Path, status: dict[str, Any]) -> None:
    path = output_dir / STATUS
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(status, indent=2, sort_keys=True) + "\n")
    partial.replace(path)


def run_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = (), simulate_args: list[str] = ()) -> Path:
    """Run every unfinished cell of a sweep file, each as ``geofm fed simulate`` in a process of its own.

    Args:
        path: the sweep file.
        overrides: ``key=value`` overrides of the sweep file.
        simulate_args: more arguments for each ``geofm fed simulate`` (e.g. ``--num-cpus 2``).

    Returns:
        The comparison's Markdown file.

    Raises:
        GeoFMError: a cell failed (the others still ran); rerunning the sweep resumes it.
    """
    cfg, cells = read_sweep(path, overrides)
    check_writable(cfg.output_dir, f"{path}: output_dir", folder=True)
    configs = cfg.output_dir / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    status = _status(cfg.output_dir)
    for index, cell in enumerate(cells, 1):
        config = configs / f"{cell.name}.yaml"
        if status["finished"].get(cell.name) == cell.tree:
            log.info("sweep cell %d/%d %s: finished earlier", index, len(cells), cell.name)
            continue
        config.write_text(yaml.safe_dump(cell.tree, sort_keys=False))
        log.info("sweep cell %d/%d %s: running into %s", index, len(cells), cell.name, cell.run_dir)
        command = [sys.executable, "-m", "geofm.cli", "fed", "simulate", "--config", str(config), *simulate_args]
        code = subprocess.run(command, check=False).returncode
        if code:
            status["failed"][cell.name] = f"geofm fed simulate exited with {code}"
            log.error("sweep cell %s failed (exit %d); rerun the sweep to resume it", cell.name, code)
        else:
            status["failed"].pop(cell.name, None)
            status["finished"][cell.name] = cell.tree
            (cell.run_dir / SWEEP_LABELS).write_text(json.dumps(cell.labels()) + "\n")
        _write_status(cfg.output_dir, status)
        finished = [c.run_dir for c in cells if c.name in status["finished"]]
        if finished:
            write_comparison(finished, cfg.output_dir / "comparison")
    if status["failed"]:
        raise GeoFMError(f"sweep {path}: cells {sorted(status['failed'])} failed; rerun the sweep to resume them")
    if not status["finished"]:
        raise ConfigError(f"sweep {path}: no cell finished")
    return cfg.output_dir / "comparison" / "comparison.md"


__all__ = ["SweepCell", "SweepConfig", "read_sweep", "run_sweep", "sweep_cells"]
