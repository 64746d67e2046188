"""Scene classification from class sub-folders (UC Merced, AID layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from geofm.data.finetune.checks import class_label
from geofm.data.finetune.folders import FolderSource, list_files
from geofm.errors import DataMismatchError, DatasetNotFoundError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split


class ClassFolders(FolderSource):
    """``<split>/<class name>/<image>``: one sub-folder of images per class.

    Class ids follow ``data.class_names``, or else the sorted sub-folder names. A split may lack
    some classes only when ``data.class_names`` lists them all.
    """

    def __init__(self, cfg: FinetuneDataConfig, split: Split) -> None:
        """Initialise a new ClassFolders instance.

        Raises:
            DatasetNotFoundError: if the split folder is missing or has no class folder.
            DataMismatchError: if a class folder is not in ``data.class_names``, or the number of
                classes is not ``data.num_classes``.
        """
        super().__init__(cfg, "classification", split)
        found = sorted(d.name for d in self.root.iterdir() if d.is_dir())
        if not found:
            raise DatasetNotFoundError(f"{self.root.resolve()} holds no class sub-folder")
        names = list(cfg.class_names) if cfg.class_names is not None else found
        unknown = [d for d in found if d not in names]
        if unknown:
            raise DataMismatchError(f"{self.root}: class folders {unknown} are not in data.class_names {names}")
        if cfg.num_classes is not None and len(names) != cfg.num_classes:
            raise DataMismatchError(
                f"{self.root}: {len(names)} class folders {names} for data.num_classes {cfg.num_classes}; "
                "list every class in data.class_names when a split lacks some"
            )
        self.class_names = names
        self.targets: list[int] = []
        for name in found:
            for path in list_files(self.root / name, cfg.suffixes).values():
                self.items.append({"image": path})
                self.targets.append(names.index(name))

    def load(self, index: int) -> dict[str, Tensor]:
        path = self.items[index]["image"]
        image = self.read_image(path)
        return {"image": image, "label": class_label(self.targets[index], len(self.class_names), str(path))}

    def labels(self) -> list[int]:
        return list(self.targets)
