"""Downstream datasets of torchgeo, by class name, mapped to geofm's sample format.

``data.torchgeo: LEVIRCD`` instantiates ``torchgeo.datasets.LEVIRCD(root=data.root,
split=data.splits[split], **data.kwargs)``. Nothing is downloaded: a dataset missing from
``data.root`` is a :class:`~geofm.errors.DatasetNotFoundError` saying how to fetch it. torchgeo's
samples become the task's format:

==================  =====================================================================
``classification``  ``image``, ``label`` (checked against ``num_classes``)
``multilabel``      ``image``, ``label`` multi-hot as float32 (BigEarthNet, BigEarthNetV2)
``segmentation``    ``image``, ``mask`` (``(1, H, W)`` masks are squeezed)
``change``          ``image`` of shape (2, C, H, W) (torchgeo 0.8: OSCD, LEVIRCD, LEVIRCDPlus) or
                    ``image1``/``image2`` -> ``image1``, ``image2``; ``mask`` -> (H, W) in {0, 1}
``superres``        two instances of the class, ``kwargs`` + ``lr_kwargs`` and ``kwargs`` +
                    ``hr_kwargs`` (SpaceNet2: ``image: MUL`` and ``image: MUL-PanSharpen``),
                    paired by chip; ``image`` of the first, ``target`` of the second in the
                    bands of ``data.hr`` (SpaceNet2 ``image: RGB-PanSharpen``: red, green, blue)
==================  =====================================================================

For the classes of :data:`KNOWN_BANDS` (and classes whose instances list band names, e.g. OSCD,
EuroSAT) the bands they deliver are checked against ``data.dataset_bands``; for the others, only
the number of bands is.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from geofm.data.bands import RGB, UnknownBandError, canonical_bands
from geofm.data.finetune.checks import change_mask, check_same_size, class_label, class_mask, multi_hot, superres_extent
from geofm.data.finetune.normalise import BandNormaliser
from geofm.data.finetune.source import SceneSource, TaskData, task_data
from geofm.errors import ConfigError, DataMismatchError, DatasetNotFoundError, RasterReadError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split

# BigEarthNet's band files in the order torchgeo stacks them: polarisations sorted by file name,
# Sentinel-2 bands by number with B8A after B08.
_S1 = ("vh", "vv")
_S2 = tuple(canonical_bands(["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B11", "B12"]))

KNOWN_BANDS: dict[str, tuple[str, ...]] = {
    "UCMerced": RGB,
    "RESISC45": RGB,
    "PatternNet": RGB,
    "InriaAerialImageLabeling": RGB,
    "LoveDA": RGB,
    "LEVIRCD": RGB,
    "LEVIRCDPlus": RGB,
    "Vaihingen2D": ("nir", "red", "green"),  # ISPRS Vaihingen true orthophotos are IR-R-G
}
"""Bands that torchgeo classes without a band choice deliver, in their order."""

_BIGEARTHNET = {"s1": _S1, "s2": _S2, "all": _S1 + _S2}
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, IndexError)


def delivered_bands(name: str, dataset: Dataset) -> list[str] | None:
    """The bands a torchgeo dataset instance delivers, in order, or None where geofm does not know them."""
    if name in KNOWN_BANDS:
        return list(KNOWN_BANDS[name])
    bands = getattr(dataset, "bands", None)
    if name in ("BigEarthNet", "BigEarthNetV2") and bands in _BIGEARTHNET:
        return list(_BIGEARTHNET[bands])
    if isinstance(bands, (list, tuple)) and bands and all(isinstance(b, str) for b in bands):
        try:
            return canonical_bands(bands)
        except UnknownBandError:
            return None
    return None


def dataset_class(name: str) -> type[Dataset]:
    """The class ``torchgeo.datasets.<name>``.

    Raises:
        ConfigError: naming the closest class names if there is no such class.
    """
    module = importlib.import_module("torchgeo.datasets")
    cls = getattr(module, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, Dataset)):
        near = difflib.get_close_matches(name, getattr(module, "__all__", dir(module)), n=3)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise ConfigError(f"data.torchgeo: torchgeo.datasets has no dataset class {name!r}{hint}")
    return cls


_LITERAL_SPLITS = {"InriaAerialImageLabeling": ("train", "val", "test"), "SpaceNet2": ("train", "test")}
"""Splits of classes that check them with a literal instead of a class attribute."""


def valid_splits(cls: type) -> tuple[str, ...] | None:
    """The split names a torchgeo class accepts, from its class attributes; None where it does not say."""
    if cls.__name__ in _LITERAL_SPLITS:
        return _LITERAL_SPLITS[cls.__name__]
    for attribute in ("splits", "valid_splits", "splits_metadata"):
        names = getattr(cls, attribute, None)
        if isinstance(names, (list, tuple, dict)) and names and all(isinstance(n, str) for n in names):
            return tuple(names)
    return None


def check_torchgeo_arguments(
    cfg: FinetuneDataConfig, task: str | TaskData, splits: Sequence[Split] | None = None
) -> None:
    """Check ``data.torchgeo``'s class and the arguments geofm passes it for ``splits``, without data.

    The arguments (``root``, ``split`` and ``kwargs``, plus ``lr_kwargs``/``hr_kwargs`` for
    super-resolution) are bound to the class's signature, and the class's split names that
    ``data.splits`` maps ``splits`` to (default: train, val and test) checked against those it declares.

    Raises:
        ConfigError: naming every problem, with the accepted arguments and splits.
    """
    cls = dataset_class(str(cfg.torchgeo))
    name = cls.__name__
    parameters = inspect.signature(cls.__init__).parameters
    problems = []
    argument_sets = [("kwargs", {**cfg.kwargs})]
    if task_data(task).resolution_pairs:
        argument_sets = [
            ("kwargs + lr_kwargs", {**cfg.kwargs, **cfg.lr_kwargs}),
            ("kwargs + hr_kwargs", {**cfg.kwargs, **cfg.hr_kwargs}),
        ]
    for label, kwargs in argument_sets:
        try:
            inspect.signature(cls.__init__).bind(None, root=str(cfg.root), split="train", **kwargs)
        except TypeError as err:
            accepted = [p for p in parameters if p not in ("self", "root", "split", "transforms")]
            problems.append(f"data.{label} {kwargs}: {err}; {name} takes {accepted}")
    known = valid_splits(cls)
    if known is not None:
        for ours in splits or sorted(cfg.splits):
            theirs = cfg.splits[ours]
            if theirs not in known:
                hint = " (map it to one that exists, e.g. data.splits: {val: test})" if ours == "val" else ""
                problems.append(
                    f"data.splits.{ours}: {name} has no split {theirs!r}; its splits are {list(known)}{hint}"
                )
    if problems:
        raise ConfigError("data.torchgeo " + name + ": " + "; ".join(problems))


def _how_to_get(cls: type) -> str:
    """Where the data of a torchgeo class comes from, from its signature and docstring."""
    name = cls.__name__
    links = re.findall(r"<(https?://[^>]+)>", inspect.getdoc(cls) or "")
    page = f"; the dataset's page: {links[0]}" if links else ""
    if "download" in inspect.signature(cls.__init__).parameters:
        return (
            f"fetch it on a machine with internet with torchgeo.datasets.{name}(root=..., split=..., download=True) "
            f"and copy that root folder here{page}"
        )
    return f"torchgeo cannot download it: get the release files and place them as the class's docstring describes{page}"


def describe_item(name: str, dataset: Dataset, index: int) -> str:
    """A torchgeo sample and, where the class lists them, its files."""
    for attribute in ("files", "images", "folders", "imgs"):
        listed = getattr(dataset, attribute, None)
        if isinstance(listed, (list, tuple)) and 0 <= index < len(listed):
            return f"torchgeo {name} sample {index} ({listed[index]})"
    return f"torchgeo {name} sample {index}"


class TorchgeoSource(SceneSource):
    """A split of a torchgeo dataset (two paired instances for super-resolution) as full-size scenes."""

    def __init__(self, cfg: FinetuneDataConfig, task: str | TaskData, split: Split) -> None:
        """Instantiate the torchgeo class (never downloading) and check its bands.

        Raises:
            ConfigError: for an unknown class, arguments it refuses or a missing optional dependency.
            DatasetNotFoundError: if the data is not in ``data.root``, saying how to get it.
            DataMismatchError: if it delivers other bands than ``data.dataset_bands``, its first
                sample lacks the task's target (a split whose labels are withheld, e.g. LoveDA's
                test split), or super-resolution chips lack their partner.
        """
        if "download" in cfg.kwargs:
            raise ConfigError(
                "data.kwargs.download: geofm never downloads; fetch the dataset beforehand and set data.root"
            )
        self.cfg = cfg
        self.data = data = task_data(task)
        self.task = data.name
        self.name = str(cfg.torchgeo)
        self.split = split
        # the band spec of each instance: the low-resolution one's is data's, the high-resolution one's data.hr's
        self.normalisers = [BandNormaliser.from_config(cfg)]
        check_torchgeo_arguments(cfg, data, [split])
        cls = dataset_class(self.name)
        if data.resolution_pairs:
            low, high = {**cfg.kwargs, **cfg.lr_kwargs}, {**cfg.kwargs, **cfg.hr_kwargs}
            self.datasets = [self._open(cls, low), self._open(cls, high)]
            self.normalisers.append(BandNormaliser.for_targets(cfg))
            self.pairs = self._pair(*self.datasets)
        else:
            self.datasets = [self._open(cls, dict(cfg.kwargs))]
            self.pairs = [(i,) for i in range(len(self.datasets[0]))]
        for dataset, normaliser in zip(self.datasets, self.normalisers, strict=True):
            self._check_bands(dataset, normaliser)
        if not data.resolution_pairs and len(self.pairs):
            self._check_target(*self._get(0, 0))

    def _open(self, cls: type[Dataset], kwargs: dict[str, Any]) -> Dataset:
        split = self.cfg.splits[self.split]
        try:
            return cls(root=str(self.cfg.root), split=split, **kwargs)
        except FileNotFoundError as err:
            raise DatasetNotFoundError(
                f"torchgeo {self.name} found no data in {Path(self.cfg.root).resolve()} (split {split!r}, kwargs {kwargs}): "
                f"{err}. It reads the folder layout of the dataset's release, as torchgeo.datasets.{self.name} "
                f"documents; {_how_to_get(cls)}"
            ) from err
        except (AssertionError, TypeError) as err:
            splits = valid_splits(cls)
            known = f"its splits are {list(splits)}; " if splits else ""
            raise ConfigError(
                f"data.torchgeo: torchgeo {self.name} at {self.cfg.root} refuses split={split!r} with kwargs {kwargs}: "
                f"{err or 'an argument it asserts on'} ({known}data.splits maps train/val/test to the class's split names)"
            ) from err
        except ImportError as err:
            raise ConfigError(
                f"data.torchgeo: torchgeo {self.name} needs a package that is not installed: {err}"
            ) from err

    def _check_bands(self, dataset: Dataset, spec: BandNormaliser) -> None:
        delivered = delivered_bands(self.name, dataset)
        if delivered is None or delivered == spec.dataset_bands:
            return
        lacking = [b for b in spec.bands if b not in delivered]
        consequence = f"; it cannot provide the model bands {lacking}" if lacking else ""
        raise DataMismatchError(
            f"torchgeo {self.name} delivers the bands {delivered}, {spec.section}.dataset_bands declares "
            f"{spec.dataset_bands}{consequence}"
        )

    def _check_target(self, sample: dict[str, Tensor], where: str) -> None:
        key = self.data.target
        if key not in sample:
            raise DataMismatchError(
                f"torchgeo {self.name} split {self.cfg.splits[self.split]!r} delivers {sorted(sample)} without the "
                f"{self.task} target {key!r} ({where}): its labels are withheld or kept elsewhere; map "
                f"data.splits.{self.split} to a split of the class that has them (e.g. data.splits.{self.split}=val)"
            )

    def _pair(self, low: Dataset, high: Dataset) -> list[tuple[int, int]]:
        """Indices of the low- and high-resolution instances that show the same chip."""
        files_low, files_high = getattr(low, "images", None), getattr(high, "images", None)
        pattern = getattr(low, "file_regex", None)
        if not (isinstance(files_low, list) and isinstance(files_high, list) and pattern):
            if len(low) != len(high):
                raise DataMismatchError(
                    f"torchgeo {self.name}: the low-resolution instance has {len(low)} samples, "
                    f"the high-resolution one {len(high)}"
                )
            return [(i, i) for i in range(len(low))]

        def chip(path: str) -> tuple[str, str]:
            """The area folder above the product folder, and the chip id."""
            match = re.search(pattern, Path(path).name)
            return Path(path).parent.parent.name, match.group(1) if match else Path(path).stem

        where_high = {chip(p): j for j, p in enumerate(files_high)}
        pairs = [(i, where_high[chip(p)]) for i, p in enumerate(files_low) if chip(p) in where_high]
        if len(pairs) != len(files_low) or len(pairs) != len(files_high):
            paired_low = {i for i, _ in pairs}
            paired_high = {j for _, j in pairs}
            alone = [p for i, p in enumerate(files_low) if i not in paired_low] + [
                p for j, p in enumerate(files_high) if j not in paired_high
            ]
            raise DataMismatchError(f"torchgeo {self.name}: chips without their partner resolution: {alone[:5]}")
        return pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def describe(self, index: int) -> str:
        return " and ".join(
            describe_item(self.name, d, i) for d, i in zip(self.datasets, self.pairs[index], strict=True)
        )

    def labels(self) -> list[int] | None:
        targets = getattr(self.datasets[0], "targets", None)
        if self.data.class_targets and isinstance(targets, list):
            return [int(t) for t in targets]
        return None

    def shape(self, index: int) -> tuple[int, int]:
        sample = self.kept(index)
        image = sample["image"] if "image" in sample else sample["image1"]
        return int(image.shape[-2]), int(image.shape[-1])

    def _get(self, which: int, index: int) -> tuple[dict[str, Tensor], str]:
        dataset = self.datasets[which]
        where = describe_item(self.name, dataset, index)
        try:
            return dataset[index], where
        except _LOAD_ERRORS as err:
            raise RasterReadError(where, f"torchgeo cannot load it: {type(err).__name__}: {err}") from err

    def image(self, image: Tensor, where: str, which: int = 0) -> Tensor:
        """An image of instance ``which`` (super-resolution: 1 is the high-resolution one) in its model bands."""
        return self.normalisers[which](np.asarray(image), None, where)[0]

    def load(self, index: int) -> dict[str, Tensor]:
        pair = self.pairs[index]
        sample, where = self._get(0, pair[0])
        cfg = self.cfg
        if self.data.resolution_pairs:
            high, where_high = self._get(1, pair[1])
            image, target = self.image(sample["image"], where), self.image(high["image"], where_high, 1)
            s = int(cfg.scale_factor or 0)
            h, w = superres_extent(image.shape[1:], target.shape[1:], s, cfg.superres_trim, f"{where} and {where_high}")
            return {"image": image[:, :h, :w], "target": target[:, : h * s, : w * s]}
        self._check_target(sample, where)
        return self.data.torchgeo(self, sample, where)


def _single_image(source: TorchgeoSource, sample: dict[str, Tensor], where: str) -> Tensor:
    """The sample's image in the model bands (BigEarthNet with both sensors: S1 then S2 bands)."""
    raw = sample["image"] if "image" in sample else torch.cat([sample["image_s1"], sample["image_s2"]])
    return source.image(raw, where)


def classification_scene(source: TorchgeoSource, sample: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """``image`` and the class id ``label``, checked against ``num_classes``."""
    image = _single_image(source, sample, where)
    return {"image": image, "label": class_label(sample["label"], source.cfg.num_classes, where)}


def multilabel_scene(source: TorchgeoSource, sample: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """``image`` and the float32 multi-hot ``label``."""
    image = _single_image(source, sample, where)
    return {"image": image, "label": multi_hot(sample["label"], source.cfg.num_classes, where)}


def segmentation_scene(source: TorchgeoSource, sample: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """``image`` and the class ``mask`` (H, W), of the image's size."""
    image = _single_image(source, sample, where)
    mask = class_mask(sample["mask"], source.cfg.num_classes, source.cfg.ignore_index, where)
    check_same_size(image.shape[1:], mask.shape, "mask", where)
    return {"image": image, "mask": mask}


def change_scene(source: TorchgeoSource, sample: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """``image1``, ``image2`` (a (2, C, H, W) ``image`` or the pair) and the change ``mask`` in {0, 1}."""
    if "image" in sample and sample["image"].ndim == 4:
        before, after = sample["image"][0], sample["image"][1]
    else:
        before, after = sample["image1"], sample["image2"]
    image1, image2 = source.image(before, where), source.image(after, where)
    check_same_size(image1.shape[1:], image2.shape[1:], "after image", where)
    mask = change_mask(sample["mask"], source.cfg.ignore_index, where)
    check_same_size(image1.shape[1:], mask.shape, "mask", where)
    return {"image1": image1, "image2": image2, "mask": mask}
