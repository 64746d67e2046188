"""ARP against a baseline: the GFM definition on published numbers, matching of records, the report files."""

from __future__ import annotations

import json

import pytest

from finetune.cli import register
from finetune.report import average_relative_performance, compare, read_eval, write_report
from geofm.errors import ConfigError


def _record(tmp_path, name: str, task: str, dataset: str, score: float, fraction: float = 1.0, metric: str = "f1"):
    path = tmp_path / f"{name}.json"
    record = {"task": task, "dataset": dataset, "train_fraction": fraction, "primary_metric": metric, "score": score}
    path.write_text(json.dumps(record))
    return read_eval(path)


def test_arp_of_gfm_against_imagenet_22k_swin_on_the_papers_change_detection_tables(tmp_path):
    # GFM (Mendieta et al., ICCV 2023), change detection F1: Table 3 (OSCD) GFM 59.82, Swin (ImageNet-22k) 52.35;
    # Table 4 (DSFIN) GFM 71.24, Swin (ImageNet-22k) 69.62.
    gfm = [
        _record(tmp_path, "gfm_oscd", "change", "OSCD", 59.82),
        _record(tmp_path, "gfm_dsifn", "change", "DSIFN", 71.24),
    ]
    swin = [
        _record(tmp_path, "in22k_oscd", "change", "OSCD", 52.35),
        _record(tmp_path, "in22k_dsifn", "change", "DSIFN", 69.62),
    ]
    rows, unmatched = compare(gfm, swin)
    # 100/2 * ((59.82 - 52.35) / 52.35 + (71.24 - 69.62) / 69.62) = 50 * (0.1426934 + 0.0232692)
    assert average_relative_performance(rows) == pytest.approx(8.29813, abs=1e-4)
    assert not unmatched


def test_tasks_are_matched_by_task_dataset_and_train_fraction(tmp_path):
    model = [
        _record(tmp_path, "m_ben10", "multilabel", "BigEarthNet", 0.80, 0.1, "map_micro"),
        _record(tmp_path, "m_ben1", "multilabel", "BigEarthNet", 0.66, 0.01, "map_micro"),
        _record(tmp_path, "m_ucm", "classification", "UCMerced", 0.99, metric="accuracy"),
    ]
    baseline = [
        _record(tmp_path, "b_ben1", "multilabel", "BigEarthNet", 0.60, 0.01, "map_micro"),
        _record(tmp_path, "b_ben10", "multilabel", "BigEarthNet", 0.80, 0.1, "map_micro"),
        _record(tmp_path, "b_vai", "segmentation", "Vaihingen", 0.75, metric="miou"),
    ]
    rows, unmatched = compare(model, baseline)
    by_name = {r.name: r.relative for r in rows}
    assert by_name == {"BigEarthNet 1%": pytest.approx(0.1), "BigEarthNet 10%": pytest.approx(0.0)}
    assert average_relative_performance(rows) == pytest.approx(5.0), "100/2 * (0.1 + 0)"
    assert unmatched == [f"model only: {tmp_path / 'm_ucm.json'}", f"baseline only: {tmp_path / 'b_vai.json'}"]


def test_records_that_cannot_be_compared_are_refused(tmp_path):
    a = _record(tmp_path, "a", "segmentation", "WHU", 0.9, metric="iou/building")
    with pytest.raises(ConfigError, match=r"by iou/building, .* by miou"):
        compare([a], [_record(tmp_path, "b", "segmentation", "WHU", 0.8, metric="miou")])
    with pytest.raises(ConfigError, match="share no task"):
        compare([a], [_record(tmp_path, "c", "segmentation", "Vaihingen", 0.8, metric="iou/building")])
    with pytest.raises(ConfigError, match="both evaluate segmentation on WHU"):
        compare([a, a], [a])
    (tmp_path / "bad.json").write_text(json.dumps({"task": "change"}))
    with pytest.raises(ConfigError, match=r"missing \['dataset', 'train_fraction', 'primary_metric', 'score'\]"):
        read_eval(tmp_path / "bad.json")


def test_report_command_writes_markdown_json_and_chart(tmp_path, capsys):
    import argparse

    model = _record(tmp_path, "m", "change", "OSCD", 0.6)
    baseline = _record(tmp_path, "b", "change", "OSCD", 0.5)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "report"
    args = parser.parse_args(
        ["report", model["path"], "--baseline", baseline["path"], "--out", str(out), "--name", "gfm"]
    )
    args.handler(args)
    assert "ARP of gfm against baseline over 1 tasks: +20.00%" in capsys.readouterr().out
    summary = json.loads((out / "arp.json").read_text())
    assert summary["arp"] == pytest.approx(20.0) and summary["tasks"][0]["relative_percent"] == pytest.approx(20.0)
    assert "| change | OSCD | f1 | 0.6000 | 0.5000 | +20.00 |" in (out / "report.md").read_text()
    assert (out / "arp.png").stat().st_size > 0


def test_write_report_lists_unmatched_records(tmp_path):
    rows, _ = compare([_record(tmp_path, "m", "change", "OSCD", 0.4)], [_record(tmp_path, "b", "change", "OSCD", 0.5)])
    paths = write_report(rows, tmp_path / "out", unmatched=["model only: x.json"])
    text = paths["markdown"].read_text()
    assert "**ARP over 1 tasks: -20.00%**" in text and "- not compared, model only: x.json" in text
