"""Augmentation for masked-image pretraining."""

from __future__ import annotations

from torch import Tensor
from torchvision import tv_tensors
from torchvision.transforms import v2


def random_flips(hflip: bool, vflip: bool) -> list[v2.Transform]:
    """Left-right and top-bottom flips with probability 0.5, each where asked for."""
    return ([v2.RandomHorizontalFlip()] if hflip else []) + ([v2.RandomVerticalFlip()] if vflip else [])


def crop_and_flips(size: int, scale: tuple[float, float], hflip: bool, vflip: bool) -> list[v2.Transform]:
    """A random resized crop to ``size`` (bilinear, antialiased) of ``scale`` of the area, then the flips."""
    crop = v2.RandomResizedCrop(size, scale=scale, interpolation=v2.InterpolationMode.BILINEAR, antialias=True)
    return [crop, *random_flips(hflip, vflip)]


class PretrainAugmentation:
    """Random resized crop and flips, applied with the same geometry to an image and its valid mask.

    The image is resampled bilinearly with antialiasing, the valid mask by nearest neighbour.
    Randomness comes from torch's global generator; seed it to reproduce a sample.
    """

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.67, 1.0),
        hflip: bool = True,
        vflip: bool = True,
    ) -> None:
        """Initialise a new PretrainAugmentation instance.

        Args:
            size: side of the square output, in pixels.
            scale: range of the crop's area as a fraction of the image's area.
            hflip: flip left-right with probability 0.5.
            vflip: flip top-bottom with probability 0.5.
        """
        self.transform = v2.Compose(crop_and_flips(size, scale, hflip, vflip))

    def __call__(self, image: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Transform an image and its valid mask.

        Args:
            image: float tensor of shape (C, H, W).
            valid: bool tensor of shape (C, H, W), True where ``image`` holds data.

        Returns:
            The transformed image (C, size, size) and valid mask (C, size, size), as plain tensors.
        """
        out_image, out_valid = self.transform(tv_tensors.Image(image), tv_tensors.Mask(valid))
        return out_image.as_subclass(Tensor), out_valid.as_subclass(Tensor)
