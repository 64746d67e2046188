"""The config of finetuning (``geofm finetune``, ``geofm eval``): a pretrained backbone on a downstream task.

Task families and the sample each dataset yields (after band selection and normalisation):

==================  =====================================================================
``classification``  ``image`` (C, H, W) float, ``label`` int64 scalar
``multilabel``      ``image`` (C, H, W) float, ``label`` float (num_classes,) multi-hot
``segmentation``    ``image`` (C, H, W) float, ``mask`` int64 (H, W), ``ignore_index`` unlabeled
``change``          ``image1``, ``image2`` (C, H, W) float (before, after), ``mask`` int64 (H, W) 0/1
``superres``        ``image`` (C, h, w) float low resolution, ``target`` (C', h*s, w*s) high resolution
                    (C' the bands of ``data.hr``, by default C: the same bands at both resolutions)
==================  =====================================================================

``task`` names a registered finetuning task (:data:`geofm.tasks.TASKS`; the built-in ones live in
``finetune/tasks/``, a plug-in adds more), which declares its config rules, data, head, loss and
metrics. Besides ``data`` (the downstream dataset), a config has ``model`` (the backbone, frozen or
not), ``head`` (the task head, from the head registry), ``finetune`` (layer decay, Mixup/CutMix, label smoothing, validation and
best-weights selection), ``train`` (the optimisation shared with pretraining) and ``run``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.checkpoints.layouts import EXPORT_SIDECAR, export_architecture
from geofm.config.base import ProgramConfig, Section, checks_architecture
from geofm.config.sections import BackboneConfig, RunConfig, TrainConfig, canonical_band_lists
from geofm.errors import ConfigError
from geofm.tasks import TASKS

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
    holds one folder per split (named by ``splits``) in the task's folder layout (``geofm list
    folder-layouts``; ``folders`` renames its parts). ``dataset_bands`` names the bands
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
    folders: dict[str, str] = Field(
        default_factory=dict,
        description="folders: names of the parts of a split folder, over the task's defaults, e.g. "
        "{before: t1, after: t2, mask: mask} for DSIFN-style change data (the parts: geofm list folder-layouts)",
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
        if self.torchgeo is not None and self.folders:
            raise ValueError("data.folders names the parts of split folders; a torchgeo class reads its own layout")
        if self.split is not None and self.torchgeo is not None:
            raise ValueError(
                "data.split cuts the scenes of the user's folders; a torchgeo class has its own (data.splits)"
            )
        if self.split is not None and "splits" in self.model_fields_set:
            raise ValueError(
                "data.splits names split folders; with data.split every split is a region of the scenes under data.root"
            )
        return self


class FinetuneModelConfig(BackboneConfig):
    """The backbone being finetuned; its weights come from the top-level ``checkpoint``.

    ``img_size`` is also the side of the training crops (for ``superres``: of the low-resolution input).
    """

    drop_path_rate: float = Field(default=0.1, ge=0.0, lt=1.0, description="stochastic depth of the backbone")
    frozen: bool = Field(
        default=False,
        description="freeze the backbone (eval mode, no gradients) and train the head only: a linear probe for "
        "classification, a frozen-encoder score for dense tasks",
    )


class HeadConfig(Section):
    """The task head on the backbone's features: a registered head (``geofm list heads`` says what each
    is), by default the task's own, and the settings of the built-in heads.
    """

    name: str | None = Field(default=None, description="a registered head (geofm list heads; default: the task's own)")

    decoder_channels: int = Field(default=256, gt=0, description="segmentation, change: UperNet width")
    feature_blocks: list[int] | None = Field(
        default=None,
        min_length=4,
        max_length=4,
        description="segmentation, change with a ViT: the 4 blocks (1-based) feeding strides 4, 8, 16, 32 "
        "(default: at 1/4, 1/2, 3/4 and all of the depth)",
    )
    superres_channels: int = Field(default=16, gt=0, description="superres: channels at the input resolution")
    superres_residual: bool = Field(
        default=True,
        description="superres: add the bicubically upsampled input bands to the output bands of the same names, "
        "in the output's normalisation (learn the residual); output bands that are no input band are learned whole",
    )


class FinetuneOptimConfig(Section):
    """What finetuning adds to the optimisation of ``train``: layer decay, label mixing, validation."""

    layer_decay: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="layer-wise lr decay over timm's layer groups: the head trains at the full lr, each group "
        "below at this factor of the one above",
    )
    label_smoothing: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="classification: cross-entropy label smoothing"
    )
    mixup: float = Field(default=0.0, ge=0.0, description="classification: Mixup alpha (0: off)")
    cutmix: float = Field(default=0.0, ge=0.0, description="classification: CutMix alpha (0: off)")
    mix_prob: float = Field(default=1.0, gt=0.0, le=1.0, description="probability of mixing a batch")
    mix_switch_prob: float = Field(
        default=0.5, ge=0.0, le=1.0, description="with both on: chance of CutMix instead of Mixup"
    )
    eval_every: int = Field(default=1, gt=0, description="epochs between validations")
    val_split: Split | None = Field(
        default="val",
        description="split that selects the best weights; none: no validation, the final weights are kept",
    )
    best_metric: str | None = Field(
        default=None,
        description="validation metric selecting the best weights, maximised unless the task says lower is better "
        "(default: the task's own)",
    )
    eval_batch_size: int | None = Field(default=None, gt=0, description="default: train.micro_batch_size")
    superres_data_range: float = Field(
        default=1.0, gt=0.0, description="superres: value range of scaled pixels (raw x data.scale) for PSNR and SSIM"
    )

    @property
    def mixing(self) -> bool:
        """Whether Mixup or CutMix is on."""
        return self.mixup > 0 or self.cutmix > 0


def finetune_task(name: str) -> Any:
    """The registered finetuning task ``name``: a class of ``finetune.tasks`` or of a plug-in.

    Raises:
        ConfigError: for an unregistered name (listing the nearest names), or a task that does not finetune.
    """
    task = TASKS.get(name)
    if not getattr(task, "finetunes", False):
        raise ConfigError(f"task {name!r} is a pretraining task; geofm finetune and geofm eval take a finetuning task")
    return task


def class_labels(num_classes: int, class_names: list[str] | None) -> list[str]:
    """Names of the classes in metric keys: ``data.class_names``, or ``class_0``, ``class_1``..."""
    return list(class_names) if class_names is not None else [f"class_{i}" for i in range(num_classes)]


def metric_names(
    task: str, num_classes: int | None, class_names: list[str] | None, ignore_index: int | None = None
) -> list[str]:
    """The keys of a registered task's metrics, the task's own (its ``primary_metric``) first."""
    return finetune_task(task).metric_names(num_classes, class_names, ignore_index)


ARCHITECTURE_KEYS = ("arch", "img_size", "window_size", "timm_kwargs")
"""The keys of ``model`` a finetuning config may leave to the checkpoint's ``backbone.json``."""


class FinetuneConfig(ProgramConfig):
    """Finetuning (or linear probing) of a backbone on one downstream task."""

    task: str = Field(description="a registered finetuning task (geofm list tasks)")
    checkpoint: Path | None = Field(
        default=None, description="backbone weights in any layout geofm.checkpoints reads; none: random init (baseline)"
    )
    run: RunConfig
    model: FinetuneModelConfig
    head: HeadConfig = HeadConfig()
    finetune: FinetuneOptimConfig = FinetuneOptimConfig()
    data: FinetuneDataConfig
    train: TrainConfig

    @model_validator(mode="before")
    @classmethod
    def _architecture_from_checkpoint(cls, tree: Any, info: ValidationInfo) -> Any:
        """Complete ``model`` with the architecture the checkpoint's ``backbone.json`` records (an
        export's, or a pretraining run's): the keys of :data:`ARCHITECTURE_KEYS` it leaves out.
        Stated keys win; a stated ``arch`` other than the recorded one takes nothing."""
        if not isinstance(tree, dict) or tree.get("checkpoint") is None:
            return tree
        model = tree.get("model") or {}
        missing = [key for key in ARCHITECTURE_KEYS if isinstance(model, dict) and key not in model]
        if not missing:
            return tree
        recorded = export_architecture(tree["checkpoint"])
        if recorded is None:
            if {"arch", "img_size"} & set(missing):
                raise ValueError(
                    f"model: the checkpoint {tree['checkpoint']} has no {EXPORT_SIDECAR} to take the backbone's "
                    "architecture from (a geofm export and a finished pretraining run have one); state model.arch "
                    "and model.img_size (and window_size, timm_kwargs)"
                )
            return tree
        sidecar, fields = recorded
        if model.get("arch", fields["arch"]) != fields["arch"]:
            return tree
        taken = {key: fields[key] for key in missing if key in fields}
        if taken and checks_architecture(info):
            log.info("model: %s taken from %s", ", ".join(f"{k} {v}" for k, v in taken.items()), sidecar)
        return {**tree, "model": {**model, **taken}}

    @field_validator("task")
    @classmethod
    def _registered_task(cls, task: str) -> str:
        finetune_task(TASKS.check(task))
        return task

    @model_validator(mode="after")
    def _check_task(self, info: ValidationInfo) -> FinetuneConfig:
        task, opt = finetune_task(self.task), self.finetune
        task.check_config(self)
        if opt.mixing and self.train.micro_batch_size % 2:
            raise ValueError(
                f"Mixup/CutMix pair images in a batch: train.micro_batch_size must be even, got {self.train.micro_batch_size}"
            )
        data = self.data
        names = task.metric_names(data.num_classes, data.class_names, data.ignore_index)
        if opt.best_metric is not None and opt.best_metric not in names:
            raise ValueError(
                f"finetune.best_metric {opt.best_metric!r} is not a {self.task} metric; choose one of {names}"
            )
        if checks_architecture(info):
            task.check_architecture(self)
        return self

    @property
    def primary_metric(self) -> str:
        """The validation metric that selects the best weights."""
        return self.finetune.best_metric or finetune_task(self.task).primary_metric

    @property
    def head_name(self) -> str:
        """The registered head of the model: ``head.name``, or the task's own."""
        return self.head.name or finetune_task(self.task).default_head

    @property
    def dataset_name(self) -> str:
        """The dataset's name in reports: the torchgeo class, or the data folder's name."""
        return self.data.torchgeo or self.data.root.resolve().name
