"""Multi-label scene classification from a folder of images and a CSV of labels."""

from __future__ import annotations

import csv
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from geofm.data.finetune.folders import FolderSource, list_files
from geofm.errors import DataMismatchError, DatasetNotFoundError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split


class MultilabelFolder(FolderSource):
    """``<split>/images/`` and ``<split>/labels.csv``.

    The CSV's header is ``image,<class 1>,<class 2>,...``; each row names an image file of
    ``images/`` and gives 0 or 1 per class. The header's class names must equal
    ``data.class_names`` when that is set. Images without a row are not used.
    """

    def __init__(self, cfg: FinetuneDataConfig, split: Split) -> None:
        """Initialise a new MultilabelFolder instance.

        Raises:
            DatasetNotFoundError: if the images folder or the CSV is missing, or the CSV has no row.
            DataMismatchError: naming the CSV and line of a malformed row, a value other than 0/1,
                classes other than configured, or images the CSV names that do not exist.
        """
        super().__init__(cfg, "multilabel", split)
        images = {p.name: p for p in list_files(self.part("images"), cfg.suffixes).values()}
        table = self.part("labels")
        if not table.is_file():
            raise DatasetNotFoundError(f"label table {table.resolve()} does not exist")
        with table.open(newline="") as f:
            rows = list(csv.reader(f))
        if not rows or rows[0][:1] != ["image"] or len(rows[0]) < 2:
            raise DataMismatchError(f"{table}: expected a header 'image,<class 1>,<class 2>,...'")
        classes = [c.strip() for c in rows[0][1:]]
        if cfg.class_names is not None and classes != list(cfg.class_names):
            raise DataMismatchError(f"{table}: classes {classes} differ from data.class_names {cfg.class_names}")
        if cfg.num_classes is not None and len(classes) != cfg.num_classes:
            raise DataMismatchError(f"{table}: {len(classes)} classes {classes} for data.num_classes {cfg.num_classes}")
        self.class_names = classes
        vectors, missing, seen = [], [], set()
        for line, row in enumerate(rows[1:], start=2):
            if not row:
                continue
            if len(row) != len(classes) + 1 or any(v.strip() not in ("0", "1") for v in row[1:]):
                raise DataMismatchError(
                    f"{table} line {line}: expected an image name and {len(classes)} values 0 or 1, got {row}"
                )
            name = row[0].strip()
            if name in seen:
                raise DataMismatchError(f"{table} line {line}: {name} has a row already")
            seen.add(name)
            if name not in images:
                missing.append(name)
                continue
            self.items.append({"image": images[name]})
            vectors.append([int(v) for v in row[1:]])
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise DataMismatchError(f"{table} names images missing from {self.part('images')}: {shown}")
        if not self.items:
            raise DatasetNotFoundError(f"{table} has no labelled image")
        self.targets = np.asarray(vectors, dtype=np.float32)

    def load(self, index: int) -> dict[str, Tensor]:
        image = self.read_image(self.items[index]["image"])
        return {"image": image, "label": torch.from_numpy(self.targets[index].copy())}

    def labels(self) -> np.ndarray:
        return self.targets.copy()
