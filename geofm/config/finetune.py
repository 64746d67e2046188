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
``geofm/tasks/finetuning/``, a plug-in adds more), which declares its config rules, data, head, loss and
metrics. Besides ``data`` (the downstream dataset), a config has ``model`` (the backbone, frozen or
not), ``head`` (the task head, from the head registry), ``finetune`` (layer decay, Mixup/CutMix, label smoothing, validation and
best-weights selection), ``train`` (the optimisation shared with pretraining) and ``run``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from geofm.checkpoints.layouts import EXPORT_SIDECAR, export_architecture
from geofm.config.base import MovedKeys, ProgramConfig, Section, checks_architecture, refuse_moved_keys
from geofm.config.finetune_data import FinetuneDataConfig, Split
from geofm.config.sections import BackboneConfig, RunConfig, TrainConfig
from geofm.tasks import TASKS, finetune_task

log = logging.getLogger("geofm.config")


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


FLAT_HEAD_KEYS: MovedKeys = {
    "decoder_channels": (("upernet", "siamese_upernet"), "channels", 256),
    "feature_blocks": (("upernet", "siamese_upernet"), "feature_blocks", None),
    "superres_channels": (("pixel_shuffle",), "channels", 16),
    "superres_residual": (("pixel_shuffle",), "residual", True),
}
"""Keys of ``head`` in configs written before each head kept its own settings in ``head.options``:
the heads that read each, its name in their ``options`` and its default then."""


class HeadConfig(Section):
    """The task head on the backbone's features: a registered head (``geofm list heads`` says what each
    is and its options), by default the task's own, and the head's own settings (``options``).
    """

    name: str | None = Field(default=None, description="a registered head (geofm list heads; default: the task's own)")
    options: dict[str, Any] = Field(
        default_factory=dict, description="the head's own settings, checked by the head (geofm list heads)"
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_to_options(cls, data: Any) -> Any:
        moved = {key: option for key, (_, option, _) in FLAT_HEAD_KEYS.items()}
        return refuse_moved_keys(data, moved, "a head's own settings go in head.options (geofm list heads)")


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
