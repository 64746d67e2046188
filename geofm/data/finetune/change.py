"""Change detection from before/after/mask folders (LEVIR-CD layout; DSIFN-style by renaming)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from geofm.data.finetune.checks import change_mask, check_same_size
from geofm.data.finetune.folders import FolderSource, extent, pair_by_stem
from geofm.data.grid import Window
from geofm.data.readers import same_grid
from geofm.errors import DataMismatchError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split


class ChangeFolders(FolderSource):
    """``<split>/A/`` (before), ``<split>/B/`` (after), ``<split>/label/`` (change mask), same file stems.

    The two dates must share CRS, transform and size. Mask values: 0 no change, 1 or 255 change,
    or ``ignore_index``.
    """

    def __init__(self, cfg: FinetuneDataConfig, split: Split) -> None:
        """Initialise a new ChangeFolders instance.

        Raises:
            DatasetNotFoundError: if a folder is missing or empty.
            DataMismatchError: naming files without their partners.
        """
        super().__init__(cfg, "change", split)
        self.items = pair_by_stem(
            {"image1": self.part("before"), "image2": self.part("after"), "mask": self.part("mask")}, cfg.suffixes
        )

    def load(self, index: int) -> dict[str, Tensor]:
        return self.window(index)

    def window(self, index: int, window: Window | None = None) -> dict[str, Tensor]:
        files = self.items[index]
        with (
            self.open_image(files["image1"]) as before,
            self.open_image(files["image2"]) as after,
            self.open_mask(files["mask"]) as mask,
        ):
            difference = same_grid(before.info, after.info)
            if difference is not None:
                raise DataMismatchError(
                    f"{files['image1']} and {files['image2']}: the before and after images differ in {difference}; "
                    "they must share CRS, transform and size"
                )
            check_same_size(extent(before.info), extent(mask.info), f"mask {files['mask'].name}", str(files["image1"]))
            labels = change_mask(self.mask_pixels(mask, window), self.cfg.ignore_index, mask.path)
            return {
                "image1": self.image_pixels(before, window),
                "image2": self.image_pixels(after, window),
                "mask": labels,
            }
