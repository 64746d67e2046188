"""Views of downstream scenes: random training crops and the deterministic views of evaluation.

Training: classification scenes get a RandomResizedCrop to ``img_size`` and flips; dense scenes
(segmentation, change, super-resolution) a random ``img_size`` crop of a scene or of a window of it
(:func:`random_crop`), read by window, and flips with the same geometry for every image and the
mask; the high-resolution target of super-resolution is the crop of the same area, at
``scale_factor`` times the size. Evaluation: classification scenes are resized whole to
``img_size``; dense scenes are cut into a grid of ``img_size`` tiles (:func:`geofm.data.grid.grid_origins`).
Scenes smaller than ``img_size`` are padded (:func:`fit_tile`): images with 0 (the mean), masks
with the value that is never trained on or scored (``data.ignore_index``, or -100 without one),
super-resolution targets with NaN, which the loss and the metrics leave out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision import tv_tensors
from torchvision.transforms import v2

from geofm.data.grid import Window
from geofm.data.transforms import random_flips


def fit_tile(part: dict[str, Tensor], top: int, left: int, size: int, mask_fill: int) -> dict[str, Tensor]:
    """A ``size`` x ``size`` tile of every image and mask, holding ``part`` at ``(top, left)`` and padded around it.

    ``target`` (super-resolution), at ``f`` times the image's size in ``part``, is fitted at ``f``
    times the offsets and size. Padding is 0 in images, ``mask_fill`` in masks (the config's
    ``data.unscored_label``), NaN in targets.
    """
    factor = part["target"].shape[-1] // part["image"].shape[-1] if "target" in part else 1
    tile = {}
    for key, value in part.items():
        f = factor if key == "target" else 1
        fill = {"mask": mask_fill, "target": float("nan")}.get(key, 0.0)
        bottom, right = size * f - top * f - value.shape[-2], size * f - left * f - value.shape[-1]
        tile[key] = (
            F.pad(value, (left * f, right, top * f, bottom), value=fill) if top or left or bottom or right else value
        )
    return tile


def random_crop(area: Window, size: int) -> tuple[Window, int, int]:
    """A ``size`` x ``size`` crop at a random place over ``area``: inside it along a side where it is
    longer than ``size``, holding it at a random offset where it is shorter.

    Returns:
        The part of ``area`` the crop covers, and where that part lies in the crop (row, column).
        Randomness comes from torch's global generator.
    """
    placed = []
    for start, length in ((area.row, area.height), (area.col, area.width)):
        shift = int(torch.randint(0, abs(length - size) + 1, ()))
        placed.append((start + shift, size, 0) if length >= size else (start, length, shift))
    (row, height, top), (col, width, left) = placed
    return Window(row, col, height, width), top, left


def flip_randomly(sample: dict[str, Tensor], hflip: bool, vflip: bool) -> dict[str, Tensor]:
    """Every image and mask of a sample flipped left-right and top-bottom alike, each with probability 0.5 if enabled."""
    for enabled, dim in ((hflip, -1), (vflip, -2)):
        if enabled and torch.rand(()) < 0.5:
            sample = {k: v.flip(dim) for k, v in sample.items()}
    return sample


class ClassificationView:
    """Training: RandomResizedCrop to ``img_size`` and flips; evaluation: the whole scene resized to ``img_size``.

    Resampling is bilinear with antialiasing; randomness comes from torch's global generator.
    """

    def __init__(
        self,
        img_size: int,
        train: bool,
        crop_scale: tuple[float, float] = (0.5, 1.0),
        hflip: bool = True,
        vflip: bool = True,
    ) -> None:
        """Initialise a new ClassificationView instance.

        Args:
            img_size: side of the output.
            train: random crops and flips (True) or a deterministic resize (False).
            crop_scale: range of the crop's area as a fraction of the scene's.
            hflip: flip left-right with probability 0.5 in training.
            vflip: flip top-bottom with probability 0.5 in training.
        """
        bilinear = v2.InterpolationMode.BILINEAR
        if train:
            crop = v2.RandomResizedCrop(img_size, scale=crop_scale, interpolation=bilinear, antialias=True)
            ops = [crop, *random_flips(hflip, vflip)]
        else:
            ops = [v2.Resize((img_size, img_size), interpolation=bilinear, antialias=True)]
        self.transform = v2.Compose(ops)

    def __call__(self, sample: dict[str, Tensor]) -> dict[str, Tensor]:
        """The sample with its ``image`` transformed."""
        return {**sample, "image": self.transform(tv_tensors.Image(sample["image"])).as_subclass(Tensor)}
