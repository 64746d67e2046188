"""Semantic segmentation from a folder of images and a folder of masks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from geofm.data.finetune.checks import check_same_size, class_mask
from geofm.data.finetune.folders import FolderSource, extent, pair_by_stem
from geofm.data.grid import Window

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split


class SegmentationFolders(FolderSource):
    """``<split>/images/`` and ``<split>/masks/``: a single-band mask of class ids per image, same file stem.

    Mask values are class ids in ``[0, num_classes)`` or ``ignore_index``.
    """

    def __init__(self, cfg: FinetuneDataConfig, split: Split) -> None:
        """Initialise a new SegmentationFolders instance.

        Raises:
            DatasetNotFoundError: if a folder is missing or empty.
            DataMismatchError: naming images without masks and masks without images.
        """
        super().__init__(cfg, "segmentation", split)
        self.items = pair_by_stem({"image": self.part("images"), "mask": self.part("masks")}, cfg.suffixes)

    def load(self, index: int) -> dict[str, Tensor]:
        return self.window(index)

    def window(self, index: int, window: Window | None = None) -> dict[str, Tensor]:
        files = self.items[index]
        with self.open_image(files["image"]) as image, self.open_mask(files["mask"]) as mask:
            size = f"mask {files['mask'].name}"
            check_same_size(extent(image.info), extent(mask.info), size, str(files["image"]))
            labels = class_mask(self.mask_pixels(mask, window), self.cfg.num_classes, self.cfg.ignore_index, mask.path)
            return {"image": self.image_pixels(image, window), "mask": labels}
