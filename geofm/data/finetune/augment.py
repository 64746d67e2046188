"""Views of downstream scenes: random training crops and the deterministic views of evaluation.

Training: classification scenes get a RandomResizedCrop to ``img_size`` and flips; dense scenes
(segmentation, change) a random ``img_size`` crop and flips with the same geometry for every image
and the mask; super-resolution pairs a random ``img_size`` crop of the low-resolution image and the
high-resolution crop of the same area (``scale_factor`` times the size, at ``scale_factor`` times
the offset), flipped together. Evaluation: classification scenes are resized whole to
``img_size``; dense scenes are cut into a grid of ``img_size`` tiles (:func:`geofm.data.grid.grid_origins`).
Scenes smaller than ``img_size`` are padded: images with 0 (the mean), masks with the value that is
never trained on or scored (``data.ignore_index``, or -100 without one), super-resolution targets
with NaN, which the loss and the metrics leave out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision import tv_tensors
from torchvision.transforms import v2

from geofm.config.finetune import PADDING_LABEL
from geofm.data.transforms import random_flips

_IMAGES = ("image", "image1", "image2")


def _pad_to(tensor: Tensor, height: int, width: int, fill: float) -> Tensor:
    """Pad the last two dimensions at the bottom and right up to ``height`` x ``width``."""
    pad_h, pad_w = max(0, height - tensor.shape[-2]), max(0, width - tensor.shape[-1])
    if not pad_h and not pad_w:
        return tensor
    return F.pad(tensor, (0, pad_w, 0, pad_h), value=fill)


def crop_tile(
    sample: dict[str, Tensor], top: int, left: int, size: int, factor: int = 1, mask_fill: int = PADDING_LABEL
) -> dict[str, Tensor]:
    """The ``size`` x ``size`` tile at ``(top, left)`` of every image and mask of a sample.

    ``target`` (super-resolution) is cut at ``factor`` times the offset and size. Tiles reaching
    past a smaller scene are padded (see the module docstring).
    """
    tile = {}
    for key, value in sample.items():
        scale = factor if key == "target" else 1
        fill = {"mask": mask_fill, "target": float("nan")}.get(key, 0.0)
        part = value[..., top * scale : (top + size) * scale, left * scale : (left + size) * scale]
        tile[key] = _pad_to(part, size * scale, size * scale, fill)
    return tile


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


class DenseAugmentation:
    """A random ``img_size`` crop and flips, with one geometry for every image and the mask of a sample."""

    def __init__(self, img_size: int, hflip: bool = True, vflip: bool = True, mask_fill: int = PADDING_LABEL) -> None:
        """Initialise a new DenseAugmentation instance.

        Args:
            img_size: side of the crop.
            hflip: flip left-right with probability 0.5.
            vflip: flip top-bottom with probability 0.5.
            mask_fill: mask value of padding where a scene is smaller than the crop.
        """
        crop = v2.RandomCrop(img_size, pad_if_needed=True, fill={tv_tensors.Image: 0.0, tv_tensors.Mask: mask_fill})
        self.transform = v2.Compose([crop, *random_flips(hflip, vflip)])

    def __call__(self, sample: dict[str, Tensor]) -> dict[str, Tensor]:
        """The sample's images (``image`` or ``image1``/``image2``) and ``mask``, cropped and flipped alike."""
        keys = [k for k in _IMAGES if k in sample]
        wrapped = {k: tv_tensors.Image(sample[k]) for k in keys}
        wrapped["mask"] = tv_tensors.Mask(sample["mask"])
        out = self.transform(wrapped)
        return {k: v.as_subclass(Tensor) for k, v in out.items()}


class SuperresAugmentation:
    """An aligned random crop of a (low, high) resolution pair and flips of both.

    The low-resolution crop is ``img_size`` at a random offset; the high-resolution crop covers the
    same area. torchvision's crops need equal sizes in one call, hence the offsets drawn here.
    """

    def __init__(self, img_size: int, factor: int, hflip: bool = True, vflip: bool = True) -> None:
        """Initialise a new SuperresAugmentation instance.

        Args:
            img_size: side of the low-resolution crop.
            factor: high / low resolution ratio.
            hflip: flip left-right with probability 0.5.
            vflip: flip top-bottom with probability 0.5.
        """
        self.size = img_size
        self.factor = factor
        self.hflip = hflip
        self.vflip = vflip

    def __call__(self, sample: dict[str, Tensor]) -> dict[str, Tensor]:
        """The sample's ``image`` and ``target``, cropped at one place and flipped alike."""
        height, width = sample["image"].shape[-2:]
        top = int(torch.randint(0, max(height - self.size, 0) + 1, ()))
        left = int(torch.randint(0, max(width - self.size, 0) + 1, ()))
        out = crop_tile(sample, top, left, self.size, self.factor)
        for enabled, dim in ((self.hflip, -1), (self.vflip, -2)):
            if enabled and torch.rand(()) < 0.5:
                out = {k: v.flip(dim) for k, v in out.items()}
        return out
