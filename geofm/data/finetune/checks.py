"""Checks of one sample's files against each other and the config, with errors naming the files."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from geofm.errors import DataMismatchError

_CHANGE = 255


def _listed(values: np.ndarray, limit: int = 10) -> str:
    values = [int(v) for v in values[:limit]]
    return ", ".join(map(str, values)) + (" ..." if len(values) == limit else "")


def check_same_size(image_hw: tuple[int, int], other_hw: tuple[int, int], what: str, where: str) -> None:
    """Refuse a mask (or second image) whose height and width differ from the image's.

    Raises:
        DataMismatchError: naming ``where`` and both sizes.
    """
    if tuple(image_hw) != tuple(other_hw):
        raise DataMismatchError(
            f"{where}: the {what} is {other_hw[0]}x{other_hw[1]} pixels, the image {image_hw[0]}x{image_hw[1]}"
        )


def class_mask(mask: np.ndarray | Tensor, num_classes: int | None, ignore_index: int | None, where: str) -> Tensor:
    """A segmentation mask as int64 (H, W), checked against the configured classes.

    Args:
        mask: class ids, shape (H, W) or (1, H, W).
        num_classes: ids must lie in ``[0, num_classes)``; None: no upper bound.
        ignore_index: a value allowed besides the class ids (unlabeled pixels).
        where: the file or sample, for the error message.

    Raises:
        DataMismatchError: naming ``where`` and the values outside the classes.
    """
    mask = torch.as_tensor(np.asarray(mask)).to(torch.int64)
    if mask.ndim == 3 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.ndim != 2:
        raise DataMismatchError(f"{where}: expected a single-band mask, got shape {tuple(mask.shape)}")
    values = torch.unique(mask).numpy()
    bad = values[(values < 0) | ((values >= num_classes) if num_classes is not None else False)]
    if ignore_index is not None:
        bad = bad[bad != ignore_index]
    if len(bad):
        allowed = f"0..{num_classes - 1}" if num_classes is not None else "non-negative ids"
        extra = f" or ignore_index {ignore_index}" if ignore_index is not None else ""
        raise DataMismatchError(f"{where}: mask values {_listed(bad)} are outside the classes {allowed}{extra}")
    return mask


def change_mask(mask: np.ndarray | Tensor, ignore_index: int | None, where: str) -> Tensor:
    """A change mask as int64 (H, W) in {0, 1}: 0 no change; 1 or 255 change (LEVIR-CD's 0/255 PNGs).

    ``ignore_index`` is kept as it is; when it is 255, 255 means unlabeled rather than change.

    Raises:
        DataMismatchError: naming ``where`` and any other value.
    """
    mask = class_mask(mask, None, ignore_index, where)
    allowed = {0, 1, _CHANGE} | ({ignore_index} if ignore_index is not None else set())
    values = torch.unique(mask).numpy()
    bad = np.array([v for v in values if int(v) not in allowed])
    if len(bad):
        extra = f", ignore_index {ignore_index}" if ignore_index is not None else ""
        raise DataMismatchError(
            f"{where}: change mask values {_listed(bad)} are none of 0 (no change), 1 or 255 (change){extra}"
        )
    if ignore_index != _CHANGE:
        mask = torch.where(mask == _CHANGE, 1, mask)
    return mask


def class_label(label: int | Tensor, num_classes: int | None, where: str) -> Tensor:
    """A classification label as an int64 scalar, checked against ``[0, num_classes)``.

    Raises:
        DataMismatchError: naming ``where`` and the label.
    """
    label = torch.as_tensor(label).to(torch.int64).reshape(())
    if label < 0 or (num_classes is not None and label >= num_classes):
        raise DataMismatchError(f"{where}: class id {int(label)} is outside the classes 0..{(num_classes or 0) - 1}")
    return label


def multi_hot(label: np.ndarray | Tensor, num_classes: int | None, where: str) -> Tensor:
    """A multi-label target as float32 (num_classes,) of 0/1.

    Raises:
        DataMismatchError: naming ``where`` if the length is not ``num_classes`` or a value is not 0 or 1.
    """
    label = torch.as_tensor(np.asarray(label)).reshape(-1)
    if num_classes is not None and label.numel() != num_classes:
        raise DataMismatchError(f"{where}: {label.numel()} labels for num_classes {num_classes}")
    if not bool(((label == 0) | (label == 1)).all()):
        raise DataMismatchError(
            f"{where}: multi-label values must be 0 or 1, got {_listed(torch.unique(label).numpy())}"
        )
    return label.to(torch.float32)


def superres_extent(
    lr_hw: tuple[int, int], hr_hw: tuple[int, int], factor: int, trim: bool, where: str
) -> tuple[int, int]:
    """The low-resolution height and width a pair is used at (the high-resolution side is factor times it).

    Args:
        lr_hw: height and width of the low-resolution image.
        hr_hw: height and width of the high-resolution image.
        factor: the configured scale factor.
        trim: accept a high-resolution side off by less than ``factor`` pixels, and crop both
            images to the largest exact fit.
        where: the files of the pair, for the error message.

    Raises:
        DataMismatchError: naming ``where``, both sizes and the scale factor.
    """
    exact = all(hi == lo * factor for lo, hi in zip(lr_hw, hr_hw, strict=False))
    if exact:
        return tuple(lr_hw)
    close = all(abs(hi - lo * factor) < factor for lo, hi in zip(lr_hw, hr_hw, strict=False))
    if trim and close:
        return tuple(min(lo, hi // factor) for lo, hi in zip(lr_hw, hr_hw, strict=False))
    hint = "" if trim or not close else " (data.superres_trim crops such pairs to the largest exact fit)"
    raise DataMismatchError(
        f"{where}: high resolution {hr_hw[0]}x{hr_hw[1]} is not scale_factor {factor} x low resolution "
        f"{lr_hw[0]}x{lr_hw[1]} (expected {lr_hw[0] * factor}x{lr_hw[1] * factor}){hint}"
    )
