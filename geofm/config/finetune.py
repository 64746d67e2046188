"""The config of finetuning (``geofm finetune``, ``geofm eval``): a pretrained backbone on a downstream task.

Task families and the sample each dataset yields (after band selection and normalisation):

==================  =====================================================================
``classification``  ``image`` (C, H, W) float, ``label`` int64 scalar
``multilabel``      ``image`` (C, H, W) float, ``label`` float (num_classes,) multi-hot
``segmentation``    ``image`` (C, H, W) float, ``mask`` int64 (H, W), ``ignore_index`` unlabeled
``change``          ``image1``, ``image2`` (C, H, W) float (before, after), ``mask`` int64 (H, W) 0/1
``superres``        ``image`` (C, h, w) float low resolution, ``target`` (C, h*s, w*s) high resolution
==================  =====================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from geofm.config.base import ProgramConfig, Section
from geofm.config.sections import BackboneConfig, RunConfig, TrainConfig
from geofm.data.bands import UnknownBandError, canonical_bands

TASKS = ("classification", "multilabel", "segmentation", "change", "superres")
Task = Literal["classification", "multilabel", "segmentation", "change", "superres"]
Split = Literal["train", "val", "test"]


class FinetuneDataConfig(Section):
    """A downstream dataset: a torchgeo dataset class, or folders of GeoTIFF/PNG/JPEG files.

    With ``torchgeo`` set, ``root`` and ``kwargs`` go to the class's constructor and ``splits``
    gives the value of its ``split`` argument for each of train/val/test. Without it, ``root``
    holds one folder per split (named by ``splits``) in the task's folder layout (see
    :mod:`geofm.data.finetune`; ``folders`` renames its parts). ``dataset_bands`` names the bands
    in the order the dataset delivers them; ``bands`` are the model's inputs, taken by name from
    them (names from the band vocabulary of :mod:`geofm.data.bands`, or ``custom_bands``).
    """

    torchgeo: str | None = Field(default=None, description="a torchgeo.datasets class name, e.g. UCMerced")
    root: Path
    kwargs: dict[str, Any] = Field(default_factory=dict, description="more constructor arguments of the torchgeo class")
    splits: dict[Split, str] = Field(
        default_factory=lambda: {"train": "train", "val": "val", "test": "test"},
        description="torchgeo: the class's split argument per split; folders: the sub-folder of root per split",
    )
    folders: dict[str, str] = Field(
        default_factory=dict,
        description="folders: names of the parts of a split folder, over the task's defaults, e.g. "
        "{before: t1, after: t2, mask: mask} for DSIFN-style change data (geofm.data.finetune.FOLDER_LAYOUTS)",
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
    nodata: float | None = Field(default=None, description="raw value of missing pixels (folders: default the files' own)")
    mean: list[float] = Field(description="per dataset band, after scale")
    std: list[float] = Field(description="per dataset band, after scale")
    num_classes: int | None = Field(default=None, gt=0, description="classes of the task (not for superres)")
    class_names: list[str] | None = None
    ignore_index: int | None = Field(default=None, description="segmentation: mask value left out of loss and metrics")
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
    train_fraction: float = Field(default=1.0, gt=0.0, le=1.0, description="share of the train split used (1%: 0.01)")
    subset_seed: int = Field(
        default=0, description="seed of the train_fraction subset: the same subset for every run and backbone compared"
    )
    crop_scale: tuple[float, float] = Field(
        default=(0.5, 1.0), description="classification, multilabel: area range of the training RandomResizedCrop"
    )
    hflip: bool = Field(default=True, description="training: flip left-right with probability 0.5")
    vflip: bool = Field(default=True, description="training: flip top-bottom with probability 0.5")
    num_workers: int = Field(default=2, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _canonical_band_names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        custom = data.get("custom_bands") or []
        try:
            for key in ("bands", "dataset_bands"):
                if isinstance(data.get(key), list):
                    data[key] = canonical_bands(data[key], custom, f"data.{key}")
        except UnknownBandError as err:
            raise ValueError(str(err)) from None
        return data

    @model_validator(mode="after")
    def _check(self) -> FinetuneDataConfig:
        missing = [b for b in self.bands if b not in self.dataset_bands]
        if missing:
            raise ValueError(
                f"data.bands {missing} are not among the dataset's bands {self.dataset_bands}: "
                "the dataset cannot provide them"
            )
        n = len(self.dataset_bands)
        if len(self.mean) != n or len(self.std) != n:
            raise ValueError(
                f"data.mean and data.std need one value per dataset band ({n}), got {len(self.mean)} and {len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"data.std values must be positive, got {self.std}")
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
        if self.torchgeo is not None and self.folders:
            raise ValueError("data.folders names the parts of split folders; a torchgeo class reads its own layout")
        return self


class FinetuneModelConfig(BackboneConfig):
    """The backbone being finetuned; its weights come from the top-level ``checkpoint``.

    ``img_size`` is also the side of the training crops (for ``superres``: of the low-resolution input).
    """

    drop_path_rate: float = Field(default=0.1, ge=0.0, lt=1.0)
    frozen: bool = Field(default=False, description="freeze the backbone and train the head only (linear probe)")


class FinetuneConfig(ProgramConfig):
    """Finetuning (or linear probing) of a backbone on one downstream task."""

    task: Task
    checkpoint: Path | None = Field(
        default=None, description="backbone weights in any layout geofm.checkpoints reads; none: random init (baseline)"
    )
    run: RunConfig
    model: FinetuneModelConfig
    data: FinetuneDataConfig
    train: TrainConfig
    layer_decay: float = Field(default=0.9, gt=0.0, le=1.0, description="layer-wise learning-rate decay")

    @model_validator(mode="after")
    def _check_task(self) -> FinetuneConfig:
        if self.task != "superres" and self.data.num_classes is None:
            raise ValueError(f"task {self.task} needs data.num_classes")
        if self.task == "superres" and self.data.scale_factor is None:
            raise ValueError("task superres needs data.scale_factor")
        return self
