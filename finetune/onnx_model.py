"""A finetuned run as a portable ONNX model (``geofm export onnx``) and ONNX Runtime as an engine of
``geofm predict`` (``--engine onnx``).

The export is the whole model, backbone and head, through PyTorch's dynamo exporter
(``torch.onnx.export(..., dynamo=True)``, which translates through onnxscript): ``torch.export``
captures the model's graph, which is checked and optimised, and the batch dimension is dynamic (a
``torch.export.Dim``); the spatial side is the tile it was exported for (a Swin's attention masks
depend on it). Its inputs are named as the model's (``image``; change: ``image1``, the earlier date,
and ``image2``), its output ``output``. The model's ``metadata_props`` say, as JSON strings, all a
consumer needs to use it without geofm (:data:`METADATA_KEYS`): the task, the bands and how to
normalise them, the classes, the tile, the output, and which weights of which run it holds.

ONNX Runtime runs it as the ``model_fn`` of a :class:`~finetune.predict.Predictor`, so that
``geofm predict`` tiles, blends, writes and resumes exactly as with the PyTorch model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from finetune.best import BEST_DIR, MODEL_WEIGHTS, read_best, run_config
from finetune.files import ONNX_FILE
from finetune.predict import ModelFn, Predictor, band_spec
from geofm.config.finetune import FinetuneConfig
from geofm.data.finetune import BandNormaliser
from geofm.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigError,
    DataMismatchError,
    ExportError,
    MissingDependencyError,
)
from geofm.tasks.finetuning import task_of

log = logging.getLogger("geofm.finetune")

FORMAT = "geofm-onnx/1"
INSTALL_HINT = "pip install geofm[onnx]"
OUTPUT_NAME = "output"
EXAMPLE_BATCH = 2  # torch.export takes a dimension of size 1 for a constant: the example batch is larger
CHECK_BATCHES = (1, 3)

METADATA_KEYS = {
    "format": f"{FORMAT!r}: this layout of metadata",
    "task": "the finetuning task: classification, multilabel, segmentation, change or superres",
    "inputs": "the model's input names in call order (change: image1 the earlier date, image2 the later)",
    "tile": "side of the square inputs, in pixels: inputs are (batch, len(bands), tile, tile) float32",
    "output": "the output: its name, shape (batch first) and kind: logits (per image), dense (class scores per "
    "pixel; one channel: the logit of class 1) or image (normalised as target_normalisation)",
    "bands": "the model's input bands, in channel order",
    "normalisation": "how a channel is made from a scene: the scene's bands are dataset_bands, channel i is band "
    "bands[i], (raw * scale - mean[i]) / std[i]; pixels equal to nodata (null: the file's own) or not finite are 0",
    "target_normalisation": "superres: the output bands' spec in the same form (raw = (out * std + mean) / scale); "
    "null for the other tasks",
    "scale_factor": "output / input resolution (superres; 1 otherwise)",
    "num_classes": "the number of classes (null for superres)",
    "class_names": "the classes' names, by class id (null: unnamed)",
    "ignore_index": "the label id that was not scored in training (null: none)",
    "selected": "the kept weights' record: step, epoch, split and metric they were selected by",
    "weights_sha256": "SHA-256 of the run's best/model.safetensors the export was made from",
    "run": "the run directory's name",
    "exporter": "how it was exported: torch.onnx.export with dynamo, opset, library versions",
}
"""Every key of an export's ``metadata_props`` (each value a JSON string) and what it holds."""

RUN_FIELDS = (
    "task",
    "inputs",
    "bands",
    "normalisation",
    "target_normalisation",
    "scale_factor",
    "num_classes",
    "class_names",
    "ignore_index",
    "selected",
    "weights_sha256",
)
"""The metadata an export must share with the run it is used with (``geofm predict --model RUN --engine onnx``)."""


def require(module: str, command: str) -> Any:
    """Import an optional package of the ``onnx`` extra.

    Raises:
        MissingDependencyError: naming the package, the command and the install command.
    """
    try:
        return import_module(module)
    except ImportError as err:
        raise MissingDependencyError(f"{command} needs {module}, which is not installed: {INSTALL_HINT}") from err


def weights_sha256(run_dir: Path) -> str:
    """SHA-256 of the run's kept weights file."""
    with open(run_dir / BEST_DIR / MODEL_WEIGHTS, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def run_metadata(run_dir: Path, cfg: FinetuneConfig, record: dict, tile: int) -> dict[str, Any]:
    """The metadata (:data:`METADATA_KEYS`, less ``exporter``) of the run's kept weights exported for ``tile`` px tiles."""
    task = task_of(cfg)
    data, factor = cfg.data, task.scale_factor()
    targets = task.target_normaliser()
    if task.output == "image":
        shape = ["batch", len(targets.bands), tile * factor, tile * factor]
    elif task.output == "dense":
        shape = ["batch", data.num_classes, tile, tile]
    else:
        shape = ["batch", data.num_classes]
    return {
        "format": FORMAT,
        "task": cfg.task,
        "inputs": list(task.inputs),
        "tile": tile,
        "output": {"name": OUTPUT_NAME, "shape": shape, "kind": task.output},
        "bands": list(data.bands),
        "normalisation": band_spec(BandNormaliser.from_config(data)),
        "target_normalisation": band_spec(targets) if targets is not None else None,
        "scale_factor": factor,
        "num_classes": data.num_classes,
        "class_names": data.class_names,
        "ignore_index": data.ignore_index,
        "selected": record,
        "weights_sha256": weights_sha256(run_dir),
        "run": run_dir.resolve().name,
    }


@dataclass(frozen=True)
class Exported:
    """What :func:`export_onnx` wrote: the file, its metadata and ONNX Runtime's max abs difference from
    PyTorch on random tiles of batch 1 and 3 (None where onnxruntime is not installed)."""

    path: Path
    metadata: dict[str, Any]
    max_abs_diff: float | None


def export_onnx(
    run_dir: str | Path, output: str | Path | None = None, *, tile: int | None = None, opset: int | None = None
) -> Exported:
    """Export a finetuned run's kept weights, backbone and head, to an ONNX file with a dynamic batch.

    Args:
        run_dir: a ``geofm finetune`` run directory.
        output: the ONNX file (default ``RUN/model.onnx``, :data:`ONNX_FILE`); replaced when it exists.
        tile: the side of the inputs (default: the training size, ``model.img_size``; as ``geofm predict --tile``).
        opset: the ONNX opset (default: the exporter's).

    Returns:
        The file, its metadata, and how far ONNX Runtime's outputs are from PyTorch's.

    Raises:
        MissingDependencyError: without onnx or onnxscript.
        CheckpointNotFoundError: if ``run_dir`` is no finetuning run, or has kept no weights yet.
        ConfigError: if the model cannot take ``tile`` x ``tile`` inputs.
        ExportError: with the exporter's error, if the model does not export.
    """
    command = "geofm export onnx"
    require("onnx", command)
    require("onnxscript", command)
    from finetune.predictor import load_model

    run_dir = Path(run_dir)
    output = Path(output) if output is not None else run_dir / ONNX_FILE
    model, cfg, record = load_model(run_dir, tile)
    model = model.cpu().float().eval()
    tile = tile or cfg.model.img_size
    metadata = run_metadata(run_dir, cfg, record, tile)
    names = metadata["inputs"]
    generator = torch.Generator().manual_seed(0)
    examples = tuple(torch.randn(EXAMPLE_BATCH, len(cfg.data.bands), tile, tile, generator=generator) for _ in names)
    batch = torch.export.Dim("batch", min=1)
    log.info(
        "exporting the %s model of %s for %d px tiles with torch.onnx.export(dynamo=True)", cfg.task, run_dir, tile
    )
    try:
        with warnings.catch_warnings():
            # change: both dates share the batch dimension, which the exporter names once and says so
            warnings.filterwarnings("ignore", message=".*shares the same shape constraints with another axis")
            program = torch.onnx.export(
                model,
                examples,
                dynamo=True,
                input_names=names,
                output_names=[OUTPUT_NAME],
                dynamic_shapes={name: {0: batch} for name in names},
                opset_version=opset,
                optimize=True,
                verbose=False,
            )
    except Exception as err:  # the exporter's errors have no common type
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExportError(
            f"{run_dir}: the {cfg.task} model does not export with torch.onnx.export(dynamo=True): "
            f"{type(err).__name__}: {reason}"
        ) from err
    metadata["exporter"] = {
        "function": "torch.onnx.export",
        "dynamo": True,
        "opset": program.model.opset_imports.get("", opset),
        "torch": torch.__version__,
        "onnxscript": _version("onnxscript"),
        "onnx": _version("onnx"),
        "geofm": _version("geofm"),
    }
    program.model.metadata_props.update(encode_metadata(metadata))
    diff = _check(program, model, len(cfg.data.bands), tile, names)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.tmp")
    program.save(partial)
    os.replace(partial, output)
    return Exported(output, metadata, diff)


@torch.no_grad()
def _check(program: Any, model: torch.nn.Module, channels: int, tile: int, names: list[str]) -> float | None:
    """ONNX Runtime's max abs difference from the model on random tiles of each of :data:`CHECK_BATCHES`."""
    try:
        ort = import_module("onnxruntime")
    except ImportError:
        log.warning("onnxruntime is not installed: the export is not compared with PyTorch (%s)", INSTALL_HINT)
        return None
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(1)
    worst = 0.0
    for batch in CHECK_BATCHES:
        tiles = [torch.randn(batch, channels, tile, tile, generator=generator) for _ in names]
        ours = session.run(None, {name: t.numpy() for name, t in zip(names, tiles, strict=True)})[0]
        worst = max(worst, float(np.abs(ours - model(*tiles).numpy()).max()))
    return worst


def encode_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Metadata as ``metadata_props``: each value a JSON string."""
    return {key: json.dumps(value) for key, value in metadata.items()}


def decode_metadata(props: Mapping[str, str], path: Path | str) -> dict[str, Any]:
    """An export's ``metadata_props`` (or ONNX Runtime's ``custom_metadata_map``) read back.

    Raises:
        CheckpointFormatError: naming the file and the key that is missing or no JSON.
    """
    if props.get("format") != json.dumps(FORMAT):
        raise CheckpointFormatError(
            f"{path}: not an ONNX model of geofm export onnx (its metadata_props have no format {FORMAT!r})"
        )
    metadata = {}
    for key in METADATA_KEYS:
        if key not in props:
            raise CheckpointFormatError(f"{path}: metadata_props lack {key!r} ({METADATA_KEYS[key]})")
        try:
            metadata[key] = json.loads(props[key])
        except json.JSONDecodeError as err:
            raise CheckpointFormatError(f"{path}: metadata_props {key!r} is no JSON string: {err}") from None
    return metadata


def normaliser_from_spec(spec: Mapping[str, Any], path: Path | str, key: str) -> BandNormaliser:
    """The :class:`BandNormaliser` of a band spec of the metadata (mean and std per channel, in ``bands`` order).

    Raises:
        CheckpointFormatError: naming the file and key of a malformed spec.
    """
    try:
        bands, dataset_bands = list(spec["bands"]), list(spec["dataset_bands"])
        by_band = dict(zip(bands, zip(spec["mean"], spec["std"], strict=True), strict=True))
        mean = [by_band.get(b, (0.0, 1.0))[0] for b in dataset_bands]
        std = [by_band.get(b, (0.0, 1.0))[1] for b in dataset_bands]
        return BandNormaliser(dataset_bands, bands, spec["scale"], mean, std, spec["nodata"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointFormatError(
            f"{path}: metadata_props {key!r} is no band spec (dataset_bands, bands, scale, mean and std per band, "
            f"nodata): {err}"
        ) from None


def check_against_run(metadata: Mapping[str, Any], run_dir: Path, path: Path) -> None:
    """Refuse an export whose metadata differs from what the run now holds (:data:`RUN_FIELDS`).

    Raises:
        DataMismatchError: naming the first field that differs, both values and the command that exports again.
    """
    cfg = run_config(run_dir)
    record = read_best(run_dir)
    if record is None:
        raise CheckpointNotFoundError(
            f"{run_dir.resolve() / BEST_DIR / MODEL_WEIGHTS} does not exist: the run has not kept weights yet"
        )
    expected = json.loads(json.dumps(run_metadata(run_dir, cfg, record, metadata["tile"])))
    for key in RUN_FIELDS:
        if metadata.get(key) != expected[key]:
            raise DataMismatchError(
                f"{path} does not match the run {run_dir}: its metadata {key!r} is {_short(metadata.get(key))}, "
                f"the run's {_short(expected[key])}; export the run again: geofm export onnx --model {run_dir} "
                f"--output {path}"
            )


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def onnx_providers(available: list[str]) -> list[str]:
    """ONNX Runtime's providers to use: CUDA where onnxruntime offers it (unless ``DS_ACCELERATOR=cpu``,
    as for the PyTorch engine), then the CPU."""
    if "CUDAExecutionProvider" in available and os.environ.get("DS_ACCELERATOR") != "cpu":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def onnx_session(path: Path, threads: int | None = None) -> Any:
    """An ONNX Runtime session of ``path`` (``threads``: intra-op threads, default ONNX Runtime's choice).

    Raises:
        MissingDependencyError: without onnxruntime.
    """
    ort = require("onnxruntime", "geofm predict --engine onnx")
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=onnx_providers(ort.get_available_providers()))


def onnx_model_fn(session: Any) -> ModelFn:
    """A :class:`~finetune.predict.Predictor`'s ``model_fn`` running ``session``: float32 CPU tiles in, float32 CPU tensor out."""
    names = [node.name for node in session.get_inputs()]

    def model_fn(*tiles: Tensor) -> Tensor:
        if len(tiles) != len(names):
            raise ConfigError(f"the ONNX model takes {len(names)} inputs ({', '.join(names)}), got {len(tiles)}")
        feeds = {
            name: np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32)
            for name, t in zip(names, tiles, strict=True)
        }
        return torch.from_numpy(session.run([OUTPUT_NAME], feeds)[0])

    return model_fn


def onnx_path(run_dir: Path | None, onnx: Path | None) -> Path:
    """The ONNX file ``geofm predict --engine onnx`` reads: ``--onnx FILE``, else ``RUN/model.onnx``.

    Raises:
        CheckpointNotFoundError: if the file does not exist, naming the command that writes it.
    """
    path = onnx if onnx is not None else Path(run_dir) / ONNX_FILE
    if not path.is_file():
        run = run_dir if run_dir is not None else "RUN"
        where = "" if onnx is None and run_dir is not None else f" --output {path}"
        raise CheckpointNotFoundError(
            f"{path} does not exist: export the run first with `geofm export onnx --model {run}{where}`"
        )
    return path


def load_onnx_predictor(
    run_dir: str | Path | None = None,
    onnx: str | Path | None = None,
    tile: int | None = None,
    threads: int | None = None,
) -> Predictor:
    """An exported model as a :class:`~finetune.predict.Predictor` run by ONNX Runtime.

    Args:
        run_dir: the run it was exported from: its metadata must match the run's (:data:`RUN_FIELDS`).
            None: the file's metadata alone describe it.
        onnx: the ONNX file (default ``RUN/model.onnx``).
        tile: the tile side asked for; it must be the export's.
        threads: ONNX Runtime's intra-op threads (default: its choice).

    Raises:
        CheckpointNotFoundError: no such file (naming ``geofm export onnx``), or a run without kept weights.
        CheckpointFormatError: a file without geofm's metadata.
        DataMismatchError: metadata that differ from the run's, naming the field.
        ConfigError: a tile the export does not take.
        MissingDependencyError: without onnxruntime.
    """
    run_dir = Path(run_dir) if run_dir is not None else None
    path = onnx_path(run_dir, Path(onnx) if onnx is not None else None)
    session = onnx_session(path, threads)
    metadata = decode_metadata(session.get_modelmeta().custom_metadata_map, path)
    if run_dir is not None:
        check_against_run(metadata, run_dir, path)
    if tile is not None and tile != metadata["tile"]:
        raise ConfigError(
            f"--tile {tile}: {path} takes {metadata['tile']} px tiles (its metadata 'tile'); export one for {tile} px "
            f"tiles with geofm export onnx --model RUN --tile {tile} --output OTHER.onnx"
        )
    targets = metadata["target_normalisation"]
    return Predictor(
        onnx_model_fn(session),
        metadata["task"],
        normaliser_from_spec(metadata["normalisation"], path, "normalisation"),
        metadata["tile"],
        scale_factor=metadata["scale_factor"],
        target_normaliser=None if targets is None else normaliser_from_spec(targets, path, "target_normalisation"),
        info={**metadata, "onnx": str(path), "providers": session.get_providers()},
    )
