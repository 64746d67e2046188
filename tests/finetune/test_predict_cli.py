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
from geofm.data.readers import read_raster
from geofm.data.writers import write_geotiff
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

        def load_predictor(run_dir, tile):
            asked.append(run_dir)
            return Predictor(lambda *x: torch.cat([-x[-1], x[-1]], dim=1), task, norm, tile or 256)

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
            "--tile",
            "32",
            "--overlap",
            "8",
            "--no-progress",
        ]
    )
    args.handler(args)
    assert asked == [tmp_path / "run"]
    assert np.array_equal(read_raster(tmp_path / "out.tif", 1).data[0], (data[0] > 0).astype(np.uint8))
    assert "wrote" in capsys.readouterr().out


def test_predict_again_keeps_the_finished_output_unless_overwrite(tmp_path, monkeypatch, capsys):
    calls = []

    def model_fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        return torch.cat([-x, x], dim=1)

    def load_predictor(run_dir, tile):
        return Predictor(model_fn, "segmentation", BandNormaliser(["red"], ["red"], 1.0, [0.0], [1.0]), 32)

    monkeypatch.setitem(sys.modules, "finetune.predictor", types.SimpleNamespace(load_predictor=load_predictor))
    data = np.where(np.arange(40 * 50).reshape(1, 40, 50) % 3 == 0, 5.0, -5.0).astype(np.float32)
    write_geotiff(tmp_path / "scene.tif", data, transform=(1, 0, 0, 0, -1, 0), crs=32632)
    argv = ["predict", "--model", str(tmp_path / "run"), "--input", str(tmp_path / "scene.tif")]
    argv += ["--output", str(tmp_path / "out.tif"), "--no-progress"]
    for extra in ([], [], ["--overwrite"]):
        args = _parse([*argv, *extra])
        args.handler(args)
    once = len(calls) // 2
    assert once and calls[:once] == calls[once:], "run again: kept; with --overwrite: predicted again"
    assert np.array_equal(read_raster(tmp_path / "out.tif", 1).data[0], (data[0] > 0).astype(np.uint8))


def test_predict_never_writes_over_its_input_nor_a_file_it_did_not_write(tmp_path, fake_program, capsys):
    from geofm.cli import main

    fake_program("segmentation")
    scene = tmp_path / "s.tif"
    write_geotiff(scene, np.ones((1, 40, 50), np.float32), transform=(1, 0, 0, 0, -1, 0), crs=32632)
    before = scene.read_bytes()
    argv = ["predict", "--model", "run", "--input", str(scene), "--tile", "32", "--no-progress", "--output"]
    for extra in ([], ["--overwrite"]):
        assert main([*argv, str(scene), *extra]) == 2
        err = capsys.readouterr().err
        assert err == f"geofm: error: {scene} is the input {scene}; write the output to another path\n"
    other = tmp_path / "other.tif"
    write_geotiff(other, np.ones((4, 40, 50), np.uint16), transform=(1, 0, 0, 0, -1, 0), crs=32632)
    assert main([*argv, str(other)]) == 2
    assert "other.tif exists and was not written by geofm" in capsys.readouterr().err
    assert scene.read_bytes() == before and read_raster(other, 4).data.shape == (4, 40, 50), "both intact"
    assert main([*argv, str(other), "--overwrite"]) == 0 and read_raster(other, 1).dtype == "uint8"


@pytest.mark.parametrize(("stop", "code"), [("Ctrl-C", 130), ("SIGTERM", 143)])
def test_a_stopped_prediction_says_a_rerun_continues_it(tmp_path, monkeypatch, capsys, sigterm_caught, stop, code):
    import os
    import signal

    from geofm.cli import main

    def stops_once_a_block_is_written(x: torch.Tensor) -> torch.Tensor:
        if (tmp_path / "out.tif.partial.json").exists():
            if stop == "Ctrl-C":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
        return torch.cat([-x, x], dim=1)

    def load_predictor(run_dir, tile):
        return Predictor(
            stops_once_a_block_is_written, "segmentation", BandNormaliser(["red"], ["red"], 1.0, [0.0], [1.0]), 32
        )

    monkeypatch.setitem(sys.modules, "finetune.predictor", types.SimpleNamespace(load_predictor=load_predictor))
    write_geotiff(tmp_path / "s.tif", np.ones((1, 300, 300), np.float32), transform=(1, 0, 0, 0, -1, 0), crs=32632)
    out = tmp_path / "out.tif"
    assert (
        main(["predict", "--model", "run", "--input", str(tmp_path / "s.tif"), "--output", str(out), "--no-progress"])
        == code
    )
    assert capsys.readouterr().err == (
        f"geofm: error: predict interrupted ({stop}); rerun the same command to continue after the blocks already "
        f"written to {out}.partial\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tif.partial", "out.tif.partial.json", "s.tif"], (
        "the finished blocks kept, the lock released"
    )


def test_inputs_must_fit_the_task(tmp_path, fake_program):
    fake_program("change")
    args = _parse(["predict", "--model", "run", "--input", "scene.tif", "--output", "out.tif"])
    with pytest.raises(ConfigError, match=r"change detection model: give --before A\.tif and --after B\.tif"):
        args.handler(args)
    fake_program("segmentation")
    args = _parse(["predict", "--model", "run", "--before", "a.tif", "--after", "b.tif", "--output", "out.tif"])
    with pytest.raises(ConfigError, match=r"segmentation model: give --input SCENE\.tif"):
        args.handler(args)


@pytest.fixture
def run_at_64(task_config, random_datasets):
    """A segmentation run of the tiny Swin trained on 64 px tiles (4 bands, 3 classes)."""
    from finetune.run import finetune

    return finetune(task_config("segmentation", model={"img_size": 64}, train={"epochs": 1, "warmup_epochs": 0.5}))


def _predict(run_dir, scene, out, *extra: str) -> int:
    from geofm.cli import main

    return main(
        ["predict", "--model", str(run_dir), "--input", str(scene), "--output", str(out), "--no-progress", *extra]
    )


def test_predict_tiles_as_the_model_was_trained_by_default_or_as_asked(run_at_64, tmp_path, capsys):
    pixels = np.random.default_rng(0).integers(1, 5000, (4, 100, 150)).astype(np.uint16)
    write_geotiff(tmp_path / "scene.tif", pixels, transform=(10, 0, 500_000, 0, -10, 4_000_000), crs=32632)
    outputs = {}
    for name, extra in (("default", ()), ("own", ("--tile", "64")), ("larger", ("--tile", "128", "--overlap", "32"))):
        assert _predict(run_at_64, tmp_path / "scene.tif", tmp_path / f"{name}.tif", *extra) == 0, (
            capsys.readouterr().err
        )
        outputs[name] = read_raster(tmp_path / f"{name}.tif", 1).data[0]
        assert outputs[name].shape == (100, 150) and outputs[name].max() < 3, name
    assert np.array_equal(outputs["default"], outputs["own"]), "the default tile is the model's own size, 64 px"


def test_predict_refuses_a_tile_the_model_cannot_take_in_one_line(run_at_64, tmp_path, capsys):
    write_geotiff(tmp_path / "scene.tif", np.ones((4, 70, 70), np.uint16), transform=(1, 0, 0, 0, -1, 0), crs=32632)
    assert _predict(run_at_64, tmp_path / "scene.tif", tmp_path / "out.tif", "--tile", "80") == 2
    err = capsys.readouterr().err
    assert err.startswith("geofm: error: --tile 80: ") and err.count("\n") == 1, err
    assert "multiple of 32 px (32, 64, 96, 128, ...)" in err and not (tmp_path / "out.tif").exists()
