"""Sliding-window inference over whole GeoTIFF scenes of any size (``geofm predict``).

A scene is cut into ``tile`` x ``tile`` windows every ``tile - overlap`` pixels; windows reaching
past the right or bottom edge are completed by reflection and their outputs cropped back. Each
tile's output is weighted by a separable window, ``w(i) = sin^2(pi (i + 1/2) / tile)`` along each
axis (a Hann window shifted by half a pixel, so strictly positive), and overlapping outputs are
averaged with these weights: tile borders, where a model sees least context, count least, and a
model whose output at a pixel depends on that pixel alone gives exactly that output everywhere
(blending makes no seams). Tiles are batched along a row of tiles.

Memory holds a block, never the scene nor a whole row of it: the scene is predicted in strips of
columns (``strip``, 2048 output pixels by default), left to right, and each strip top to bottom, one
row of tiles at a time: its tiles' window is read (windowed reads), their scores are blended in a
band of ``tile`` rows of the strip, and rows are handed to the output as soon as no later tile
reaches them. Tiles reaching across a strip's edge are predicted for both strips, and each pixel
sums the same tiles' scores in the same order as in one pass over the whole width, so the output
does not depend on the strips. The output writes each completed block (256 rows of a strip) and
makes it durable (:class:`~geofm.data.block_stream.BlockStreamWriter`). GDAL's block cache is held
to a few blocks of a strip and freed memory is given back after each row of tiles, so resident
memory depends on neither the scene's width nor its height. A prediction that is killed or fails
keeps its finished blocks in ``OUT.tif.partial`` (counted in ``OUT.tif.partial.json`` with what is
predicted: inputs, model, tiling, band specs); the same prediction run again continues after them
and writes the same file. Once whole, the partial file is copied to the output as a Cloud-Optimized
GeoTIFF (256 px tiles, overviews: ``mode`` for class maps, ``average`` for images; DEFLATE with a
predictor; :func:`~geofm.data.writers.write_cog`). A finished output records the same in its
metadata, and the same prediction run again leaves it as it is unless ``overwrite``; a different one
replaces it.

A task's ``predicts`` (``geofm/tasks/finetuning/``) says what is written: nothing (classification,
multilabel), a class map, or an image. Outputs keep the input's CRS and transform
(super-resolution: the same origin with the pixel size divided by the scale factor):

* ``segmentation``: class ids, the argmax of the blended scores (a single score channel is a
  logit: class 1 where it is above 0), uint8 (uint16 beyond 255 classes), nodata 255 (65535);
* ``change``: the same from ``model_fn(before, after)``; both scenes must share CRS, transform and size;
* ``superres``: the model's output bands (the high-resolution side's, named in the GeoTIFF's band
  descriptions) at ``scale_factor`` times as many rows and columns, de-normalised to their raw
  units. Where both sides share a scale (the same units), the output has the input's dtype and
  nodata value (or the high-resolution side's configured one); otherwise it is float32 with the
  high-resolution side's nodata value, or NaN.

Input nodata pixels (every band nodata or not finite, as GDAL's dataset mask; for change, in either
date) are nodata in the output.

``finetune.predictor.load_predictor(run_dir) -> Predictor`` turns a finetuned run directory into a
:class:`Predictor` (``geofm predict`` calls it).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from geofm.data.block_stream import (
    BlockStreamWriter,
    claim,
    discard_partial,
    resumable_blocks,
    strip_columns,
    strip_rows_done,
    written_record,
)
from geofm.data.finetune.normalise import BandNormaliser
from geofm.data.readers import RasterInfo, WindowReader, bounded_block_cache, same_grid, scaled_transform
from geofm.data.writers import BLOCK
from geofm.errors import ConfigError, DataMismatchError
from geofm.memory import release_freed_memory
from geofm.runlog import progress_bar
from geofm.tasks import finetune_task

log = logging.getLogger("geofm.finetune")

STRIP = 2048  # output columns predicted at once, by default

ModelFn = Callable[..., Tensor]


@dataclass(frozen=True)
class Predictor:
    """A finetuned model ready for :func:`predict_scene`.

    Attributes:
        model_fn: normalised tiles, float32 (B, C, tile, tile) on the CPU (change: before and
            after, two arguments) -> class scores (B, K, tile, tile), or for ``superres`` normalised
            images (B, C, tile * scale_factor, tile * scale_factor); it moves tiles to its device.
        task: a registered task that predicts (segmentation, change, superres).
        normaliser: the model's band spec: its bands taken by name from the scene's, scale, mean, std, nodata.
        tile: side of the tiles ``model_fn`` takes, in input pixels.
        scale_factor: superres: high / low resolution ratio.
        target_normaliser: superres: the band spec of the outputs, the high-resolution side's
            (default: ``normaliser``).
        info: what else the model was trained with (classes, bands, the kept weights' record...).
    """

    model_fn: ModelFn
    task: str
    normaliser: BandNormaliser
    tile: int
    scale_factor: int = 1
    target_normaliser: BandNormaliser | None = None
    info: dict[str, Any] = field(default_factory=dict)


def blend_weights(size: int) -> np.ndarray:
    """The (size, size) weights of one tile's output: ``sin^2(pi (i + 1/2) / size)`` along each axis."""
    ramp = np.sin(np.pi * (np.arange(size) + 0.5) / size) ** 2
    return np.outer(ramp, ramp).astype(np.float32)


def tile_origins(length: int, tile: int, overlap: int) -> list[int]:
    """Offsets of the tiles along one axis: every ``tile - overlap`` pixels until a tile reaches the end."""
    stride = tile - overlap
    count = -(-max(length - tile, 0) // stride) + 1
    return [k * stride for k in range(count)]


def add_tile[ArrayT: (np.ndarray, Tensor)](
    scores: ArrayT, weight_sum: ArrayT, output: ArrayT, weights: ArrayT, top: int, left: int, height: int, width: int
) -> None:
    """Add the top-left ``height`` x ``width`` of one tile's output (C, size, size), weighted by
    ``weights`` (:func:`blend_weights`), to running sums of scores (C, H, W) and weights (H, W) at
    (``top``, ``left``); the blend is ``scores / weight_sum``. Numpy arrays or torch tensors alike."""
    scores[:, top : top + height, left : left + width] += output[:, :height, :width] * weights[:height, :width]
    weight_sum[top : top + height, left : left + width] += weights[:height, :width]


def _tile(strip: np.ndarray, left: int, tile: int) -> np.ndarray:
    """The tile of a strip starting at column ``left``, completed to tile x tile by reflection."""
    part = strip[:, :, left : left + tile]
    return np.pad(part, ((0, 0), (0, tile - part.shape[1]), (0, tile - part.shape[2])), mode="reflect")


def _scores(out: Tensor, batch: int, size: int, task: str, bands: int | None) -> np.ndarray:
    """The model's outputs as float32 numpy, after checking their shape (``bands``: of an image output)."""
    shape = tuple(out.shape)
    if len(shape) != 4 or shape[0] != batch or shape[2:] != (size, size) or (bands is not None and shape[1] != bands):
        channels = "K" if bands is None else bands
        raise ConfigError(
            f"model_fn returned shape {shape} for {batch} tiles; task {task} expects ({batch}, {channels}, {size}, {size})"
        )
    return out.detach().float().cpu().numpy()


class _Output:
    """Turns blended scores into output pixels and writes them, created once the model's output is known."""

    def __init__(
        self,
        path: Path,
        image: bool,
        normaliser: BandNormaliser,
        targets: BandNormaliser,
        channels: int,
        info: RasterInfo,
        factor: int,
        strip: int,
        record: dict[str, Any],
        resume: bool,
    ) -> None:
        self.image = image
        self.normaliser = targets
        self.factor = factor
        descriptions = None
        if image:
            same_units = targets.scale == normaliser.scale
            self.dtype = np.dtype(info.dtype if same_units else np.float32)
            out_nodata = targets.nodata
            if out_nodata is None and same_units:
                out_nodata = normaliser.nodata_for(info.nodata)
            self.fill = out_nodata if out_nodata is not None else (np.nan if self.dtype.kind == "f" else None)
            count, descriptions = channels, targets.bands
        else:
            self.dtype = np.dtype(np.uint8 if max(channels, 2) <= 255 else np.uint16)
            self.fill = out_nodata = int(np.iinfo(self.dtype).max)
            count = 1
        self.writer = BlockStreamWriter(
            path,
            width=info.width * factor,
            height=info.height * factor,
            count=count,
            dtype=self.dtype,
            crs=info.crs,
            transform=scaled_transform(info.transform, factor),
            record=record,
            nodata=out_nodata,
            descriptions=descriptions,
            strip=strip,
            resume=resume,
            overview_resampling="average" if image else "mode",
        )

    def write(self, scores: np.ndarray, weights: np.ndarray, valid: np.ndarray, row_off: int, col_off: int) -> None:
        """Hand over blended rows of the strip starting at input column ``col_off``: ``scores`` and ``weights``
        summed over tiles, ``valid`` at input resolution."""
        blended = scores / weights[None]
        if self.image:
            pixels = self.normaliser.denormalise(blended)
            if self.dtype.kind in "iu":
                limits = np.iinfo(self.dtype)
                pixels = np.clip(np.round(pixels), limits.min, limits.max)
        else:
            pixels = (blended[0] > 0)[None] if len(blended) == 1 else blended.argmax(axis=0)[None]
        pixels = pixels.astype(self.dtype)
        if self.fill is not None:
            invalid = ~valid.repeat(self.factor, axis=0).repeat(self.factor, axis=1)
            pixels[:, invalid] = self.fill
        self.writer.append(pixels, row_off * self.factor, col_off * self.factor)


def band_spec(normaliser: BandNormaliser) -> dict[str, Any]:
    """A band spec as a record: what it takes from a scene and how it normalises it."""
    return {
        "dataset_bands": normaliser.dataset_bands,
        "bands": normaliser.bands,
        "scale": normaliser.scale,
        "mean": normaliser.mean.ravel().tolist(),
        "std": normaliser.std.ravel().tolist(),
        "nodata": normaliser.nodata,
    }


def _prediction_record(
    inputs: Sequence[Path],
    *,
    task: str,
    model_id: Any,
    normaliser: BandNormaliser,
    targets: BandNormaliser,
    tile: int,
    overlap: int,
    scale_factor: int,
) -> dict[str, Any]:
    """What a prediction predicts, as its output records it: the inputs (path, size, modification
    time), the model (``model_id``), task, tiling and band specs, as JSON reads them back (paths and
    other objects in ``model_id`` as strings). Equal records, equal outputs."""
    scenes = [{"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in inputs]
    record = {
        "task": task,
        "inputs": scenes,
        "model": model_id,
        "tile": tile,
        "overlap": overlap,
        "scale_factor": scale_factor,
        "bands": band_spec(normaliser),
        "targets": band_spec(targets),
    }
    return json.loads(json.dumps(record, default=str))


def _cache_mib(readers: Sequence[WindowReader], columns: int) -> int:
    """GDAL block cache for a prediction: two 256-row blocks of ``columns`` of every input, and 32 MiB more."""
    row = sum(r.info.count * columns * np.dtype(r.info.dtype).itemsize * BLOCK for r in readers)
    return 32 + -(-2 * row // 2**20)


def _default_strip(tile: int, factor: int) -> int:
    """Output columns of a strip: :data:`STRIP`, or four tiles if more, in whole output blocks and input pixels."""
    unit = math.lcm(BLOCK, factor)
    return unit * max(-(-STRIP // unit), -(-4 * tile * factor // unit))


def predict_scene(
    model_fn: ModelFn,
    input_path: str | Path | Sequence[str | Path],
    output_path: str | Path,
    *,
    task: str,
    normaliser: BandNormaliser,
    tile: int = 256,
    overlap: int | None = None,
    batch_size: int = 8,
    scale_factor: int = 1,
    target_normaliser: BandNormaliser | None = None,
    progress: bool = True,
    model_id: Any = None,
    overwrite: bool = False,
    strip: int | None = None,
) -> Path:
    """Run a model over a whole scene in overlapping tiles and write its prediction as a Cloud-Optimized GeoTIFF.

    Args:
        model_fn: see :class:`Predictor`.
        input_path: the scene; for ``change`` the pair ``(before, after)``.
        output_path: the GeoTIFF to write.
        task: a registered task that ``predicts`` (segmentation, change, superres).
        normaliser: the model's band spec (bands, scale, mean, std, nodata).
        tile: side of the tiles the model sees, in input pixels.
        overlap: pixels shared by neighbouring tiles, below ``tile`` (default: a quarter of ``tile``).
        batch_size: tiles per model call.
        scale_factor: superres: high / low resolution ratio.
        target_normaliser: superres: the band spec of the outputs (default: ``normaliser``).
        progress: show a progress bar over tiles.
        model_id: what identifies the model in the output's record (JSON-serialisable, e.g. its run
            directory and kept weights): an interrupted prediction continues, and a finished one is
            kept, only for the same model.
        overwrite: predict again from the start, whatever a finished or interrupted output holds.
        strip: output columns predicted at once, a multiple of 256 and of ``scale_factor`` (default:
            2048, or four tiles if more); memory grows with it, and tiles reaching across a strip's edge
            are predicted once per strip.

    Returns:
        The output path.

    Raises:
        ConfigError: for invalid tiling arguments, an unknown task, or model outputs of the wrong shape.
        DataMismatchError: if before and after differ in CRS, transform or size.
        OutputPathError: if another process writes the output, if it is an input, if it is an existing
            file that holds no geofm output and not ``overwrite``, or if an interrupted output of the
            same prediction cannot be continued.
        RasterReadError: if an input cannot be read or has other bands than ``normaliser.dataset_bands``.
    """
    spec = finetune_task(task)
    if spec.predicts is None:
        raise ConfigError(
            f"geofm predict writes per-pixel outputs (class maps, images), not {task!r}: its model has none"
        )
    writes_image = spec.predicts == "image"
    overlap = tile // 4 if overlap is None else overlap
    if tile <= 0 or not 0 <= overlap < tile or batch_size <= 0:
        raise ConfigError(
            f"need tile > 0, 0 <= overlap < tile and batch size > 0, got tile {tile}, overlap {overlap}, "
            f"batch size {batch_size}"
        )
    inputs = [Path(input_path)] if isinstance(input_path, (str, Path)) else [Path(p) for p in input_path]
    if len(inputs) != len(spec.inputs):
        raise ConfigError(f"task {task} takes {spec.scenes}, got {len(inputs)}")
    factor = scale_factor if writes_image else 1
    targets = target_normaliser or normaliser
    if factor < 1:
        raise ConfigError(f"scale factor must be a positive integer, got {scale_factor}")
    if strip is not None and (strip <= 0 or strip % math.lcm(BLOCK, factor)):
        raise ConfigError(f"strip {strip}: expected a positive multiple of {math.lcm(BLOCK, factor)} output columns")
    output_path = Path(output_path)

    with ExitStack() as stack:
        stack.enter_context(claim(output_path, inputs, overwrite))
        bands = normaliser.dataset_bands
        readers = [stack.enter_context(WindowReader(p, len(bands), bands)) for p in inputs]
        info = readers[0].info
        if len(readers) == 2 and (difference := same_grid(info, readers[1].info)) is not None:
            raise DataMismatchError(
                f"{inputs[0]} and {inputs[1]}: the before and after scenes differ in {difference}; "
                "they must share CRS, transform and size"
            )
        record = _prediction_record(
            inputs,
            task=task,
            model_id=model_id,
            normaliser=normaliser,
            targets=targets,
            tile=tile,
            overlap=overlap,
            scale_factor=factor,
        )
        if not overwrite and written_record(output_path) == record:
            log.info("%s already holds this prediction; overwrite (--overwrite) predicts it again", output_path)
            discard_partial(output_path, record)
            return output_path
        height, width = info.height, info.width
        out_strip = strip_columns(width * factor, height * factor, strip or _default_strip(tile, factor))
        columns = out_strip // factor
        stack.enter_context(bounded_block_cache(_cache_mib(readers, min(width, columns + tile))))
        rows, cols = tile_origins(height, tile, overlap), tile_origins(width, tile, overlap)
        blocks = 0 if overwrite else resumable_blocks(output_path, record, out_strip)
        if blocks:
            log.info("%s: continuing after its first %d finished blocks", output_path, blocks)
        strips = []  # (first column, end column, tiles' left columns, first row of tiles to predict)
        for left in range(0, width, columns):
            end = min(left + columns, width)
            finished = strip_rows_done(blocks, left // columns, width * factor, height * factor) // factor
            if finished < height:
                first = next(r for r, top in enumerate(rows) if top + tile > finished)
            else:  # skipped; the last strip's last row of tiles finishes a file killed before it was closed
                first = len(rows) - 1 if end == width else len(rows)
            strips.append((left, end, [c for c in cols if c < end and c + tile > left], first))
        total = sum(len(rows) * len(lefts) for _, _, lefts, _ in strips)
        skipped = sum(first * len(lefts) for _, _, lefts, first in strips)
        bar = stack.enter_context(progress_bar(total, skipped, progress, output_path.name, unit="tile"))
        size = tile * factor
        weights = blend_weights(size)
        output: _Output | None = None
        for left, end, lefts, first in strips:
            scores: np.ndarray | None = None
            weight_sum = np.zeros((size, (end - left) * factor), dtype=np.float32)
            read_from, read_to = lefts[0], min(lefts[-1] + tile, width)
            for r in range(first, len(rows)):
                top = rows[r]
                rows_read = min(tile, height - top)
                images, valid = [], np.ones((rows_read, read_to - read_from), dtype=bool)
                for reader in readers:
                    window = reader.read(top, read_from, rows_read, read_to - read_from)
                    image, band_valid = normaliser(window, reader.info.nodata, reader.path)
                    images.append(image.numpy())
                    valid &= band_valid.numpy().any(axis=0)
                for start in range(0, len(lefts), batch_size):
                    batch = lefts[start : start + batch_size]
                    tiles = [np.stack([_tile(image, c - read_from, tile) for c in batch]) for image in images]
                    with torch.inference_mode():
                        out = _scores(
                            model_fn(*map(torch.from_numpy, tiles)),
                            len(batch),
                            size,
                            task,
                            len(targets.bands) if writes_image else None,
                        )
                    if output is None:
                        output = _Output(
                            output_path,
                            writes_image,
                            normaliser,
                            targets,
                            out.shape[1],
                            info,
                            factor,
                            out_strip,
                            record,
                            not overwrite,
                        )
                        stack.enter_context(output.writer)  # the scene's GeoTIFF appears only once it is whole
                    if scores is None:
                        scores = np.zeros((out.shape[1], size, (end - left) * factor), dtype=np.float32)
                    for b, c in enumerate(batch):  # the part of each tile inside the strip
                        cut, w = (max(left - c, 0)) * factor, (min(c + tile, end) - max(c, left)) * factor
                        at = (max(c, left) - left) * factor
                        add_tile(scores, weight_sum, out[b][:, :, cut:], weights[:, cut:], 0, at, rows_read * factor, w)
                    bar.update(len(batch))
                final = rows[r + 1] - top if r + 1 < len(rows) else rows_read
                done = final * factor
                output.write(
                    scores[:, :done], weight_sum[:done], valid[:final, left - read_from : end - read_from], top, left
                )
                scores[:, :-done], scores[:, -done:] = scores[:, done:].copy(), 0.0
                weight_sum[:-done], weight_sum[-done:] = weight_sum[done:].copy(), 0.0
                release_freed_memory()
    return output_path
