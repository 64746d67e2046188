"""Finetuning models: a timm backbone under ``backbone`` with a head of :data:`geofm.models.heads.HEADS`.

Every model keeps the backbone as one plain timm model (its state dict is exactly what
:mod:`geofm.checkpoints` loads and exports), exposes timm's ``group_matcher`` and
``no_weight_decay`` of that backbone under the ``backbone.`` prefix, and so gets layer-wise lr decay
from timm's own ``param_groups_layer_decay``. Heads and decoders match none of the backbone's groups:
timm puts them in the top group, at the full learning rate.

Each head's own settings are its ``Options`` model, read from ``head.options`` (``geofm list heads``
prints every head with them).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, Field
from timm.optim import param_groups_layer_decay
from torch import Tensor, nn

from geofm.checkpoints import LoadReport, load_backbone_for_bands
from geofm.config.base import Section
from geofm.config.finetune import FinetuneConfig
from geofm.data.finetune import BandNormaliser
from geofm.models.backbones import arch_info, backbone_kwargs, create_backbone, is_swin, resize_input
from geofm.models.decoders import PYRAMID_STRIDES, SimpleFeaturePyramid, SuperresHead, UperNetHead
from geofm.models.heads import HEADS
from geofm.registry import entry_options

BACKBONE = "backbone"


def _prefixed(pattern: str) -> str:
    """A timm group regex anchored under ``backbone.`` (a non-capturing group keeps its group numbers)."""
    return rf"^{BACKBONE}\.(?:{pattern.removeprefix('^')})"


class FinetuneModel(nn.Module):
    """A timm backbone and a task head; a frozen backbone gets no gradients and stays in eval mode.

    A subclass registered in :data:`geofm.models.heads.HEADS` declares the sample keys it is called with
    (``inputs``), the kind of its output (``output``: logits, dense or image), its own settings
    (``Options``, a pydantic model of ``head.options``; None: it takes none), its rules on a config
    (:meth:`check`) and builds itself with a classmethod ``from_config(backbone, cfg)``.
    """

    inputs: ClassVar[tuple[str, ...]] = ("image",)
    output: ClassVar[str] = "logits"
    Options: ClassVar[type[BaseModel] | None] = None

    @classmethod
    def options_of(cls, cfg: FinetuneConfig) -> Any:
        """The head's own settings: ``head.options`` validated by :attr:`Options` (None: it takes none).

        Raises:
            ValueError: naming the bad field of ``head.options``.
        """
        return entry_options(cfg.head_name, cls.Options, cfg.head.options, "head.options")

    @classmethod
    def check(cls, cfg: FinetuneConfig) -> None:
        """The head's rules on a config (run with the architecture checks): its options by default.

        Raises:
            ValueError: naming the field and what the head expects.
        """
        cls.options_of(cfg)

    def __init__(self, backbone: nn.Module, frozen: bool) -> None:
        """Initialise a new FinetuneModel instance.

        Args:
            backbone: a timm Swin or ViT.
            frozen: freeze the backbone (linear probing, frozen-encoder evaluation).
        """
        super().__init__()
        self.backbone = backbone
        self.frozen = frozen
        if frozen:
            backbone.requires_grad_(False)

    def train(self, mode: bool = True) -> FinetuneModel:
        """Set training mode; a frozen backbone stays in eval mode (no drop path, fixed statistics)."""
        super().train(mode)
        if self.frozen:
            self.backbone.eval()
        return self

    def _backbone_grad(self) -> torch.set_grad_enabled:
        """Gradient mode for running the backbone: off when it is frozen."""
        return torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen)

    def size_multiple(self) -> int:
        """The input sides the model takes are the multiples of this: its backbone's coarsest feature stride."""
        return max(info["reduction"] for info in self.backbone.feature_info)

    def set_input_size(self, size: int) -> None:
        """Take ``size`` x ``size`` inputs from now on, ``size`` a multiple of :meth:`size_multiple`
        (see :func:`geofm.models.backbones.resize_input`)."""
        resize_input(self.backbone, size)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """timm's layer groups of the backbone, under ``backbone.``; the head matches none (top group)."""
        groups = self.backbone.group_matcher(coarse=coarse)
        return {
            name: _prefixed(spec) if isinstance(spec, str) else [(_prefixed(p), suffix) for p, suffix in spec]
            for name, spec in groups.items()
        }

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """The backbone's position tables and tokens (timm's list), under ``backbone.``."""
        return {f"{BACKBONE}.{name}" for name in self.backbone.no_weight_decay()}

    def param_groups(self, weight_decay: float, layer_decay: float) -> list[dict]:
        """AdamW groups from timm's ``param_groups_layer_decay``: each group's ``lr_scale`` is
        ``layer_decay ** (top - layer)``; no weight decay on norms, biases and position tables.

        timm's grouping puts the stem (patch embedding, and a ViT's tokens and position embedding)
        in layer 0, each transformer block in its own layer (a Swin stage's patch merging with its
        first block, the final norm with the last block) and the head above them: with ``n``
        blocks, the patch embedding trains at ``layer_decay ** (n + 1)`` times the head's rate.
        Frozen parameters are left out.
        """
        return param_groups_layer_decay(
            self, weight_decay=weight_decay, no_weight_decay_list=self.no_weight_decay(), layer_decay=layer_decay
        )


class Classifier(FinetuneModel):
    """timm's own classifier head on pooled backbone features: logits (B, num_classes)."""

    def __init__(self, backbone: nn.Module, num_classes: int, frozen: bool) -> None:
        super().__init__(backbone, frozen)
        backbone.reset_classifier(num_classes)
        if frozen:
            backbone.get_classifier().requires_grad_(True)

    @classmethod
    def from_config(cls, backbone: nn.Module, cfg: FinetuneConfig) -> Classifier:
        return cls(backbone, cfg.data.num_classes, cfg.model.frozen)

    def forward(self, image: Tensor) -> Tensor:
        with self._backbone_grad():
            features = self.backbone.forward_features(image)
        return self.backbone.forward_head(features)


class DenseFeatures(FinetuneModel):
    """A backbone giving multi-scale features: a Swin's stages (strides 4-32 with patch size 4), or
    four of a ViT's blocks through a :class:`~geofm.models.decoders.SimpleFeaturePyramid` (strides 4-32)."""

    def __init__(self, backbone: nn.Module, frozen: bool, feature_blocks: list[int] | None) -> None:
        super().__init__(backbone, frozen)
        info = backbone.feature_info
        if is_swin(backbone):
            self.indices, self.neck = None, None
            self.channels = [f["num_chs"] for f in info]
            self.first_stride = info[0]["reduction"]
        else:
            depth = len(info)
            blocks = feature_blocks or [depth // 4, depth // 2, 3 * depth // 4, depth]
            self.indices = [b - 1 for b in blocks]
            self.neck = SimpleFeaturePyramid(info[0]["num_chs"], info[0]["reduction"])
            self.channels = [info[0]["num_chs"]] * len(PYRAMID_STRIDES)
            self.first_stride = PYRAMID_STRIDES[0]

    def size_multiple(self) -> int:
        """A multiple of the backbone's coarsest stride and of UperNet's, 32."""
        return math.lcm(super().size_multiple(), PYRAMID_STRIDES[-1])

    def features(self, image: Tensor) -> list[Tensor]:
        """Feature maps at strides 4, 8, 16, 32, NCHW."""
        with self._backbone_grad():
            maps = self.backbone.forward_intermediates(image, indices=self.indices, intermediates_only=True)
        return maps if self.neck is None else self.neck(maps)


class UperNetOptions(Section):
    """The settings of the UperNet heads (``upernet``, ``siamese_upernet``): ``head.options``."""

    channels: int = Field(default=256, gt=0, description="UperNet's width")
    feature_blocks: list[int] | None = Field(
        default=None,
        min_length=4,
        max_length=4,
        description="with a ViT: the 4 blocks (1-based) feeding strides 4, 8, 16, 32 (default: at 1/4, 1/2, 3/4 and "
        "all of the depth)",
    )


class Segmenter(DenseFeatures):
    """UperNet on the backbone's multi-scale features: logits (B, num_classes, H, W)."""

    output = "dense"
    Options = UperNetOptions

    @classmethod
    def check(cls, cfg: FinetuneConfig) -> None:
        """``feature_blocks`` name blocks of a ViT backbone."""
        blocks = cls.options_of(cfg).feature_blocks
        if blocks is None:
            return
        info = arch_info(cfg.model.arch, cfg.model.timm_kwargs)
        if info.family != "vit":
            raise ValueError("head.options.feature_blocks choose the blocks of a ViT backbone")
        if sorted(set(blocks)) != blocks or not 1 <= blocks[0] <= blocks[-1] <= info.depth:
            raise ValueError(
                f"head.options.feature_blocks must be 4 increasing blocks in [1, {info.depth}], got {blocks}"
            )

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        frozen: bool,
        feature_blocks: list[int] | None,
        decoder_channels: int,
    ) -> None:
        super().__init__(backbone, frozen, feature_blocks)
        self.head = UperNetHead(self.channels, num_classes, decoder_channels, self.first_stride)

    @classmethod
    def from_config(cls, backbone: nn.Module, cfg: FinetuneConfig) -> DenseFeatures:
        options = cls.options_of(cfg)
        return cls(backbone, cfg.data.num_classes, cfg.model.frozen, options.feature_blocks, options.channels)

    def forward(self, image: Tensor) -> Tensor:
        return self.head(self.features(image))


class ChangeDetector(Segmenter):
    """A siamese backbone: both dates go through the same backbone (one batch), and UperNet decodes
    the absolute feature difference at every scale: logits (B, num_classes, H, W)."""

    inputs = ("image1", "image2")
    output = "dense"

    def forward(self, image1: Tensor, image2: Tensor) -> Tensor:
        both = self.features(torch.cat([image1, image2]))
        n = image1.shape[0]
        return self.head([(f[:n] - f[n:]).abs() for f in both])


def superres_residual(inputs: BandNormaliser, targets: BandNormaliser) -> tuple[Tensor, Tensor]:
    """The fixed map adding the (upsampled) input bands to the output bands of the same names.

    A normalised input band ``x`` is ``x * std_in + mean_in`` in scaled units (raw x scale);
    the residual of the output band of its name is that value in the output's normalisation,
    ``(x * std_in + mean_in - mean_out) / std_out``. This takes both sides' scaled values to be in
    the same units (e.g. reflectance). Output bands that are no input band get no residual.

    Returns:
        Weights (output bands, input bands) and bias (output bands,); the identity with one band spec.
    """
    weight = torch.zeros(len(targets.bands), len(inputs.bands))
    bias = torch.zeros(len(targets.bands))
    for o, band in enumerate(targets.bands):
        if band in inputs.bands:
            i = inputs.bands.index(band)
            std_in, mean_in = float(inputs.std[i, 0, 0]), float(inputs.mean[i, 0, 0])
            std_out, mean_out = float(targets.std[o, 0, 0]), float(targets.mean[o, 0, 0])
            weight[o, i] = std_in / std_out
            bias[o] = (mean_in - mean_out) / std_out
    return weight, bias


class PixelShuffleOptions(Section):
    """The settings of the ``pixel_shuffle`` super-resolution head: ``head.options``."""

    channels: int = Field(default=16, gt=0, description="channels at the input resolution")
    residual: bool = Field(
        default=True,
        description="add the bicubically upsampled input bands to the output bands of the same names, in the "
        "output's normalisation (learn the residual); output bands that are no input band are learned whole",
    )


class SuperResolver(FinetuneModel):
    """A SimMIM-style decoder of the backbone's last (normed) features to the input resolution, then a
    PixelShuffle upsampler to the high-resolution bands, plus the upsampled input bands of the same
    names (:class:`~geofm.models.decoders.SuperresHead`): (B, C', H*s, W*s)."""

    output = "image"
    Options = PixelShuffleOptions

    def __init__(
        self,
        backbone: nn.Module,
        bands: int,
        scale_factor: int,
        hidden: int,
        residual: tuple[Tensor, Tensor] | None,
        frozen: bool,
    ) -> None:
        """Initialise a new SuperResolver instance.

        Args:
            backbone: a timm Swin or ViT.
            bands: output bands (those of the high-resolution side).
            scale_factor: high / low resolution ratio.
            hidden: the head's channels at the input resolution.
            residual: the map of :func:`superres_residual`, or None for no residual.
            frozen: freeze the backbone.
        """
        super().__init__(backbone, frozen)
        last = backbone.feature_info[-1]
        self.head = SuperresHead(last["num_chs"], last["reduction"], bands, hidden, scale_factor, residual)

    @classmethod
    def from_config(cls, backbone: nn.Module, cfg: FinetuneConfig) -> SuperResolver:
        data, options = cfg.data, cls.options_of(cfg)
        targets = BandNormaliser.for_targets(data)
        residual = superres_residual(BandNormaliser.from_config(data), targets) if options.residual else None
        return cls(backbone, len(targets.bands), data.scale_factor, options.channels, residual, cfg.model.frozen)

    def forward(self, image: Tensor) -> Tensor:
        with self._backbone_grad():
            features = self.backbone.forward_intermediates(image, indices=1, norm=True, intermediates_only=True)[-1]
        return self.head(features, image)


def finetune_backbone_kwargs(cfg: FinetuneConfig) -> dict[str, Any]:
    """``timm.create_model`` kwargs of the headless backbone of a finetuning config."""
    m = cfg.model
    return backbone_kwargs(
        in_chans=len(cfg.data.bands), img_size=m.img_size, window_size=m.window_size, timm_kwargs=m.timm_kwargs
    )


def build_finetune_model(cfg: FinetuneConfig, load_weights: bool = True) -> tuple[FinetuneModel, LoadReport | None]:
    """The model of ``cfg``'s head (:data:`geofm.models.heads.HEADS`), its backbone loaded from ``cfg.checkpoint`` (bands mapped by name).

    Args:
        cfg: the finetuning config.
        load_weights: load ``cfg.checkpoint`` into the backbone (False: leave it random, e.g. to load
            a finetuned model's own weights next).

    Returns:
        The model and the load report of the checkpoint (None without one). The report's
        ``fresh_bands`` are the task's bands the checkpoint has no kernel for.

    Raises:
        ConfigError: if none of the task's bands is among the checkpoint's.
        CheckpointFormatError: if the checkpoint does not fit the configured architecture.
    """
    backbone = create_backbone(cfg.model.arch, finetune_backbone_kwargs(cfg), drop_path_rate=cfg.model.drop_path_rate)
    report = None
    if load_weights and cfg.checkpoint is not None:
        report = load_backbone_for_bands(backbone, cfg.checkpoint, cfg.data.bands)
    return HEADS.get(cfg.head_name).from_config(backbone, cfg), report
