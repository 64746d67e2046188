"""What every finetuning task shares: the declarations config validation reads, and the training forward.

A task is a class registered in :data:`geofm.tasks.TASKS`. Its class attributes and classmethods
(config rules, metric names, the data declaration) are read while a config is validated, so this
module and the task modules import torch, timm and torchmetrics only inside the methods that run
a model. An instance is bound to one config and holds its loss and label mixing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from geofm.models.heads import HEADS

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn
    from torchmetrics import Metric

    from geofm.config.finetune import FinetuneConfig
    from geofm.data.finetune import TaskData
    from geofm.tasks import StepOutput
    from geofm.tasks.finetuning.metrics import TaskMetrics


class FinetuneTask(ABC):
    """A finetuning task family, declared in one place.

    Attributes:
        name: the task's registered name.
        inputs: the sample keys the model is called with, in order.
        target: the sample key of the target.
        output: what the model returns (``"logits"``, ``"dense"``, ``"image"``); a head fits the
            task when its ``inputs`` and ``output`` are the task's.
        default_head: the head of :data:`geofm.models.heads.HEADS` without ``head.name``.
        primary_metric: the metric selecting the best weights without ``finetune.best_metric``.
        lower_is_better: metrics whose best value is the lowest (the others: the highest).
        needs_classes: ``data.num_classes`` is required.
        mixes: Mixup, CutMix and label smoothing apply.
        resolution_pairs: ``data.scale_factor`` and ``data.hr`` describe a high-resolution target.
        dense: evaluation tiles scenes and the metrics count the scored target pixels;
            otherwise one view per scene.
        float_target: the loss takes the target as float32 (multi-hot labels, images).
        predicts: what ``geofm predict`` writes from the model's outputs: ``"classes"`` (a class
            map), ``"image"`` (the high-resolution bands), or None (the task is not predicted).
        scenes: the scenes ``geofm predict`` takes, one per input, for messages.
    """

    kind: ClassVar[str] = "finetuning"
    name: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]] = ("image",)
    target: ClassVar[str]
    output: ClassVar[str]
    default_head: ClassVar[str]
    primary_metric: ClassVar[str]
    lower_is_better: ClassVar[frozenset[str]] = frozenset()
    needs_classes: ClassVar[bool] = True
    mixes: ClassVar[bool] = False
    resolution_pairs: ClassVar[bool] = False
    dense: ClassVar[bool] = False
    float_target: ClassVar[bool] = False
    predicts: ClassVar[str | None] = None
    scenes: ClassVar[str] = "one scene"

    def __init__(self, cfg: FinetuneConfig) -> None:
        """Bind the task to a validated config: its loss and (training) label mixing."""
        self.cfg = cfg
        self.criterion = self.build_criterion()
        self.mixing = self.build_mixing()

    # --- declarations read while a config is validated (no torch) ---

    @classmethod
    def check_config(cls, cfg: FinetuneConfig) -> None:
        """The task's rules on a config's keys and values.

        Raises:
            ValueError: naming the field and what the task expects.
        """
        data, opt = cfg.data, cfg.finetune
        if cls.needs_classes and data.num_classes is None:
            raise ValueError(f"task {cfg.task} needs data.num_classes")
        if not cls.resolution_pairs and data.hr is not None:
            raise ValueError(
                f"data.hr describes the high-resolution side of super-resolution pairs, not of {cfg.task} data"
            )
        if not cls.mixes and (opt.mixing or opt.label_smoothing):
            raise ValueError(f"finetune.mixup, cutmix and label_smoothing apply to classification, not {cfg.task}")
        if not cls.dense and (data.chip_size is not None or data.split is not None):
            raise ValueError(
                f"data.chip_size and data.split cut scenes with per-pixel targets; a {cfg.task} scene is one "
                "sample with one label (data.crops_per_scene draws several crops of it)"
            )
        windows = {"data.chip_size": data.chip_size, "data.split.block": data.split and data.split.block}
        for field, side in windows.items():
            if side is not None and side < cfg.model.img_size:
                raise ValueError(
                    f"{field} {side} is smaller than model.img_size {cfg.model.img_size}: training crops would be "
                    "part padding"
                )
        if cfg.head.name is not None:
            try:
                HEADS.check(cfg.head.name)
            except ValueError as err:
                raise ValueError(f"head.name: {err}") from None

    @classmethod
    def check_architecture(cls, cfg: FinetuneConfig) -> None:
        """The rules that need the backbone's architecture or the head's class (importing torch).

        Raises:
            ValueError: naming the field and what the task expects.
        """
        head = HEADS.get(cfg.head_name)
        if tuple(head.inputs) != cls.inputs or head.output != cls.output:
            raise ValueError(
                f"head.name {cfg.head_name!r} takes {list(head.inputs)} and returns {head.output} outputs; task "
                f"{cfg.task} needs {list(cls.inputs)} -> {cls.output} (its own head: {cls.default_head!r})"
            )
        head.check(cfg)

    @classmethod
    def metric_names(
        cls, num_classes: int | None, class_names: list[str] | None, ignore_index: int | None
    ) -> list[str]:
        """The keys of the task's metrics, :attr:`primary_metric` first."""
        return [cls.primary_metric]

    @classmethod
    @abstractmethod
    def data(cls) -> TaskData:
        """What the task reads: folder layout, torchgeo samples, tiling (see :class:`geofm.data.finetune.TaskData`)."""

    # --- the model's side (torch) ---

    @abstractmethod
    def build_criterion(self) -> nn.Module:
        """The training loss of (outputs, target)."""

    def build_mixing(self) -> Any:
        """Label mixing of training batches (a callable of (images, target)), or None."""
        return None

    @abstractmethod
    def metrics(self) -> dict[str, Metric]:
        """The torchmetrics of the task; a per-class metric yields ``<name>/<class>`` keys."""

    def update_metrics(self, metrics: TaskMetrics, outputs: Tensor, target: Tensor) -> None:
        """Add a batch's (detached, float) outputs and target to ``metrics``."""
        metrics.collection.update(outputs, target)

    def improves(self, metric: str, value: float, best: float) -> bool:
        """Whether ``value`` of ``metric`` beats ``best``."""
        return value < best if metric in self.lower_is_better else value > best

    def model_inputs(self, batch: dict[str, Tensor], device: torch.device, dtype: torch.dtype) -> list[Tensor]:
        """The model's inputs of a batch, on ``device`` in ``dtype``."""
        return [batch[key].to(device, dtype, non_blocking=True) for key in self.inputs]

    def batch_target(self, batch: dict[str, Tensor], device: torch.device) -> Tensor:
        """The target of a batch, on ``device``."""
        return batch[self.target].to(device, non_blocking=True)

    def forward(
        self, model: nn.Module, batch: dict[str, Tensor], device: torch.device, dtype: torch.dtype, mix: bool = True
    ) -> StepOutput:
        """One micro-batch: inputs and target, outputs and loss. Where the task mixes, ``mix`` mixes the
        batch (training); without it the loss takes the unmixed batch's targets as the mixing makes
        them (one-hot, label-smoothed), as a validation loss does."""
        from geofm.tasks import StepOutput

        inputs = self.model_inputs(batch, device, dtype)
        target = self.batch_target(batch, device)
        if self.mixing is not None and mix:
            inputs[0], target = self.mixing(inputs[0], target)
        elif self.mixing is not None:
            from timm.data.mixup import mixup_target

            target = mixup_target(target, self.mixing.num_classes, 1.0, self.mixing.label_smoothing)
        outputs = model(*inputs)
        loss = self.criterion(outputs.float(), target.float() if self.float_target else target)
        return StepOutput({"loss": loss}, outputs)

    def scale_factor(self) -> int:
        """Output / input resolution of the model."""
        return 1

    def target_normaliser(self) -> Any:
        """The band spec of image outputs (a :class:`~geofm.data.finetune.BandNormaliser`), or None."""
        return None


class MaskTask(FinetuneTask):
    """Per-pixel classes on UperNet (segmentation, change): masks with unscored pixels, tiled evaluation."""

    target = "mask"
    output = "dense"
    dense = True
    predicts = "classes"

    @classmethod
    def check_architecture(cls, cfg: FinetuneConfig) -> None:
        from geofm.models.backbones import arch_info

        info = arch_info(cfg.model.arch, cfg.model.timm_kwargs)
        if cfg.train.micro_batch_size < 2:
            raise ValueError(
                "UperNet's pooling branch normalises over the batch: segmentation and change need train.micro_batch_size >= 2"
            )
        if cfg.model.img_size % 32:
            raise ValueError(
                f"model.img_size {cfg.model.img_size}: UperNet's features at strides 4-32 need a multiple of 32"
            )
        if info.family == "vit" and (info.patch_size & (info.patch_size - 1) or info.patch_size < 4):
            raise ValueError(
                f"a ViT's features reach strides 4-32 by factors of 2 from its patch size; "
                f"{info.patch_size} is not a power of 2 >= 4"
            )
        super().check_architecture(cfg)

    def build_criterion(self) -> nn.Module:
        from geofm.tasks.finetuning.losses import LabelledCrossEntropy

        return LabelledCrossEntropy(self.cfg.data.unscored_label)

    def update_metrics(self, metrics: TaskMetrics, outputs: Tensor, target: Tensor) -> None:
        metrics.pixels.update((target != self.cfg.data.unscored_label).sum())
        metrics.collection.update(outputs.argmax(dim=1), target)


__all__ = ["FinetuneTask", "MaskTask"]
