"""Super-resolution from folders of low- and high-resolution pairs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor

from geofm.data.finetune.checks import superres_extent
from geofm.data.finetune.folders import FolderSource, extent, pair_by_stem
from geofm.data.finetune.normalise import BandNormaliser
from geofm.data.grid import Window
from geofm.data.readers import RasterInfo, raster_info, scaled_transform
from geofm.errors import DataMismatchError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split


def _check_georeferencing(lr: RasterInfo, hr: RasterInfo, factor: int, where: str) -> None:
    """Refuse a georeferenced pair whose high-resolution pixels are not the low-resolution ones split factor x factor."""
    if lr.crs is None or hr.crs is None:
        return
    if lr.crs != hr.crs:
        raise DataMismatchError(f"{where}: low resolution in CRS {lr.crs}, high resolution in {hr.crs}")
    expected = scaled_transform(lr.transform, factor)
    if not np.allclose(expected, hr.transform, rtol=1e-9, atol=1e-9):
        raise DataMismatchError(
            f"{where}: the high-resolution transform {tuple(hr.transform)} is not the low-resolution one at "
            f"scale_factor {factor}, {expected}"
        )


class SuperresFolders(FolderSource):
    """``<split>/lr/`` and ``<split>/hr/``: pairs with the same file stem.

    The high-resolution image is ``scale_factor`` times the low-resolution one per side and, when
    both are georeferenced, covers the same area (pixel size divided by the factor). Its bands and
    normalisation are ``data.hr``'s (default: the low-resolution side's).
    """

    def __init__(self, cfg: FinetuneDataConfig, split: Split) -> None:
        """Initialise a new SuperresFolders instance.

        Raises:
            DatasetNotFoundError: if a folder is missing or empty.
            DataMismatchError: naming files without their partners.
        """
        super().__init__(cfg, "superres", split)
        self.factor = int(cfg.scale_factor or 0)
        self.target_normaliser = BandNormaliser.for_targets(cfg)
        self.items = pair_by_stem({"image": self.part("lr"), "target": self.part("hr")}, cfg.suffixes)

    def _where(self, index: int) -> str:
        return f"{self.items[index]['image']} and {self.items[index]['target']}"

    def shape(self, index: int) -> tuple[int, int]:
        lr, hr = (raster_info(p) for p in self.items[index].values())
        return superres_extent(extent(lr), extent(hr), self.factor, self.cfg.superres_trim, self._where(index))

    def load(self, index: int) -> dict[str, Tensor]:
        return self.window(index)

    def window(self, index: int, window: Window | None = None) -> dict[str, Tensor]:
        files, f = self.items[index], self.factor
        with self.open_image(files["image"]) as lr, self.open_image(files["target"], self.target_normaliser) as hr:
            where = self._where(index)
            h, w = superres_extent(extent(lr.info), extent(hr.info), f, self.cfg.superres_trim, where)
            _check_georeferencing(lr.info, hr.info, f, where)
            window = window or Window(0, 0, h, w)
            high = Window(*(side * f for side in window))
            return {
                "image": self.image_pixels(lr, window),
                "target": self.image_pixels(hr, high, self.target_normaliser),
            }
