"""What the folder datasets share: the layout of a split folder, and listing and pairing its files.

A split folder ``root/<splits[split]>/`` holds the parts of a folder layout
(:data:`geofm.data.layouts.FOLDER_LAYOUTS`, ``geofm list folder-layouts``): ``data.folder_layout``,
by default its task family's own, under default names that ``data.folders`` overrides.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor

from geofm.data.finetune.normalise import BandNormaliser
from geofm.data.finetune.source import SceneSource
from geofm.data.grid import Window
from geofm.data.layouts import FOLDER_LAYOUTS
from geofm.data.readers import RasterInfo, WindowReader, raster_info
from geofm.errors import ConfigError, DataMismatchError, DatasetNotFoundError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split

_SHOWN = 5


def _some(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def folder_layout(cfg: FinetuneDataConfig, family: str) -> dict[str, str]:
    """The part names of a split folder read by ``family``'s reader: those of ``data.folder_layout`` (default
    the family's own layout) with its options, ``data.folders``, over them.

    Raises:
        ConfigError: if the layout is not registered, lacks a part of the family's own layout, or
            ``data.folders`` names a part it does not have.
    """
    name = cfg.folder_layout or family
    layout = FOLDER_LAYOUTS.get(name)
    needs = FOLDER_LAYOUTS.get(family).parts if family in FOLDER_LAYOUTS else {}
    try:
        layout.check(cfg.folders, name, needs)
        options = FOLDER_LAYOUTS.options(name, cfg.folders, "data.folders")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return {} if options is None else options.model_dump()


def split_folder(cfg: FinetuneDataConfig, split: Split) -> Path:
    """The folder of a split, ``root/<splits[split]>``; with ``data.split`` (regions of the same scenes), ``root``.

    Raises:
        DatasetNotFoundError: if it does not exist.
    """
    if cfg.split is not None:
        if not cfg.root.is_dir():
            raise DatasetNotFoundError(f"data.root {cfg.root.resolve()}, the folder data.split cuts, does not exist")
        return cfg.root
    folder = cfg.root / cfg.splits[split]
    if not folder.is_dir():
        raise DatasetNotFoundError(
            f"the {split} split folder {folder.resolve()} does not exist (data.root {cfg.root}, data.splits.{split} "
            f"{cfg.splits[split]!r})"
        )
    return folder


def list_files(folder: Path, suffixes: list[str]) -> dict[str, Path]:
    """The images of a folder by file stem, sorted (not recursive).

    Raises:
        DatasetNotFoundError: if the folder is missing or holds no file with one of ``suffixes``.
        DataMismatchError: if two files share a stem (``a.tif`` and ``a.png``).
    """
    if not folder.is_dir():
        raise DatasetNotFoundError(f"folder {folder.resolve()} does not exist")
    endings = tuple(s.lower() for s in suffixes)
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not path.name.lower().endswith(endings):
            continue
        if path.stem in files:
            raise DataMismatchError(f"{folder}: {files[path.stem].name} and {path.name} share the stem {path.stem!r}")
        files[path.stem] = path
    if not files:
        raise DatasetNotFoundError(f"folder {folder.resolve()} holds no image ({', '.join(suffixes)})")
    return files


def pair_by_stem(parts: dict[str, Path], suffixes: list[str]) -> list[dict[str, Path]]:
    """The files of several folders matched by file stem, e.g. images and masks.

    Args:
        parts: folder of each part, e.g. ``{"images": ..., "masks": ...}``.
        suffixes: file name endings of images.

    Returns:
        One dict per stem (sorted), giving each part's file.

    Raises:
        DatasetNotFoundError: if a folder is missing or empty.
        DataMismatchError: naming the folders that lack partners of other folders' files.
    """
    listed = {name: list_files(folder, suffixes) for name, folder in parts.items()}
    stems = sorted(set().union(*listed.values()))
    lacking = [
        f"{parts[name]} lacks {_some(missing)}"
        for name, files in listed.items()
        if (missing := [s for s in stems if s not in files])
    ]
    if lacking:
        raise DataMismatchError(f"files without their partner (matched by file stem): {'; '.join(lacking)}")
    return [{name: files[stem] for name, files in listed.items()} for stem in stems]


class FolderSource(SceneSource):
    """Base of the folder datasets: the split folder, its layout, and normalised reads."""

    def __init__(self, cfg: FinetuneDataConfig, task: str, split: Split) -> None:
        """Initialise a new FolderSource instance.

        Args:
            cfg: the downstream data section.
            task: the task family, a name of :data:`~geofm.data.layouts.FOLDER_LAYOUTS`.
            split: which split.

        Raises:
            DatasetNotFoundError: if the split folder is missing.
            ConfigError: if ``data.folders`` names parts the task's layout does not have.
        """
        self.cfg = cfg
        self.task = task
        self.layout = folder_layout(cfg, task)
        self.root = split_folder(cfg, split)
        self.normaliser = BandNormaliser.from_config(cfg)
        self.items: list[dict[str, Path]] = []

    def part(self, name: str) -> Path:
        """The folder (or file) of a part of the layout."""
        return self.root / self.layout[name]

    def __len__(self) -> int:
        return len(self.items)

    def describe(self, index: int) -> str:
        return ", ".join(str(p) for p in self.items[index].values() if isinstance(p, Path))

    def shape(self, index: int) -> tuple[int, int]:
        return extent(raster_info(next(iter(self.items[index].values()))))

    def open_image(self, path: Path, normaliser: BandNormaliser | None = None) -> WindowReader:
        """An image file opened for windowed reads, checked against a band spec (default :attr:`normaliser`).

        Raises:
            RasterReadError: if the file cannot be read or has another band count than the spec's dataset bands.
        """
        bands = (normaliser or self.normaliser).dataset_bands
        return WindowReader(path, len(bands), bands)

    def image_pixels(
        self, reader: WindowReader, window: Window | None = None, normaliser: BandNormaliser | None = None
    ) -> Tensor:
        """A window (default: all) of an open image, normalised in the model's bands of its band spec.

        Raises:
            RasterReadError: if the window cannot be read.
        """
        raw = reader.read(*(window or whole(reader.info)))
        return (normaliser or self.normaliser)(raw, reader.info.nodata, reader.path)[0]

    def read_image(self, path: Path) -> Tensor:
        """An image file, whole, normalised in the model's bands.

        Raises:
            RasterReadError: if the file cannot be read or has another band count than the dataset bands.
        """
        with self.open_image(path) as reader:
            return self.image_pixels(reader)

    @staticmethod
    def open_mask(path: Path) -> WindowReader:
        """A single-band mask file opened for windowed reads.

        Raises:
            RasterReadError: if the file cannot be read or has more than one band.
        """
        return WindowReader(path, 1, ["mask"])

    @staticmethod
    def mask_pixels(reader: WindowReader, window: Window | None = None) -> np.ndarray:
        """A window (default: all) of an open mask, (1, H, W), in the file's dtype.

        Raises:
            DataMismatchError: if its values are not integers.
        """
        data = reader.read(*(window or whole(reader.info)))
        if data.dtype.kind == "f" and not (data == data.round()).all():
            raise DataMismatchError(
                f"{reader.path}: mask of dtype {data.dtype} holds non-integer values; expected class ids"
            )
        return data


def extent(info: RasterInfo) -> tuple[int, int]:
    """Height and width of a raster."""
    return info.height, info.width


def whole(info: RasterInfo) -> Window:
    """The window of all of a raster."""
    return Window(0, 0, *extent(info))
