"""What a pretrained model reconstructs: a figure of a few fixed chips, masked, reconstructed and whole.

Each row is one chip: its input in natural colour with the masked patches greyed, the model's
reconstruction (the decoder's output, the very output the loss compares, in the masked patches;
the visible pixels as they were) and the target. The chips are the same at every drawing
(:func:`geofm.data.pile.shown_samples`), so figures of one run show the model's progress. Values are
the sources' scaled units (raw x ``scale``, reflectance for most products), stretched per chip
between the 2nd and 98th percentiles of the target's valid pixels; pixels without data are black.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import default_collate

from geofm.data.pile import PretrainPile, shown_samples
from geofm.runlog import figure
from geofm.tasks.mim.model import MaskedImageModel

RECONSTRUCTION_FIGURE = "reconstruction.png"
SHOWN_CHIPS = 4
"""Rows of the figure: chips drawn from the sources in turn."""
MASK_GREY, MASK_BLEND = 0.5, 0.75
"""Masked patches of the input are blended three quarters of the way to mid grey."""
FIGURE_WIDTH, MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 7.0, 0.45, 0.1, 0.75, 0.1
"""The figure's width and margins around its panels, in inches (row labels left, titles above)."""


@dataclass(frozen=True)
class ReconstructionPanels:
    """A batch of chips as the figure shows them, in the sources' scaled units, all (N, C, H, W) but
    ``masked`` (N, H, W).

    Attributes:
        target: the chips the model sees unmasked.
        reconstruction: the decoder's output in masked pixels, the target in visible ones.
        masked: True where the pixel lies in a masked patch.
        valid: False where a pixel or band holds no data.
        names: one label per chip (source, then file or scene and window).
    """

    target: Tensor
    reconstruction: Tensor
    masked: Tensor
    valid: Tensor
    names: list[str]


def shown_chips(pile: PretrainPile, seed: int, count: int = SHOWN_CHIPS) -> dict:
    """The collated batch of ``count`` fixed chips of ``pile`` (needs a pile with a ``mask_fn``)."""
    indices = shown_samples(pile.source_sizes, count, seed)
    batch = default_collate([pile[index] for index in indices])
    batch["names"] = [
        f"{pile.sources[i.source].name}: {pile.sources[i.source].chip_label(pile.sources[i.source].chips[i.file])}"
        for i in indices
    ]
    return batch


@torch.no_grad()
def reconstruction_panels(model: MaskedImageModel, pile: PretrainPile, batch: dict) -> ReconstructionPanels:
    """Run ``model`` (in eval mode, on its own device and dtype) on a batch of ``pile``'s chips and
    return what the figure shows: the reconstruction combines the decoder's output in masked pixels
    with the input in visible ones, each denormalised with its chip's source."""
    param = next(model.parameters())
    training = model.training
    model.eval()
    try:
        decoded, _ = model.reconstruct(batch["image"].to(param.device, param.dtype), batch["mask"].to(param.device))
    finally:
        model.train(training)
    images = batch["image"].float()
    masked = model.pixel_mask(batch["mask"]).bool()
    reconstruction = torch.where(masked, decoded.float().cpu(), images)
    denormalise = [pile.sources[int(s)].denormalise for s in batch["source"]]
    return ReconstructionPanels(
        target=torch.stack([d(image) for d, image in zip(denormalise, images, strict=True)]),
        reconstruction=torch.stack([d(image) for d, image in zip(denormalise, reconstruction, strict=True)]),
        masked=masked[:, 0],
        valid=batch["valid"].bool(),
        names=list(batch["names"]),
    )


def display_bands(bands: list[str]) -> list[int]:
    """Indices of the bands drawn: red, green and blue when the model has all three, else its first
    three bands, else its first band alone (drawn in grey)."""
    if {"red", "green", "blue"} <= set(bands):
        return [bands.index(b) for b in ("red", "green", "blue")]
    return [0, 1, 2] if len(bands) >= 3 else [0]


def percentile_stretch(values: np.ndarray, valid: np.ndarray, low: float = 2, high: float = 98) -> tuple[float, float]:
    """The ``low`` and ``high`` percentiles of ``values`` where ``valid`` (0 and 1 without a valid value)."""
    if not valid.any():
        return 0.0, 1.0
    lo, hi = (float(v) for v in np.percentile(values[valid], [low, high]))
    return lo, max(hi, lo + 1e-6)


def _colours(image: np.ndarray, valid: np.ndarray, stretch: tuple[float, float]) -> np.ndarray:
    """(H, W, 3) colours in [0, 1] of the drawn bands (C, H, W); pixels missing any of them are black."""
    lo, hi = stretch
    rgb = np.clip((image - lo) / (hi - lo), 0.0, 1.0)
    rgb = np.repeat(rgb, 3, axis=0) if len(rgb) == 1 else rgb
    rgb = rgb.transpose(1, 2, 0)
    rgb[~valid.all(axis=0)] = 0.0
    return rgb


def reconstruction_mosaic(panels: ReconstructionPanels, bands: list[str]) -> np.ndarray:
    """The figure's pixels, (rows x (H + gap) - gap, 3 x (W + gap) - gap, 3) colours in [0, 1] on
    white: per chip the masked input, the reconstruction and the target, one stretch for all three."""
    shown = display_bands(bands)
    rows, _, height, width = panels.target.shape
    gap = _gap(width)
    mosaic = np.ones((rows * (height + gap) - gap, 3 * (width + gap) - gap, 3), dtype=np.float32)
    for row in range(rows):
        target = panels.target[row, shown].numpy()
        valid = panels.valid[row, shown].numpy()
        stretch = percentile_stretch(target, valid)
        masked_input = _colours(target, valid, stretch)
        greyed = panels.masked[row].numpy() & valid.all(axis=0)
        masked_input[greyed] = (1 - MASK_BLEND) * masked_input[greyed] + MASK_BLEND * MASK_GREY
        reconstruction = _colours(panels.reconstruction[row, shown].numpy(), valid, stretch)
        top = row * (height + gap)
        for column, image in enumerate((masked_input, reconstruction, _colours(target, valid, stretch))):
            left = column * (width + gap)
            mosaic[top : top + height, left : left + width] = image
    return mosaic


def _gap(width: int) -> int:
    """White pixels between two panels of ``width`` pixels."""
    return max(2, width // 16)


def figure_size(rows: int, height: int, width: int) -> tuple[float, float]:
    """The figure's size in inches for ``rows`` chips of ``height`` x ``width`` pixels."""
    gap = _gap(width)
    aspect = (rows * (height + gap) - gap) / (3 * (width + gap) - gap)
    return FIGURE_WIDTH, (FIGURE_WIDTH - MARGIN_LEFT - MARGIN_RIGHT) * aspect + MARGIN_TOP + MARGIN_BOTTOM


def draw_reconstructions(panels: ReconstructionPanels, bands: list[str], path: Path, title: str = "") -> None:
    """Write the figure as a PNG: one row per chip, columns masked input, reconstruction, target.

    One image of all panels (:func:`reconstruction_mosaic`) with its labels: drawing a dozen axes
    takes several times longer, paid at every checkpoint.
    """
    mosaic = reconstruction_mosaic(panels, bands)
    rows, _, height, width = panels.target.shape
    gap = _gap(width)
    fig_width, fig_height = figure_size(rows, height, width)
    fig = figure(fig_width, fig_height)
    ax = fig.add_axes(
        (
            MARGIN_LEFT / fig_width,
            MARGIN_BOTTOM / fig_height,
            1 - (MARGIN_LEFT + MARGIN_RIGHT) / fig_width,
            1 - (MARGIN_TOP + MARGIN_BOTTOM) / fig_height,
        )
    )
    ax.imshow(mosaic, interpolation="nearest")
    ax.set_axis_off()
    for column, label in enumerate(("input, masked patches grey", "reconstruction", "target")):
        ax.text(column * (width + gap) + width / 2, -gap, label, ha="center", va="bottom", fontsize=9)
    for row, name in enumerate(panels.names):
        source, _, file = name.partition(": ")
        centre = row * (height + gap) + height / 2
        ax.text(-gap, centre, f"{source}\n{file}", rotation=90, ha="right", va="center", fontsize=7)
    drawn = "/".join(bands[i] for i in display_bands(bands))
    fig.suptitle(
        f"{title}\n{drawn}, 2-98% stretch per chip; black: no data", fontsize=9, y=1 - 0.08 / fig_height, va="top"
    )
    fig.savefig(path)


def write_reconstruction_figure(
    model: MaskedImageModel, pile: PretrainPile, batch: dict, bands: list[str], run_dir: Path
) -> Path:
    """Draw ``batch`` (see :func:`shown_chips`) through ``model`` into ``run_dir``'s reconstruction figure."""
    path = run_dir / RECONSTRUCTION_FIGURE
    draw_reconstructions(reconstruction_panels(model, pile, batch), bands, path, run_dir.name)
    return path


def print_reconstruction_figure(run_dir: Path) -> None:
    """Print ``reconstruction figure: PATH`` when the run in ``run_dir`` drew one."""
    path = run_dir / RECONSTRUCTION_FIGURE
    if path.exists():
        print(f"reconstruction figure: {path}")
