"""A finetuned run as a function of normalised tiles, for whole-scene inference (``geofm predict``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from finetune.best import load_finetuned
from finetune.predict import Predictor
from geofm.config.finetune import FinetuneConfig
from geofm.data.finetune import BandNormaliser
from geofm.errors import ConfigError
from geofm.tasks.finetuning import task_of
from geofm.tasks.finetuning.model import FinetuneModel
from geofm.training import engine as ds

_SIZES_SHOWN = 4


def load_predictor(run_dir: str | Path, tile: int | None = None) -> Predictor:
    """Load a finetuned run's kept weights as a :class:`~finetune.predict.Predictor`.

    Args:
        run_dir: a ``geofm finetune`` run directory (its ``config.yaml`` and ``best/``).
        tile: side of the tiles the model is to take (default: its training size,
            ``model.img_size``). Any multiple of the model's coarsest feature stride works (32 for
            Swin and for dense heads, the patch size for a ViT's super-resolution): a Swin keeps its
            trained windows and rebuilds its attention masks, a ViT resamples its position embedding.

    Returns:
        The predictor. Its ``model_fn`` maps float32 CPU tiles normalised as in training,
        (B, C, H, W) (change: the earlier and the later tiles, two arguments) to float32 CPU
        outputs: class logits (B, K, H, W) (segmentation, change; (B, K) for classification and
        multilabel), or the normalised high-resolution image (B, C', H*s, W*s) (superres), without
        gradients on this process's device. Its ``normaliser`` is the run's band spec (superres:
        ``target_normaliser`` that of the high-resolution side, ``data.hr``), and its
        ``info``: ``task``, ``bands`` (the model's, in order), ``dataset_bands``, ``scale``,
        ``mean``, ``std`` (per dataset band, after scale), ``nodata``, ``num_classes``,
        ``class_names``, ``ignore_index``, ``scale_factor`` (superres), ``img_size`` (the training
        tile side), ``data`` (the run's data section) and ``selected`` (when and by which metric
        the weights were kept).

    Raises:
        CheckpointNotFoundError: if ``run_dir`` is no finetuning run, or has kept no weights yet.
        ConfigError: if the model cannot take ``tile`` x ``tile`` inputs, saying which sides it takes.
    """
    model, cfg, record = load_model(run_dir, tile)
    dev = ds.device()
    model.to(dev)

    @torch.no_grad()
    def model_fn(*tiles: Tensor) -> Tensor:
        return model(*(t.to(dev, torch.float32) for t in tiles)).float().cpu()

    info = predictor_info(cfg, record)
    data, task = cfg.data, task_of(cfg)
    return Predictor(
        model_fn,
        cfg.task,
        BandNormaliser.from_config(data),
        tile or cfg.model.img_size,
        scale_factor=info["scale_factor"],
        target_normaliser=task.target_normaliser(),
        info=info,
    )


def load_model(run_dir: str | Path, tile: int | None = None) -> tuple[FinetuneModel, FinetuneConfig, dict]:
    """A finetuned run's model with its kept weights (eval mode, on the CPU), taking ``tile`` x ``tile``
    inputs (default: its training size), its config and the kept weights' record.

    Raises:
        CheckpointNotFoundError: if ``run_dir`` is no finetuning run, or has kept no weights yet.
        ConfigError: if the model cannot take ``tile`` x ``tile`` inputs, saying which sides it takes.
    """
    run_dir = Path(run_dir)
    model, cfg, record = load_finetuned(run_dir)
    trained = cfg.model.img_size
    if tile is not None and tile != trained:
        step = model.size_multiple()
        if tile <= 0 or tile % step:
            sizes = ", ".join(str(step * k) for k in range(1, _SIZES_SHOWN + 1))
            raise ConfigError(
                f"--tile {tile}: the {cfg.task} model of {run_dir}, trained on {trained} px tiles, takes tiles "
                f"whose side is a multiple of {step} px ({sizes}, ...)"
            )
        model.set_input_size(tile)
    return model, cfg, record


def predictor_info(cfg: FinetuneConfig, record: dict) -> dict[str, Any]:
    """What a finetuned run's model was trained with (:func:`load_predictor`'s ``info``)."""
    data = cfg.data
    return {
        "task": cfg.task,
        "bands": list(data.bands),
        "dataset_bands": list(data.dataset_bands),
        "scale": data.scale,
        "mean": list(data.mean),
        "std": list(data.std),
        "nodata": data.nodata,
        "num_classes": data.num_classes,
        "class_names": data.class_names,
        "ignore_index": data.ignore_index,
        "scale_factor": task_of(cfg).scale_factor(),
        "img_size": cfg.model.img_size,
        "data": data,
        "selected": record,
    }
