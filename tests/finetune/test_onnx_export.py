"""``geofm export onnx`` and ``geofm predict --engine onnx``: the export of every task family against PyTorch,
its metadata, its dynamic batch, whole-scene predictions of both engines, and the errors around them.

The runs are finetuned for one epoch on random data and exported once per test session, shared by
pytest-xdist's workers (an export traces the model: up to two minutes on two busy cores).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from finetune import splits
from finetune.cli import register
from finetune.files import ONNX_FILE
from finetune.onnx_model import METADATA_KEYS, export_onnx, load_onnx_predictor
from finetune.predictor import load_model
from finetune.run import finetune
from geofm.config.finetune import FinetuneConfig
from geofm.data.readers import read_raster
from geofm.data.writers import write_geotiff
from geofm.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DataMismatchError,
    ExportError,
    MissingDependencyError,
)
from tests.conftest import made_once
from tests.finetune.conftest import TRANSFORM, RandomTaskData

FAMILIES = ["classification", "multilabel", "segmentation", "change", "superres"]
TOLERANCE = 1e-4


def _cli(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="geofm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.handler(args)


def _random_split(data_cfg, task, split, img_size, train):
    size, seed = {"train": (8, 0), "val": (4, 1), "test": (4, 2)}[split]
    return RandomTaskData(task, size, img_size, len(data_cfg.bands), seed=seed)


@pytest.fixture(scope="module")
def exported(finetune_tree, tmp_path_factory):
    """``get(task)``: a run of the task (tiny Swin, 32 px, one epoch on random data) exported by
    ``geofm export onnx --model RUN`` to ``RUN/model.onnx``; made once per test session."""

    def make(folder: Path, task: str) -> None:
        tree = finetune_tree(task, folder / "run", train={"epochs": 1, "warmup_epochs": 0.5})
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(splits, "build_finetune_dataset", _random_split)
            run_dir = finetune(FinetuneConfig.from_tree(tree))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            _cli(["export", "onnx", "--model", str(run_dir)])
        assert f"wrote {run_dir / ONNX_FILE}" in printed.getvalue()
        assert "ONNX Runtime vs PyTorch on random tiles (batch 1 and 3): max abs difference" in printed.getvalue()

    def get(task: str) -> Path:
        return made_once(tmp_path_factory, f"onnx_{task}", lambda folder: make(folder, task)) / "run"

    return get


def _metadata(path: Path) -> dict:
    """The file's metadata_props, each value parsed as JSON."""
    return {p.key: json.loads(p.value) for p in onnx.load(str(path), load_external_data=False).metadata_props}


def _rewrite_metadata(source: Path, target: Path, **values) -> Path:
    """A copy of an export with some metadata values replaced."""
    model = onnx.load(str(source))
    for prop in model.metadata_props:
        if prop.key in values:
            prop.value = json.dumps(values[prop.key])
    onnx.save(model, str(target))
    return target


@pytest.mark.slow
@pytest.mark.parametrize("task", FAMILIES)
def test_the_export_computes_what_pytorch_does_for_any_batch(task, exported):
    run_dir = exported(task)
    model = load_model(run_dir)[0]
    predictor = load_onnx_predictor(run_dir)
    assert predictor.task == task and predictor.tile == 32
    generator = torch.Generator().manual_seed(3)
    for batch in (1, 3):
        tiles = [torch.randn(batch, 4, 32, 32, generator=generator) for _ in range(2 if task == "change" else 1)]
        with torch.no_grad():
            expected = model(*tiles)
        got = predictor.model_fn(*tiles)
        assert got.shape == expected.shape and got.shape[0] == batch
        assert (got - expected).abs().max().item() <= TOLERANCE
    meta = _metadata(run_dir / ONNX_FILE)
    assert set(meta) == set(METADATA_KEYS)
    assert meta["output"]["shape"] == ["batch", *expected.shape[1:]]


@pytest.mark.slow
def test_the_metadata_say_what_a_consumer_needs(exported):
    meta = _metadata(exported("segmentation") / ONNX_FILE)
    assert meta["task"] == "segmentation" and meta["inputs"] == ["image"] and meta["tile"] == 32
    assert meta["bands"] == ["red", "green", "blue", "nir"] and meta["num_classes"] == 3
    spec = meta["normalisation"]
    assert spec["dataset_bands"] == ["blue", "green", "red", "nir"] and spec["bands"] == meta["bands"]
    assert spec["scale"] == 0.0001 and spec["mean"] == [0.25] * 4 and spec["std"] == pytest.approx([0.1] * 4)
    assert meta["ignore_index"] == 255 and meta["target_normalisation"] is None and meta["scale_factor"] == 1
    assert meta["selected"]["split"] == "val" and len(meta["weights_sha256"]) == 64
    assert meta["exporter"]["dynamo"] is True and meta["exporter"]["opset"] >= 18
    graph = onnx.load(str(exported("segmentation") / ONNX_FILE)).graph
    batch = graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.HasField("dim_value"), "the batch dimension is symbolic"


def _scene(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    pixels = rng.normal(2500, 1000, (4, 70, 90)).clip(1, 60000).astype(np.uint16)
    pixels[:, :3, :5] = 0  # nodata
    write_geotiff(path, pixels, transform=TRANSFORM, crs=32632, nodata=0)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("task", ["segmentation", "change", "superres"])
def test_both_engines_predict_the_same_scene(task, exported, tmp_path):
    run_dir = exported(task)
    if task == "change":
        inputs = ["--before", str(_scene(tmp_path / "a.tif", 0)), "--after", str(_scene(tmp_path / "b.tif", 1))]
    else:
        inputs = ["--input", str(_scene(tmp_path / "scene.tif", 0))]
    common = ["predict", "--model", str(run_dir), *inputs, "--overlap", "8", "--batch-size", "3", "--no-progress"]
    _cli([*common, "--output", str(tmp_path / "torch.tif")])
    _cli([*common, "--engine", "onnx", "--output", str(tmp_path / "onnx.tif")])
    bands = 4 if task == "superres" else 1
    ours, theirs = read_raster(tmp_path / "onnx.tif", bands), read_raster(tmp_path / "torch.tif", bands)
    assert ours.data.shape == theirs.data.shape and ours.transform == theirs.transform and ours.crs == theirs.crs
    agree = np.mean(ours.data == theirs.data)
    assert agree >= 0.999, f"the engines agree on {agree:.4%} of the pixels"
    if task == "superres":  # raw units, rounded: at most one count apart
        assert np.abs(ours.data.astype(np.int64) - theirs.data.astype(np.int64)).max() <= 1


@pytest.mark.slow
def test_the_file_alone_predicts_without_its_run(exported, tmp_path):
    run_dir = exported("segmentation")
    alone = shutil.copy(run_dir / ONNX_FILE, tmp_path / "seg.onnx")
    scene = str(_scene(tmp_path / "scene.tif", 0))
    _cli(["predict", "--onnx", str(alone), "--input", scene, "--output", str(tmp_path / "a.tif"), "--no-progress"])
    _cli(
        ["predict", "--model", str(run_dir), "--engine", "onnx", "--input", scene, "--output", str(tmp_path / "b.tif")]
    )
    assert np.array_equal(read_raster(tmp_path / "a.tif", 1).data, read_raster(tmp_path / "b.tif", 1).data)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field", "value"),
    [("class_names", ["a", "b", "c"]), ("weights_sha256", "0" * 64), ("normalisation", {"bands": ["red"]})],
)
def test_an_export_that_does_not_match_the_run_is_refused_naming_the_field(field, value, exported, tmp_path):
    run_dir = exported("segmentation")
    other = _rewrite_metadata(run_dir / ONNX_FILE, tmp_path / "other.onnx", **{field: value})
    with pytest.raises(DataMismatchError, match=rf"its metadata '{field}' is .*geofm export onnx --model {run_dir}"):
        load_onnx_predictor(run_dir, other)


@pytest.mark.slow
def test_the_export_of_another_run_is_refused(exported):
    with pytest.raises(DataMismatchError, match='its metadata \'task\' is "change", the run\'s "segmentation"'):
        load_onnx_predictor(exported("segmentation"), exported("change") / ONNX_FILE)


@pytest.mark.slow
def test_a_tile_the_export_does_not_take_is_refused(exported):
    with pytest.raises(ConfigError, match=r"--tile 64: .* takes 32 px tiles \(its metadata 'tile'\).* --tile 64"):
        load_onnx_predictor(exported("segmentation"), tile=64)


@pytest.mark.slow
def test_an_exporter_error_is_reported_with_the_exporter_message(exported, monkeypatch):
    run_dir = exported("segmentation")

    def refuse(*args, **kwargs):
        raise RuntimeError("no translation for aten::strange_op\nmore details")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    with pytest.raises(ExportError, match=r"does not export with .*RuntimeError: no translation for aten::strange_op$"):
        export_onnx(run_dir, run_dir / "never.onnx")
    assert not (run_dir / "never.onnx").exists()


def test_predict_with_onnx_and_no_export_says_which_command_writes_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    argv = ["predict", "--model", str(run_dir), "--engine", "onnx", "--input", "x.tif", "--output"]
    with pytest.raises(
        CheckpointNotFoundError, match=rf"model.onnx does not exist: .*`geofm export onnx --model {run_dir}`"
    ):
        _cli([*argv, str(tmp_path / "out.tif")])
    with pytest.raises(CheckpointNotFoundError, match=r"--output .*other.onnx`"):
        load_onnx_predictor(run_dir, tmp_path / "other.onnx")


def test_a_missing_onnxruntime_or_onnxscript_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "model.onnx").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    with pytest.raises(
        MissingDependencyError, match=r"needs onnxruntime, which is not installed: pip install geofm\[onnx\]"
    ):
        load_onnx_predictor(tmp_path)
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(MissingDependencyError, match=r"export onnx needs onnxscript.*pip install geofm\[onnx\]"):
        export_onnx(tmp_path)


def test_an_onnx_file_of_another_origin_is_refused(tmp_path):
    node = onnx.helper.make_node("Identity", ["image"], ["output"])
    value = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        [node], "g", [value("image", onnx.TensorProto.FLOAT, [1])], [value("output", onnx.TensorProto.FLOAT, [1])]
    )
    onnx.save(onnx.helper.make_model(graph), str(tmp_path / "plain.onnx"))
    with pytest.raises(CheckpointFormatError, match="not an ONNX model of geofm export onnx"):
        load_onnx_predictor(onnx=tmp_path / "plain.onnx")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "torch", "--onnx", "m.onnx"], "--onnx FILE is run by ONNX Runtime"),
        ([], "give the finetuned run with --model RUN"),
    ],
)
def test_predict_engine_options_are_checked(argv, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        _cli(["predict", *argv, "--input", "x.tif", "--output", str(tmp_path / "out.tif")])


@pytest.mark.slow
def test_a_consumer_needs_only_onnxruntime_and_the_metadata(exported, tmp_path):
    """docs/export-onnx.md's recipe: normalise a scene's window by the metadata alone, run it, take the argmax."""
    import onnxruntime as ort

    run_dir = exported("segmentation")
    scene = _scene(tmp_path / "scene.tif", 2)
    session = ort.InferenceSession(str(run_dir / ONNX_FILE), providers=["CPUExecutionProvider"])
    meta = {k: json.loads(v) for k, v in session.get_modelmeta().custom_metadata_map.items()}
    spec, tile = meta["normalisation"], meta["tile"]
    raw = read_raster(scene, len(spec["dataset_bands"])).data[:, 10 : 10 + tile, 20 : 20 + tile].astype(np.float32)
    order = [spec["dataset_bands"].index(b) for b in spec["bands"]]
    mean = np.array(spec["mean"], np.float32)[:, None, None]
    std = np.array(spec["std"], np.float32)[:, None, None]
    x = (raw[order] * spec["scale"] - mean) / std
    scores = session.run([meta["output"]["name"]], {meta["inputs"][0]: x[None]})[0]

    predictor = load_onnx_predictor(run_dir)
    window = read_raster(scene, 4).data[:, 10 : 10 + tile, 20 : 20 + tile]
    image, _ = predictor.normaliser(window, 0, scene)
    assert np.abs(scores - predictor.model_fn(image[None]).numpy()).max() <= TOLERANCE
    assert scores.shape == (1, meta["num_classes"], tile, tile)
