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


@pytest.mark.slow
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


@pytest.mark.slow
def test_finetune_command_runs_a_config_file_with_overrides(parser, task_tree, class_folders, tmp_path, capsys):
    config = tmp_path / "cls.yaml"
    config.write_text(yaml.safe_dump(task_tree("classification", "from_cli", data={"root": str(class_folders)})))
    out = tmp_path / "cli_run"
    overrides = [f"run.output_dir={out}", "train.epochs=1", "train.warmup_epochs=0.5"]
    args = parser.parse_args(["finetune", "--config", str(config), *overrides])
    args.handler(args)
    assert f"run directory: {out}" in capsys.readouterr().out
    assert json.loads((out / "eval.json").read_text())["steps"] == 6


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("central", "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml"),
        ("federated", "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml"),
        ("central", "configs/pretrain/demo_dino_swin_micro__img64_win4__4band.yaml"),
        ("federated", "configs/federated/demo_dino_fedavg_swin_micro__3inst.yaml"),
    ],
    ids=["gfm", "fedsense", "dino", "dino_fedavg"],
)
def test_eval_and_predict_of_a_pretraining_run_say_how_to_finetune_it_in_one_line(kind, config, tmp_path, capsys):
    from geofm.cli import main
    from geofm.config import read_config_tree
    from geofm.config.base import config_to_dict
    from geofm.config.federated import read_federated_config
    from geofm.config.pretrain import PretrainConfig

    cfg = PretrainConfig.from_file(config) if kind == "central" else read_federated_config(read_config_tree(config))
    run_dir = tmp_path / "pretraining_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    commands = [
        ["eval", f"checkpoint={run_dir}"],
        ["predict", "--model", str(run_dir), "--input", "scene.tif", "--output", str(tmp_path / "out.tif")],
    ]
    for command in commands:
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"geofm: error: {run_dir} is a {kind} pretraining run, not a finetuning run: geofm eval and geofm predict "
            f"take a geofm finetune run; finetune its backbone first with geofm finetune --config CONFIG "
            f"checkpoint={run_dir} (or checkpoint: in CONFIG)"
        ], command
