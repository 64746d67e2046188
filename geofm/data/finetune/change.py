"""Change detection from before/after/mask folders (LEVIR-CD layout; DSIFN-style by renaming)."""

from __future__ import annotations

from torch import Tensor

from geofm.config.finetune import FinetuneDataConfig, Split
from geofm.data.finetune.checks import change_mask, check_same_size
from geofm.data.finetune.folders import FolderSource, pair_by_stem
from geofm.data.readers import same_grid
from geofm.errors import DataMismatchError


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
        files = self.items[index]
        image1, before = self.read_image(files["image1"])
        image2, after = self.read_image(files["image2"])
        difference = same_grid(before, after)
        if difference is not None:
            raise DataMismatchError(
                f"{files['image1']} and {files['image2']}: the before and after images differ in {difference}; "
                "they must share CRS, transform and size"
            )
        mask = self.read_mask(files["mask"])
        check_same_size(image1.shape[1:], mask.data.shape[1:], f"mask {files['mask'].name}", str(files["image1"]))
        labels = change_mask(mask.data, self.cfg.ignore_index, str(files["mask"]))
        return {"image1": image1, "image2": image2, "mask": labels}
