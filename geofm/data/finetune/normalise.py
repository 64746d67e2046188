"""Band selection and normalisation of downstream images: the model's bands, in its order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from geofm.data.pixels import normalise_pixels
from geofm.errors import DataMismatchError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig


class BandNormaliser:
    """Takes the model's bands from a dataset's by name and normalises them.

    ``(raw * scale - mean) / std`` per band; pixels equal to the nodata value or not finite become 0
    (the mean) and are marked invalid.
    """

    def __init__(
        self,
        dataset_bands: Sequence[str],
        bands: Sequence[str],
        scale: float,
        mean: Sequence[float],
        std: Sequence[float],
        nodata: float | None = None,
        section: str = "data",
    ) -> None:
        """Initialise a new BandNormaliser instance.

        Args:
            dataset_bands: the bands the data delivers, in its order.
            bands: the model's bands, in its order; each must be one of ``dataset_bands``.
            scale: multiplies raw values.
            mean: per dataset band, after scale.
            std: per dataset band, after scale.
            nodata: raw value of missing pixels; None: the file's own, if any.
            section: the config section of this band spec, for messages (``data``, ``data.hr``).

        Raises:
            DataMismatchError: naming the model bands the dataset does not deliver.
            ValueError: if ``mean`` or ``std`` do not have one value per dataset band.
        """
        missing = [b for b in bands if b not in dataset_bands]
        if missing:
            raise DataMismatchError(f"the dataset's bands {list(dataset_bands)} lack the model bands {missing}")
        if len(mean) != len(dataset_bands) or len(std) != len(dataset_bands):
            raise ValueError(
                f"need one mean and std per dataset band ({len(dataset_bands)}), got {len(mean)} and {len(std)}"
            )
        self.dataset_bands = list(dataset_bands)
        self.bands = list(bands)
        self.scale = float(scale)
        self.nodata = nodata
        self.section = section
        self.keep = [self.dataset_bands.index(b) for b in self.bands]
        self.mean = np.asarray(mean, dtype=np.float32)[self.keep, None, None]
        self.std = np.asarray(std, dtype=np.float32)[self.keep, None, None]

    @classmethod
    def from_config(cls, cfg: FinetuneDataConfig) -> BandNormaliser:
        """The normaliser of a downstream data section (super-resolution: of the low-resolution side)."""
        return cls(cfg.dataset_bands, cfg.bands, cfg.scale, cfg.mean, cfg.std, cfg.nodata)

    @classmethod
    def for_targets(cls, cfg: FinetuneDataConfig) -> BandNormaliser:
        """The normaliser of super-resolution targets: ``data.hr``, or the low-resolution side's without it."""
        hr = cfg.hr
        if hr is None:
            return cls.from_config(cfg)
        return cls(hr.dataset_bands, hr.bands, hr.scale, hr.mean, hr.std, hr.nodata, section="data.hr")

    def nodata_for(self, file_nodata: float | None) -> float | None:
        """The nodata value in force: the configured one, else the file's own."""
        return self.nodata if self.nodata is not None else file_nodata

    def __call__(
        self, raw: np.ndarray, file_nodata: float | None = None, where: str = "image"
    ) -> tuple[Tensor, Tensor]:
        """Select and normalise the model's bands of a raw image.

        Args:
            raw: pixels of shape (len(dataset_bands), H, W) as the data delivers them.
            file_nodata: the file's own nodata value, used when none is configured.
            where: the file or sample, for the error message.

        Returns:
            The normalised image, float32 (len(bands), H, W), and its valid mask, bool, same shape.

        Raises:
            DataMismatchError: if ``raw`` has another number of bands than ``dataset_bands``.
        """
        if raw.ndim != 3 or raw.shape[0] != len(self.dataset_bands):
            raise DataMismatchError(
                f"{where}: has {raw.shape[0] if raw.ndim == 3 else raw.shape} bands; {self.section}.dataset_bands declares "
                f"{len(self.dataset_bands)} ({', '.join(self.dataset_bands)})"
            )
        pixels, valid = normalise_pixels(raw[self.keep], self.scale, self.mean, self.std, self.nodata_for(file_nodata))
        return torch.from_numpy(pixels), torch.from_numpy(valid)

    def denormalise(self, pixels: np.ndarray) -> np.ndarray:
        """Raw values of normalised pixels of the model's bands, shape (len(bands), H, W), float32."""
        return (pixels * self.std + self.mean) / np.float32(self.scale)
