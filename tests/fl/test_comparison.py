"""Federated runs side by side: scores per algorithm and scenario, costs per run, from the files runs write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from geofm.errors import ConfigError
from geofm.fl.comparison import SWEEP_LABELS, compare_runs, comparison_markdown, write_comparison


def _run(folder: Path, algorithm: str, partition: str, rounds: list[dict], *, bits: int = 32, evaluation=None) -> Path:
    folder.mkdir(parents=True)
    config = {"algorithm": {"name": algorithm, "uplink": {"bits": bits, "error_feedback": bits != 32}}}
    config["federation"] = {"partition": partition}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "rounds.jsonl").write_text(
        "".join(json.dumps({"round": i + 1, **r}) + "\n" for i, r in enumerate(rounds))
    )
    if evaluation is not None:
        (folder / "eval.json").write_text(json.dumps(evaluation))
    return folder


def _round(loss, up=1000, down=4000, server=None, steps=None, memory=None, val=None) -> dict:
    record = {"loss": loss, "uplink_bytes": up, "downlink_bytes": down}
    if server is not None:
        record["server_seconds"] = server
    if steps is not None:
        record["client_seconds_per_step"] = steps
    if memory is not None:
        record["client_peak_memory_bytes"] = memory
    if val is not None:
        record["val"] = val
    return record


@pytest.fixture
def runs(tmp_path) -> Path:
    root = tmp_path / "sweep"
    _run(
        root / "iid/fedavg",
        "fedavg",
        "iid",
        [
            _round(0.9, server=0.5, steps={"a": 0.10, "b": 0.30}, memory={"a": 2**20, "b": 3 * 2**20}),
            _round(0.7, up=3000, server=1.5, steps={"a": 0.20, "b": 0.20}, memory={"a": 2**21}),
        ],
    )
    _run(
        root / "iid/scaffold",
        "scaffold",
        "iid",
        [_round(0.8, up=2000, down=8000, steps={"a": 0.3, "b": 0.3}), _round(0.6, up=2000, down=8000)],
    )
    evaluation = {"primary_metric": "f1_micro", "score": 0.75}
    _run(root / "dirichlet/fedavg", "fedavg", "dirichlet", [_round(1.0, val={"f1_micro": 0.5})], evaluation=evaluation)
    _run(root / "dirichlet/fedbn", "fedbn", "dirichlet", [_round(1.0, val={"f1_micro": 0.61, "map": 0.7})])
    return root


def test_scores_come_from_eval_then_the_last_validation_then_the_last_loss(runs):
    by_run = {(s.scenario, s.algorithm): s for s in compare_runs([runs])}
    assert (by_run["dirichlet", "fedavg"].metric, by_run["dirichlet", "fedavg"].score) == ("test f1_micro", 0.75)
    assert (by_run["dirichlet", "fedbn"].metric, by_run["dirichlet", "fedbn"].score) == ("val f1_micro", 0.61)
    assert (by_run["iid", "scaffold"].metric, by_run["iid", "scaffold"].score) == ("loss", 0.6)
    assert not by_run["iid", "scaffold"].higher_is_better and by_run["dirichlet", "fedbn"].higher_is_better


def test_costs_are_means_per_round_and_step_cost_is_relative_to_fedavg_of_the_same_scenario(runs):
    by_run = {(s.scenario, s.algorithm): s for s in compare_runs([runs])}
    fedavg, scaffold = by_run["iid", "fedavg"], by_run["iid", "scaffold"]
    assert fedavg.uplink_bytes_per_round == 2000 and fedavg.downlink_bytes_per_round == 4000
    assert fedavg.server_seconds_per_round == 1.0
    assert fedavg.client_seconds_per_step == pytest.approx(0.2)  # mean of 0.1, 0.3, 0.2, 0.2
    assert fedavg.client_peak_memory_mib == 3.0
    assert scaffold.step_cost_vs_fedavg == pytest.approx(1.5)
    assert scaffold.server_seconds_per_round is None and scaffold.client_peak_memory_mib is None
    assert by_run["dirichlet", "fedbn"].step_cost_vs_fedavg is None  # its FedAvg logged no step times


def test_markdown_tables_put_scenarios_in_columns_and_bold_each_scenarios_best(runs):
    text = comparison_markdown(compare_runs([runs]))
    assert "| algorithm | dirichlet | iid |" in text
    assert "| fedavg | **0.7500** | 0.7000 |" in text  # f1 higher is better; loss lower is better
    assert "| fedbn | 0.6100 |  |" in text
    assert "| scaffold |  | **0.6000** |" in text
    assert "| scaffold | iid | 32bit | 2 | 2.0 | 7.8 | n/a | 0.3000 | 1.50 | n/a |" in text


def test_sweep_labels_override_what_the_config_says_and_files_are_written(runs, tmp_path):
    (runs / "iid/scaffold" / SWEEP_LABELS).write_text(json.dumps({"algorithm": "scaf", "scenario": "S", "uplink": "U"}))
    out = tmp_path / "report"
    markdown = write_comparison([runs], out)
    assert markdown == out / "comparison.md"
    rows = json.loads((out / "comparison.json").read_text())
    assert {(r["algorithm"], r["scenario"], r["uplink"]) for r in rows} >= {("scaf", "S", "U")}
    assert (out / "comparison.png").stat().st_size > 0


def test_a_folder_without_runs_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no federated run"):
        compare_runs([tmp_path])
    with pytest.raises(ConfigError, match="no such folder"):
        compare_runs([tmp_path / "missing"])
