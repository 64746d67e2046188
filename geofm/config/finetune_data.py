"""The ``data`` section of a finetuning config: the downstream dataset, its bands and normalisation,
its splits (folders, torchgeo datasets, or regions of large scenes), the high-resolution side of
super-resolution pairs, and how its scenes are cut into training samples.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from geofm.config.base import Section
from geofm.config.sources import canonical_band_lists
from geofm.data.layouts import FOLDER_LAYOUTS

log = logging.getLogger("geofm.config")

Split = Literal["train", "val", "test"]
PADDING_LABEL = -100
"""Mask value of padding (and of unlabelled pixels) when ``data.ignore_index`` is not set; torch's
cross-entropy and torchmetrics leave it out. Not a class index, so padding can never pass for class 0."""


def _check_band_spec(
    where: str, dataset_bands: list[str], bands: list[str], mean: list[float], std: list[float]
) -> None:
    """Refuse model bands the data does not deliver, and statistics that are not one positive std per band.

    Raises:
        ValueError: naming the fields under ``where`` (``data``, ``data.hr``).
    """
    missing = [b for b in bands if b not in dataset_bands]
    if missing:
        raise ValueError(
            f"{where}.bands {missing} are not among the dataset's bands {dataset_bands}: the dataset cannot provide them"
        )
    n = len(dataset_bands)
    if len(mean) != n or len(std) != n:
        raise ValueError(
            f"{where}.mean and {where}.std need one value per dataset band ({n}), got {len(mean)} and {len(std)}"
        )
    if any(s <= 0 for s in std):
        raise ValueError(f"{where}.std values must be positive, got {std}")


class HighResolutionConfig(Section):
    """``data.hr``: the high-resolution side of super-resolution pairs, where its bands or units differ.

    SpaceNet's 8-band multispectral chips to its 3-band pan-sharpened RGB chips, Sentinel-2's 20 m
    bands to its 10 m bands, Landsat's 30 m multispectral bands to its 15 m panchromatic band. The
    model's outputs are ``bands``, taken by name from the ``dataset_bands`` the high-resolution
    files (or torchgeo instance) deliver, normalised as ``(raw * scale - mean) / std``. Without
    ``data.hr`` both sides have the bands and normalisation of the low-resolution side.
    """

    dataset_bands: list[str] = Field(min_length=1, description="the bands the high-resolution data delivers, in order")
    bands: list[str] = Field(min_length=1, description="the model's output bands, in order (default: dataset_bands)")
    scale: float = Field(gt=0.0, description="multiplies raw values (default: data.scale)")
    nodata: float | None = Field(default=None, description="raw value of missing pixels (default: the files' own)")
    mean: list[float] = Field(description="per high-resolution dataset band, after scale")
    std: list[float] = Field(description="per high-resolution dataset band, after scale")

    @model_validator(mode="before")
    @classmethod
    def _default_bands(cls, data: Any) -> Any:
        if isinstance(data, dict) and "bands" not in data and "dataset_bands" in data:
            return {**data, "bands": data["dataset_bands"]}
        return data

    @model_validator(mode="after")
    def _check(self) -> HighResolutionConfig:
        _check_band_spec("data.hr", self.dataset_bands, self.bands, self.mean, self.std)
        return self


class RegionSplitConfig(Section):
    """``data.split``: train, val and test as disjoint regions of the same scenes (the folders under ``data.root``).

    ``by: regions`` cuts every scene into ``block`` x ``block`` blocks (those at the far edges cut
    short) and deals them to the splits in ``fractions``, in an order drawn from ``seed``;
    ``by: rows`` (``columns``) cuts every scene into three stripes of rows (columns), the first
    ``fractions[0]`` of them train, then val, then test. No window of a split reaches into another's.
    """

    by: Literal["regions", "rows", "columns"] = Field(
        description="blocks dealt at random, or stripes of rows or columns"
    )
    fractions: tuple[float, float, float] = Field(description="shares of train, val and test, summing to 1")
    block: int | None = Field(default=None, gt=0, description="regions: side of the square blocks, in pixels")
    seed: int = Field(default=0, description="regions: seed of the blocks' order; the same seed, the same split")

    @model_validator(mode="after")
    def _check(self) -> RegionSplitConfig:
        if any(f < 0 for f in self.fractions) or abs(sum(self.fractions) - 1) > 1e-6:
            raise ValueError(
                f"data.split.fractions must be 3 shares (train, val, test) summing to 1, got {self.fractions}"
            )
        if self.fractions[0] == 0:
            raise ValueError("data.split.fractions: the train split needs a share above 0")
        if (self.by == "regions") != (self.block is not None):
            raise ValueError(
                "data.split.block is the side of the blocks of by: regions"
                + (", which needs it" if self.by == "regions" else f"; stripes (by: {self.by}) take none")
            )
        return self


class FinetuneDataConfig(Section):
    """A downstream dataset: a torchgeo dataset class, or folders of GeoTIFF/PNG/JPEG files.

    With ``torchgeo`` set, ``root`` and ``kwargs`` go to the class's constructor and ``splits``
    gives the value of its ``split`` argument for each of train/val/test. Without it, ``root``
    holds one folder per split (named by ``splits``) in a registered folder layout
    (``folder_layout``, by default the task's own; ``geofm list folder-layouts``), whose options,
    ``folders``, rename its parts. ``dataset_bands`` names the bands
    in the order the dataset delivers them; ``bands`` are the model's inputs, taken by name from
    them (names from the band vocabulary of :mod:`geofm.data.bands`, or ``custom_bands``). For
    super-resolution these fields describe the low-resolution side, and ``hr``
    (:class:`HighResolutionConfig`) the high-resolution side when its bands or units differ.
    """

    torchgeo: str | None = Field(default=None, description="a torchgeo.datasets class name, e.g. UCMerced")
    root: Path
    kwargs: dict[str, Any] = Field(default_factory=dict, description="more constructor arguments of the torchgeo class")
    splits: dict[Split, str] = Field(
        default_factory=lambda: {"train": "train", "val": "val", "test": "test"},
        description="torchgeo: the class's split argument per split; folders: the sub-folder of root per split; "
        "a split not given keeps its own name ({val: test} changes val only)",
    )
    folder_layout: str | None = Field(
        default=None,
        description="folders: a registered folder layout of the split folders (geofm list folder-layouts), with the "
        "parts the task reads; default: the task's own",
    )
    folders: dict[str, str] = Field(
        default_factory=dict,
        description="folders: the folder layout's options, names of the parts of a split folder over its defaults, "
        "e.g. {before: t1, after: t2, mask: mask} for DSIFN-style change data (the parts: geofm list folder-layouts)",
    )
    suffixes: list[str] = Field(
        default_factory=lambda: [".tif", ".tiff", ".png", ".jpg", ".jpeg"],
        min_length=1,
        description="folders: file name endings of images and masks (case-insensitive)",
    )
    bands: list[str] = Field(min_length=1, description="the model's input bands, in order")
    custom_bands: list[str] = Field(default_factory=list)
    dataset_bands: list[str] = Field(min_length=1, description="the bands the dataset delivers, in its order")
    scale: float = Field(default=1.0, gt=0.0, description="multiplies raw values (e.g. 1/255, 1/10000)")
    nodata: float | None = Field(
        default=None, description="raw value of missing pixels (folders: default the files' own)"
    )
    mean: list[float] = Field(description="per dataset band, after scale")
    std: list[float] = Field(description="per dataset band, after scale")
    num_classes: int | None = Field(default=None, gt=0, description="classes of the task (not for superres)")
    class_names: list[str] | None = None
    ignore_index: int | None = Field(
        default=None, description="segmentation, change: mask value left out of loss and metrics"
    )
    scale_factor: int | None = Field(default=None, gt=1, description="superres: high / low resolution ratio")
    superres_trim: bool = Field(
        default=False,
        description="superres: crop a pair whose high-resolution side misses scale_factor x the low-resolution side "
        "by less than scale_factor pixels (SpaceNet2: 163 px MS, 650 px PS-MS) to the largest exact fit, "
        "top-left aligned; off: such a pair is an error",
    )
    lr_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="superres with torchgeo: constructor arguments of the low-resolution instance, over kwargs "
        "(SpaceNet2: {image: MUL})",
    )
    hr_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="superres with torchgeo: constructor arguments of the high-resolution instance, over kwargs "
        "(SpaceNet2: {image: MUL-PanSharpen})",
    )
    hr: HighResolutionConfig | None = Field(
        default=None,
        description="superres: bands and normalisation of the high-resolution side (default: those of the "
        "low-resolution side, above)",
    )
    train_fraction: float = Field(default=1.0, gt=0.0, le=1.0, description="share of the train split used (1%: 0.01)")
    subset_seed: int = Field(
        default=0, description="seed of the train_fraction subset: the same subset for every run and backbone compared"
    )
    split: RegionSplitConfig | None = Field(
        default=None,
        description="segmentation, change, superres: train, val and test as regions of the same scenes, whose "
        "folders are directly under root (not data.splits); e.g. {by: regions, fractions: [0.7, 0.15, 0.15], "
        "block: 256}",
    )
    chip_size: int | None = Field(
        default=None,
        gt=0,
        description="segmentation, change, superres: each scene (or region of data.split) larger than this is cut into "
        "a grid of chip_size windows (the last row and column flush with its far edges), each a sample read by "
        "window: training crops model.img_size from it at random, evaluation tiles it (superres: low-resolution "
        "pixels; at least model.img_size)",
    )
    crops_per_scene: int = Field(
        default=1,
        gt=0,
        description="training: random crops of each sample (scene, or chip) per epoch; an epoch holds crops_per_scene "
        "times the samples",
    )
    crop_scale: tuple[float, float] = Field(
        default=(0.5, 1.0), description="classification, multilabel: area range of the training RandomResizedCrop"
    )
    hflip: bool = Field(default=True, description="training: flip left-right with probability 0.5")
    vflip: bool = Field(default=True, description="training: flip top-bottom with probability 0.5")
    num_workers: int = Field(default=2, ge=0)

    @property
    def unscored_label(self) -> int:
        """The mask value never trained on nor scored: ``ignore_index``, or :data:`PADDING_LABEL` without one.

        Dense scenes smaller than the model's input are padded with it, so padding never counts.
        """
        return PADDING_LABEL if self.ignore_index is None else self.ignore_index

    @field_validator("splits")
    @classmethod
    def _complete_splits(cls, splits: dict[str, str]) -> dict[str, str]:
        return {**{split: split for split in get_args(Split)}, **splits}

    @model_validator(mode="before")
    @classmethod
    def _canonical_band_names(cls, data: Any) -> Any:
        """Resolve aliases and refuse unknown band names before the fields are checked."""
        if not isinstance(data, dict):
            return data
        custom = data.get("custom_bands") or []
        data = canonical_band_lists(data, ("bands", "dataset_bands"), custom, "data")
        if isinstance(data.get("hr"), dict):
            hr = canonical_band_lists(data["hr"], ("bands", "dataset_bands"), custom, "data.hr")
            data["hr"] = {"scale": data.get("scale", 1.0), **hr}
        return data

    @field_validator("folder_layout")
    @classmethod
    def _registered_folder_layout(cls, name: str | None) -> str | None:
        return name if name is None else FOLDER_LAYOUTS.check(name)

    def at_node(self, data_root: Path, source: str | None = None) -> FinetuneDataConfig:
        """The dataset as one institution's machine holds it: its own splits under ``data_root`` (a node trains on
        all of its own train split; ``source`` is a pretraining pile's and does not apply)."""
        return self.model_copy(update={"root": data_root})

    @model_validator(mode="after")
    def _check(self) -> FinetuneDataConfig:
        _check_band_spec("data", self.dataset_bands, self.bands, self.mean, self.std)
        if self.class_names is not None and self.num_classes is not None and len(self.class_names) != self.num_classes:
            raise ValueError(f"data.class_names has {len(self.class_names)} names for num_classes {self.num_classes}")
        if self.class_names is not None and len(set(self.class_names)) != len(self.class_names):
            raise ValueError(f"data.class_names repeats names: {self.class_names}")
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"data.crop_scale must satisfy 0 < min <= max <= 1, got {self.crop_scale}")
        bad = [s for s in self.suffixes if not s.startswith(".") or len(s) < 2]
        if bad:
            raise ValueError(f"data.suffixes must be file name endings such as .tif, got {bad}")
        if self.torchgeo is None and (self.lr_kwargs or self.hr_kwargs):
            raise ValueError(
                "data.lr_kwargs and data.hr_kwargs configure torchgeo classes; set data.torchgeo or remove them"
            )
        if self.torchgeo is not None and (self.folders or self.folder_layout is not None):
            raise ValueError(
                "data.folder_layout and data.folders name the parts of split folders; a torchgeo class reads its own "
                "layout"
            )
        if self.split is not None and self.torchgeo is not None:
            raise ValueError(
                "data.split cuts the scenes of the user's folders; a torchgeo class has its own (data.splits)"
            )
        if self.split is not None and "splits" in self.model_fields_set:
            raise ValueError(
                "data.splits names split folders; with data.split every split is a region of the scenes under data.root"
            )
        return self


__all__ = ["PADDING_LABEL", "FinetuneDataConfig", "HighResolutionConfig", "RegionSplitConfig", "Split"]
