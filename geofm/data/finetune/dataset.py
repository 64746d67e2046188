"""Scene classification from class sub-folders, and the entry point that builds a split's dataset.

A split folder ``root/<splits[split]>/`` holds one sub-folder of images per class (the UC Merced and
AID layout); images are GeoTIFF, PNG or JPEG files holding ``data.dataset_bands`` in order.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

from geofm.config.finetune import FinetuneDataConfig, Split
from geofm.data.readers import read_raster
from geofm.errors import ConfigError, DatasetNotFoundError

IMAGE_SUFFIXES = (".tif", ".tiff", ".png", ".jpg", ".jpeg")
TRAIN_CROP_SCALE = (0.5, 1.0)


class ClassFolderDataset(Dataset[dict[str, Tensor]]):
    """One split of a class-folder dataset: ``{"image": (C, img_size, img_size) float, "label": int64}``.

    Images hold the model's bands (``data.bands``, taken by name from ``data.dataset_bands``),
    ``(raw * scale - mean) / std``, with nodata and non-finite pixels set to 0. Training samples are
    a random resized crop (area 0.5-1) with flips; evaluation samples the whole image resized.
    Class ids follow ``data.class_names``, or else the sorted sub-folder names.
    """

    def __init__(self, cfg: FinetuneDataConfig, split: Split, img_size: int, train: bool) -> None:
        """Initialise a new ClassFolderDataset instance.

        Raises:
            DatasetNotFoundError: if the split folder is missing, has no class folder or no image.
            ConfigError: if the class folders do not match ``data.class_names`` / ``data.num_classes``.
        """
        folder = Path(cfg.root) / cfg.splits[split]
        if not folder.is_dir():
            raise DatasetNotFoundError(f"the {split} split folder {folder.resolve()} does not exist (data.root {cfg.root})")
        found = sorted(d.name for d in folder.iterdir() if d.is_dir())
        names = list(cfg.class_names) if cfg.class_names is not None else found
        unknown = [d for d in found if d not in names]
        if not found or unknown or (cfg.num_classes is not None and len(names) != cfg.num_classes):
            raise ConfigError(
                f"{folder.resolve()}: class folders {found} do not match data.class_names {cfg.class_names} "
                f"and data.num_classes {cfg.num_classes}"
            )
        self.files: list[Path] = []
        self.labels: list[int] = []
        for name in found:
            files = sorted(p for p in (folder / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            self.files += files
            self.labels += [names.index(name)] * len(files)
        if not self.files:
            raise DatasetNotFoundError(f"{folder.resolve()}: no image ({', '.join(IMAGE_SUFFIXES)}) in its class folders")
        if split == "train" and cfg.train_fraction < 1:
            keep = _stratified_subset(self.labels, cfg.train_fraction)
            self.files = [self.files[i] for i in keep]
            self.labels = [self.labels[i] for i in keep]
        self.cfg = cfg
        self.keep = [cfg.dataset_bands.index(b) for b in cfg.bands]
        self.mean = np.asarray(cfg.mean, dtype=np.float32)[self.keep, None, None]
        self.std = np.asarray(cfg.std, dtype=np.float32)[self.keep, None, None]
        if train:
            self.view = v2.Compose(
                [
                    v2.RandomResizedCrop(img_size, scale=TRAIN_CROP_SCALE, antialias=True),
                    v2.RandomHorizontalFlip(),
                    v2.RandomVerticalFlip(),
                ]
            )
        else:
            self.view = v2.Resize((img_size, img_size), antialias=True)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        raster = read_raster(self.files[index], len(self.cfg.dataset_bands), self.cfg.dataset_bands)
        raw = raster.data[self.keep]
        valid = raster.valid(self.cfg.nodata)[self.keep]
        pixels = (raw.astype(np.float32) * np.float32(self.cfg.scale) - self.mean) / self.std
        pixels[~valid] = 0.0
        image = self.view(torch.from_numpy(pixels))
        return {"image": image, "label": torch.tensor(self.labels[index], dtype=torch.int64)}


def _stratified_subset(labels: list[int], fraction: float) -> list[int]:
    """Indices of ``fraction`` of each class (at least one image per class), in a fixed seeded order."""
    rng = np.random.default_rng(0)
    keep: list[int] = []
    for label in sorted(set(labels)):
        members = [i for i, y in enumerate(labels) if y == label]
        keep += rng.permutation(members)[: max(1, math.ceil(fraction * len(members)))].tolist()
    return sorted(keep)


def build_finetune_dataset(
    data_cfg: FinetuneDataConfig, task: str, split: Split, img_size: int, train: bool
) -> Dataset[dict[str, Tensor]]:
    """One split of a downstream dataset.

    Args:
        data_cfg: the downstream data section.
        task: the task family; this build reads classification folders.
        split: train, val or test.
        img_size: side of the samples.
        train: random training augmentation (True) or the deterministic evaluation view.

    Raises:
        ConfigError: for a task or a torchgeo class this build does not read.
        DatasetNotFoundError: if the split's folder or images are missing.
    """
    if task != "classification" or data_cfg.torchgeo is not None:
        source = f"torchgeo class {data_cfg.torchgeo}" if data_cfg.torchgeo else f"{task} folders"
        raise ConfigError(f"data: {source} cannot be read; this build reads class sub-folders of images (classification)")
    return ClassFolderDataset(data_cfg, split, img_size, train)
