"""Super-resolution: a low-resolution image to ``data.scale_factor`` times the pixels, L1 loss, PSNR and SSIM."""

from __future__ import annotations

from typing import TYPE_CHECKING

from geofm.tasks.finetuning.base import FinetuneTask

if TYPE_CHECKING:
    from torch import Tensor, nn
    from torchmetrics import Metric

    from geofm.config.finetune import FinetuneConfig
    from geofm.data.finetune import BandNormaliser, TaskData
    from geofm.tasks.finetuning.metrics import TaskMetrics

SSIM_WINDOW = 11
"""Side of the Gaussian window of torchmetrics' SSIM (its default)."""


class Superres(FinetuneTask):
    """``image`` (C, h, w) -> ``target`` (C', h*s, w*s) in ``data.hr``'s bands (padding NaN);
    ``geofm predict`` writes the high-resolution bands."""

    name = "superres"
    target = "target"
    output = "image"
    default_head = "pixel_shuffle"
    primary_metric = "psnr"
    needs_classes = False
    resolution_pairs = True
    dense = True
    float_target = True
    predicts = "image"

    @classmethod
    def check_config(cls, cfg: FinetuneConfig) -> None:
        if cfg.data.scale_factor is None:
            raise ValueError("task superres needs data.scale_factor")
        super().check_config(cfg)

    @classmethod
    def metric_names(
        cls, num_classes: int | None, class_names: list[str] | None, ignore_index: int | None
    ) -> list[str]:
        return ["psnr", "ssim"]

    @classmethod
    def data(cls) -> TaskData:
        from geofm.data.finetune import TaskData
        from geofm.data.finetune.superres import SuperresFolders

        return TaskData(cls.name, SuperresFolders, cls.target, dense=True, resolution_pairs=True)

    def build_criterion(self) -> nn.Module:
        from geofm.tasks.finetuning.losses import FiniteL1

        return FiniteL1()

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

        data_range = (0.0, self.cfg.finetune.superres_data_range)
        return {
            "psnr": PeakSignalNoiseRatio(data_range=data_range, dim=(1, 2, 3)),
            "ssim": StructuralSimilarityIndexMeasure(data_range=data_range),
        }

    def update_metrics(self, metrics: TaskMetrics, outputs: Tensor, target: Tensor) -> None:
        """Each image in scaled units (raw x ``data.scale``) on its area without padding (NaN, at the
        bottom and right of a small scene); SSIM only where the area holds its window."""
        import torch

        targets = self.target_normaliser()
        mean = torch.from_numpy(targets.mean).to(outputs.device)[None]
        std = torch.from_numpy(targets.std).to(outputs.device)[None]
        metrics.pixels.update(torch.isfinite(target).all(dim=1).sum())
        for output, image in zip(outputs * std + mean, target.float() * std + mean, strict=True):
            finite = torch.isfinite(image).all(dim=0)
            rows, cols = int(finite.any(dim=1).sum()), int(finite.any(dim=0).sum())
            if not rows or not cols:
                continue
            pair = output[None, :, :rows, :cols], image[None, :, :rows, :cols]
            metrics.collection["psnr"].update(*pair)
            if min(rows, cols) >= SSIM_WINDOW:
                metrics.collection["ssim"].update(*pair)

    def scale_factor(self) -> int:
        return int(self.cfg.data.scale_factor)

    def target_normaliser(self) -> BandNormaliser:
        """The high-resolution side's band spec (``data.hr``, or ``data``'s own)."""
        from geofm.data.finetune import BandNormaliser

        return BandNormaliser.for_targets(self.cfg.data)
