"""``geofm predict``: argument handling around the finetuning program's load_predictor."""

from __future__ import annotations

import argparse
import sys
import types

import numpy as np
import pytest
import torch

from finetune.cli import register
from finetune.predict import Predictor
from geofm.data.finetune import BandNormaliser
from geofm.data.readers import read_raster, write_geotiff
from geofm.errors import ConfigError


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="geofm")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


@pytest.fixture
def fake_program(monkeypatch):
    """Stands in for the finetuning program's ``finetune.predictor`` module; records the run directory asked for."""

    def install(task: str) -> list:
        asked = []
        norm = BandNormaliser(["red"], ["red"], 1.0, [0.0], [1.0])

        def load_predictor(run_dir):
            asked.append(run_dir)
            return Predictor(model_fn=lambda *x: torch.cat([-x[-1], x[-1]], dim=1), task=task, normaliser=norm)

        monkeypatch.setitem(sys.modules, "finetune.predictor", types.SimpleNamespace(load_predictor=load_predictor))
        return asked

    return install


def test_predict_segmentation_scene(tmp_path, fake_program, capsys):
    asked = fake_program("segmentation")
    data = np.where(np.arange(40 * 50).reshape(1, 40, 50) % 3 == 0, 5.0, -5.0).astype(np.float32)
    write_geotiff(tmp_path / "scene.tif", data, transform=(1, 0, 0, 0, -1, 0), crs=32632)
    args = _parse(
        [
            "predict",
            "--model",
            str(tmp_path / "run"),
            "--input",
            str(tmp_path / "scene.tif"),
            "--output",
            str(tmp_path / "out.tif"),
        ]
        + ["--tile", "32", "--overlap", "8", "--no-progress"]
    )
    args.handler(args)
    assert asked == [tmp_path / "run"]
    assert np.array_equal(read_raster(tmp_path / "out.tif", 1).data[0], (data[0] > 0).astype(np.uint8))
    assert "wrote" in capsys.readouterr().out


def test_inputs_must_fit_the_task(tmp_path, fake_program):
    fake_program("change")
    args = _parse(["predict", "--model", "run", "--input", "scene.tif", "--output", "out.tif"])
    with pytest.raises(ConfigError, match="change detection model: give --before A.tif and --after B.tif"):
        args.handler(args)
    fake_program("segmentation")
    args = _parse(["predict", "--model", "run", "--before", "a.tif", "--after", "b.tif", "--output", "out.tif"])
    with pytest.raises(ConfigError, match="segmentation model: give --input SCENE.tif"):
        args.handler(args)
