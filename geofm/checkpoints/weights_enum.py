"""torchgeo-style weights for an export: a ``WeightsEnum`` member with transforms and meta.

torchgeo describes pretrained weights with torchvision's ``Weights(url, transforms, meta)`` inside a
``WeightsEnum`` subclass; its trainers (``torchgeo.tasks.Classification(weights=...)``, in 0.9
``torchgeo.trainers.ClassificationTask``) and model builders call ``weights.get_state_dict(progress=...)``.
:func:`torchgeo_weights` makes such a member for an export::

    weights = torchgeo_weights("runs/my_run")
    model = timm.create_model(weights.meta["model"], **weights.meta["timm_kwargs"])
    model.load_state_dict(weights.get_state_dict(progress=False))
    batch = weights.transforms(raw_images)   # (raw * scale - mean) / std, in the model's band order

The ``url`` is the export's ``file://`` address. torchvision's own ``get_state_dict`` would copy
the file into torch hub's cache under its base name and afterwards load whatever is cached under
that name; every export is called ``backbone.safetensors``, so a second export would silently get
the first one's weights. The members made here read the local file in place instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
import torchvision.transforms.v2 as T
from safetensors.torch import load_file as load_safetensors
from torch import nn
from torchvision.models import Weights, WeightsEnum

from geofm.checkpoints.io import EXPORT_WEIGHTS, resolve_checkpoint_path
from geofm.checkpoints.layouts import export_band_statistics, read_export_sidecar
from geofm.errors import CheckpointFormatError, ConfigError

PUBLICATIONS = {
    "gfm": "https://arxiv.org/abs/2302.04476",
    "simmim": "https://arxiv.org/abs/2111.09886",
    "simmim+finetune": "https://arxiv.org/abs/2111.09886",
}


class GeoFMWeights(WeightsEnum):  # type: ignore[misc]
    """Base of the weight enums made by :func:`torchgeo_weights`: reads local exports in place."""

    def get_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """The backbone's state dict (timm names), read from the local export file.

        Accepts and ignores torchvision's arguments (``progress``...).
        """
        parsed = urlparse(self.url)
        if parsed.scheme != "file":
            return super().get_state_dict(*args, **kwargs)
        path = Path(unquote(parsed.path))
        if path.suffix == ".safetensors":
            return load_safetensors(str(path), device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)


def torchgeo_weights(
    export: str | Path,
    *,
    source: str | None = None,
    name: str | None = None,
    dataset: str | None = None,
    publication: str | None = None,
    repo: str | None = None,
) -> GeoFMWeights:
    """A torchgeo ``WeightsEnum`` member for an export.

    Args:
        export: the export folder, its ``backbone.safetensors`` or a run directory holding them.
        source: the data source whose normalisation statistics the transforms apply; default: the
            first one that covers all the model's bands.
        name: the member's name (default from method and band count, e.g. ``GFM_4BAND``).
        dataset, publication, repo: meta entries; defaults from the sidecar (data source names, the
            method's paper, or those of the released model it was converted from).

    Returns:
        The member of a one-member ``WeightsEnum`` subclass; ``meta`` follows torchgeo (``dataset``,
        ``in_chans``, ``model``, ``publication``, ``repo``, ``ssl_method``, ``bands``) plus
        ``img_size``, ``window_size``, ``gsd``, ``timm_kwargs`` and ``normalisation_source``.

    Raises:
        CheckpointNotFoundError: no export there.
        CheckpointFormatError: the file is not a geofm export.
        ConfigError: ``source`` unknown or not covering the bands.
    """
    weights_path = resolve_checkpoint_path(export)
    if weights_path.name != EXPORT_WEIGHTS and weights_path.suffix != ".safetensors":
        raise CheckpointFormatError(
            f"{weights_path}: not an export; convert it first (geofm checkpoint convert SRC DST)"
        )
    sidecar = read_export_sidecar(weights_path)
    kwargs = sidecar["timm_kwargs"]
    bands = sidecar.get("bands")
    chosen, transforms = _transforms(sidecar.get("normalisation"), bands, source)
    method = sidecar.get("method")
    release = sidecar.get("release") or {}
    meta = {
        "dataset": dataset or _dataset(sidecar.get("data")),
        "in_chans": kwargs.get("in_chans"),
        "model": sidecar["arch"],
        "publication": publication or release.get("publication") or PUBLICATIONS.get(method),
        "repo": repo or release.get("repo"),
        "ssl_method": method,
        "bands": tuple(bands) if bands else None,
        "img_size": sidecar.get("img_size", kwargs.get("img_size")),
        "window_size": kwargs.get("window_size"),
        "gsd": sidecar.get("gsd"),
        "timm_kwargs": kwargs,
        "normalisation_source": chosen,
    }
    member = name or f"{method or 'geofm'}_{kwargs.get('in_chans')}band"
    member = re.sub(r"\W+", "_", member).strip("_").upper()
    enum_name = "GeoFM_" + re.sub(r"\W+", "_", sidecar["arch"]) + "_Weights"
    enum = GeoFMWeights(
        enum_name, [(member, Weights(url=weights_path.resolve().as_uri(), transforms=transforms, meta=meta))]
    )
    return enum[member]


def _transforms(normalisation: Any, bands: list[str] | None, source: str | None) -> tuple[str | None, nn.Module]:
    """Normalise raw values as the chosen source was in training, in the model's band order."""
    if not bands:
        if source is not None:
            raise ConfigError(
                f"the export records no normalisation per source (and bands), so source {source!r} is unknown"
            )
        return None, nn.Sequential()
    stats = export_band_statistics({"normalisation": normalisation}, bands, source)
    if stats is None:
        return None, nn.Sequential()
    mean = [m / stats.scale for m in stats.mean]
    std = [s / stats.scale for s in stats.std]
    return stats.source, nn.Sequential(T.Normalize(mean=mean, std=std))


def _dataset(data: Any) -> str | None:
    if isinstance(data, list):
        return ", ".join(str(d.get("name")) if isinstance(d, Mapping) else str(d) for d in data) or None
    if isinstance(data, Mapping):
        return ", ".join(str(v) for v in data.values()) or None
    return str(data) if data else None
