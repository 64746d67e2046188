"""``geofm finetune`` and ``geofm eval`` through their registered handlers."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from finetune.cli import register
from geofm.errors import ConfigError


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geofm")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_eval_reevaluates_the_kept_weights_on_a_split(parser, classification_run, capsys):
    args = parser.parse_args(["eval", f"checkpoint={classification_run}", "split=val"])
    args.handler(args)
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((classification_run / "eval_val.json").read_text())
    assert printed == written and written["split"] == "val"
    selected = json.loads((classification_run / "best/best.json").read_text())
    assert written["metrics"]["accuracy"] == pytest.approx(selected["metrics"]["accuracy"]), (
        "the kept weights score on val what they scored when they were selected"
    )


def test_eval_needs_the_run(parser, classification_run):
    args = parser.parse_args(["eval", "split=test"])
    with pytest.raises(ConfigError, match="needs checkpoint=RUN"):
        args.handler(args)
    args = parser.parse_args(["eval", f"checkpoint={classification_run}", "split=dev"])
    with pytest.raises(ConfigError, match="expected train, val or test"):
        args.handler(args)


def test_finetune_command_runs_a_config_file_with_overrides(parser, task_tree, class_folders, tmp_path, capsys):
    config = tmp_path / "cls.yaml"
    config.write_text(yaml.safe_dump(task_tree("classification", "from_cli", data={"root": str(class_folders)})))
    out = tmp_path / "cli_run"
    overrides = [f"run.output_dir={out}", "train.epochs=1", "train.warmup_epochs=0.5"]
    args = parser.parse_args(["finetune", "--config", str(config), *overrides])
    args.handler(args)
    assert f"run directory: {out}" in capsys.readouterr().out
    assert json.loads((out / "eval.json").read_text())["steps"] == 6
