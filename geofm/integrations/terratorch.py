"""geofm exports as TerraTorch backbones: ``geofm_export`` in TerraTorch's ``BACKBONE_REGISTRY``.

TerraTorch (1.2) finds third-party backbones through its custom modules: a package it imports
before building the model, named by ``custom_modules_path`` (a top-level key of a ``terratorch``
config, the ``--custom_modules_path`` option or ``TERRATORCH_CUSTOM_MODULE_PATH``), or a
``custom_modules`` package in the working directory. It reads no entry points. geofm's package for
that is :mod:`geofm_terratorch` (the folder ``geofm_terratorch/`` next to ``geofm/``); importing
it calls :func:`register`, which adds the source ``geofm`` to the registry. A config then names the
backbone and its export::

    custom_modules_path: geofm_terratorch        # the folder, relative to the working directory
    model:
      class_path: terratorch.tasks.SemanticSegmentationTask
      init_args:
        model_factory: EncoderDecoderFactory
        model_args:
          backbone: geofm_export
          backbone_path: runs/my_pretraining      # export folder, backbone.safetensors or backbone.json
          backbone_bands: [blue, green, red, nir]  # the dataset's bands, in its order
          backbone_normalise: true                 # the datamodule passes raw values
          decoder: UperNetDecoder
          num_classes: 6

:func:`geofm_backbone` builds the model (also without TerraTorch): the export's timm backbone,
loaded as geofm loads it (:func:`geofm.checkpoints.build_backbone`: the patch kernels follow the
band names, so the dataset's bands may be any of the export's in any order), giving a list of NCHW
feature maps (a Swin's stages, four of a ViT's blocks), as geofm's own dense heads take them.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from geofm.checkpoints.build import build_backbone
from geofm.checkpoints.layouts import BandStatistics, export_band_statistics, read_export_sidecar, sidecar_of
from geofm.data.bands import UnknownBandError, canonical_band, canonical_bands
from geofm.errors import CheckpointNotFoundError, ConfigError
from geofm.models.backbones import backbone_family, create_backbone, is_swin

SOURCE = "geofm"
"""The prefix of geofm's backbones in TerraTorch's ``BACKBONE_REGISTRY`` (``geofm_export``)."""


class GeofmBackbone(nn.Module):
    """A geofm export's timm backbone as a TerraTorch backbone: ``forward`` gives NCHW feature maps.

    Attributes:
        model: the timm backbone (``num_classes=0``), in timm's names as the export holds them.
        bands: the input bands, in order (canonical names).
        out_indices: the Swin stages or ViT blocks whose outputs ``forward`` returns (0-based).
        out_channels: the channels of those maps (TerraTorch sizes decoders by it).
        img_size: the (height, width) the model takes.
        statistics: the export's pretraining normalisation of ``bands`` (None where it records none).
        input_scale: with ``normalise``, the factor from input values to those the statistics are in.
        sidecar: the export's ``backbone.json``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        bands: Sequence[str],
        out_indices: Sequence[int],
        statistics: BandStatistics | None,
        normalise: bool,
        input_scale: float | None,
        sidecar: dict[str, Any],
    ) -> None:
        super().__init__()
        self.model = model
        self.bands = list(bands)
        self.out_indices = list(out_indices)
        self.out_channels = [int(model.feature_info[i]["num_chs"]) for i in self.out_indices]
        size = model.patch_embed.img_size
        self.img_size = (size, size) if isinstance(size, int) else tuple(size)
        self.statistics = statistics
        self.sidecar = sidecar
        self.normalise = normalise
        self.input_scale = None
        if normalise:
            self.input_scale = float(statistics.scale if input_scale is None else input_scale)
            shape = (1, len(self.bands), 1, 1)
            self.register_buffer("mean", torch.tensor(statistics.mean).view(shape), persistent=False)
            self.register_buffer("std", torch.tensor(statistics.std).view(shape), persistent=False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Feature maps (B, C_i, H_i, W_i) of ``out_indices`` for images (B, bands, *img_size)."""
        if x.shape[1] != len(self.bands) or tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"the geofm backbone takes {len(self.bands)} bands {self.bands} at {self.img_size[0]}x"
                f"{self.img_size[1]} px, got input of shape {tuple(x.shape)}: set backbone_bands to the data's "
                "bands and backbone_img_size to its size"
            )
        if self.normalise:
            x = (x * self.input_scale - self.mean) / self.std
        return self.model.forward_intermediates(x, indices=self.out_indices, intermediates_only=True)


def geofm_backbone(
    path: str | Path,
    bands: Sequence[str | Enum] | None = None,
    *,
    out_indices: Sequence[int] | None = None,
    img_size: int | None = None,
    normalise: bool = False,
    source: str | None = None,
    input_scale: float | None = None,
    pretrained: bool = True,
    padding: str | None = None,
    patch_size: int | Sequence[int] | None = None,
) -> GeofmBackbone:
    """The backbone of a geofm export, for TerraTorch (registered as ``geofm_export``).

    Args:
        path: the export folder (or a pretraining run's, which holds its export), its
            ``backbone.safetensors`` or its ``backbone.json``.
        bands: the input bands in the data's order (TerraTorch's ``HLSBands`` or names; names are
            geofm's band vocabulary, case-insensitive, e.g. ``red``, ``b04``, ``RED``); each must be
            one of the export's bands, whose kernel it gets. Default: the export's bands in its order.
        out_indices: Swin stages or ViT blocks (0-based, negative from the end) whose maps ``forward``
            returns. Default: every Swin stage; a ViT's blocks at 1/4, 1/2, 3/4 and all of its depth.
        img_size: the input size, when it differs from the export's (a Swin keeps its windows,
            a ViT's position embedding is resampled).
        normalise: the inputs are unnormalised: the backbone applies the export's pretraining
            statistics, ``(x * input_scale - mean) / std``. False: the data module normalises.
        source: the pretraining source whose statistics apply (default: the first with all ``bands``).
        input_scale: with ``normalise``, the factor from input values to the source's physical
            values (default: the source's own ``scale``, i.e. the inputs are its raw values, such as
            Sentinel-2 L2A digital numbers; 1 for inputs already in reflectance).
        pretrained: load the export's weights (False: its architecture, freshly initialised).
        padding, patch_size: read by TerraTorch's model factory (padding of inputs to a multiple of
            the patch size); ``patch_size``, where given, must be the export's.

    Raises:
        CheckpointNotFoundError: no export sidecar at ``path``.
        CheckpointFormatError: the sidecar is not a geofm export's.
        ConfigError: bands the export lacks, out-of-range ``out_indices``, statistics missing for
            ``normalise``, or a ``patch_size`` other than the export's.
    """
    del padding  # TerraTorch's factory pads the inputs itself
    if not Path(path).expanduser().exists():
        raise CheckpointNotFoundError(
            f"backbone_path: {path} does not exist (expected a geofm export folder, its backbone.safetensors or "
            "backbone.json, or a pretraining run folder holding them)"
        )
    sidecar_path = sidecar_of(path)
    sidecar = read_export_sidecar(sidecar_path)
    bands = _bands(sidecar, bands, sidecar_path)
    statistics = export_band_statistics(sidecar, bands, source)
    if normalise and statistics is None:
        raise ConfigError(
            f"backbone_normalise: {sidecar_path} records no normalisation statistics; normalise the inputs in "
            "the data module instead"
        )
    if pretrained:
        model, _, _ = build_backbone(sidecar_path.with_suffix(".safetensors"), bands=bands, img_size=img_size)
        model.train()  # as a freshly built module: the task decides the mode
    else:
        kwargs = {**sidecar["timm_kwargs"], "in_chans": len(bands)}
        if img_size is not None:
            kwargs["img_size"] = int(img_size)
        model = create_backbone(sidecar["arch"], kwargs)
    _check_patch_size(model, patch_size, sidecar_path)
    return GeofmBackbone(
        model,
        bands=bands,
        out_indices=_out_indices(model, out_indices, sidecar["arch"]),
        statistics=statistics,
        normalise=normalise,
        input_scale=input_scale,
        sidecar=sidecar,
    )


def register() -> None:
    """Add the source ``geofm`` (backbone ``geofm_export``: :func:`geofm_backbone`) to TerraTorch's
    ``BACKBONE_REGISTRY``; a second call changes nothing."""
    from terratorch.registry import BACKBONE_REGISTRY, Registry

    try:
        BACKBONE_REGISTRY[SOURCE]  # its sources by prefix (`in` asks for a model name)
    except KeyError:
        BACKBONE_REGISTRY.register_source(SOURCE, Registry(export=geofm_backbone))


def _bands(sidecar: dict[str, Any], bands: Sequence[str | Enum] | None, where: Path) -> list[str]:
    """The input bands in canonical names, each one of the export's."""
    in_chans = int(sidecar["timm_kwargs"].get("in_chans", 3))
    have = sidecar.get("bands")
    if not have:
        if bands is None or len(bands) != in_chans:
            raise ConfigError(
                f"backbone_bands: {where} names no bands; list the export's {in_chans} input bands in its order"
            )
        have = [str(getattr(b, "value", b)) for b in bands]
    have = canonical_bands(have, custom=have, where=f"{where} bands")
    if bands is None:
        return have
    wanted = []
    for band in bands:
        name = str(getattr(band, "value", band))
        try:
            wanted.append(canonical_band(name, custom=have))
        except UnknownBandError:
            raise ConfigError(
                f"backbone_bands: unknown band {name!r}: expected geofm's band names (case-insensitive, e.g. red, "
                f"nir, b08), each one of the export's bands {have}"
            ) from None
    repeated = sorted({b for b in wanted if wanted.count(b) > 1})
    if repeated:
        raise ConfigError(f"backbone_bands: {[str(getattr(b, 'value', b)) for b in bands]} names {repeated} twice")
    missing = [b for b in wanted if b not in have]
    if missing:
        raise ConfigError(
            f"backbone_bands: {missing} are not among the bands the export was pretrained on, {have} ({where}); "
            "give the data's bands in its order, each one of these"
        )
    return wanted


def _out_indices(model: nn.Module, out_indices: Sequence[int] | None, arch: str) -> list[int]:
    depth = len(model.feature_info)
    if out_indices is None:
        if is_swin(model):
            return list(range(depth))
        return sorted({max(depth * k // 4, 1) - 1 for k in (1, 2, 3, 4)})
    bad = [i for i in out_indices if not -depth <= int(i) < depth]
    if bad:
        unit = "stages" if backbone_family(arch) == "swin" else "blocks"
        raise ConfigError(f"backbone_out_indices: {bad} out of range for {arch}'s {depth} {unit}")
    return [int(i) % depth for i in out_indices]


def _check_patch_size(model: nn.Module, patch_size: int | Sequence[int] | None, where: Path) -> None:
    if patch_size is None:
        return
    have = tuple(model.patch_embed.patch_size)
    asked = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)[-2:]
    if tuple(int(p) for p in asked) != have:
        raise ConfigError(f"backbone_patch_size: {patch_size} differs from the export's patch size {have} ({where})")
