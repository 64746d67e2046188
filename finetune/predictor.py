"""A finetuned run as a function of normalised tiles, for whole-scene inference (``geofm predict``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from finetune.best import load_finetuned
from finetune.predict import Predictor
from geofm import engine as ds
from geofm.data.finetune import BandNormaliser


def load_predictor(run_dir: str | Path) -> Predictor:
    """Load a finetuned run's kept weights as a :class:`~finetune.predict.Predictor`.

    Args:
        run_dir: a ``geofm finetune`` run directory (its ``config.yaml`` and ``best/``).

    Returns:
        The predictor. Its ``model_fn`` maps float32 CPU tiles normalised as in training,
        (B, C, H, W) (change: the earlier and the later tiles, two arguments) to float32 CPU
        outputs: class logits (B, K, H, W) (segmentation, change; (B, K) for classification and
        multilabel), or the normalised high-resolution image (B, C, H*s, W*s) (superres), without
        gradients on this process's device. Its ``normaliser`` is the run's band spec, and its
        ``info``: ``task``, ``bands`` (the model's, in order), ``dataset_bands``, ``scale``,
        ``mean``, ``std`` (per dataset band, after scale), ``nodata``, ``num_classes``,
        ``class_names``, ``ignore_index``, ``scale_factor`` (superres), ``img_size`` (the training
        tile side), ``data`` (the run's data section) and ``selected`` (when and by which metric
        the weights were kept).

    Raises:
        CheckpointNotFoundError: if ``run_dir`` is no finetuning run, or has kept no weights yet.
    """
    run_dir = Path(run_dir)
    model, cfg, record = load_finetuned(run_dir)
    dev = ds.device()
    model.to(dev)

    @torch.no_grad()
    def model_fn(*tiles: Tensor) -> Tensor:
        return model(*(t.to(dev, torch.float32) for t in tiles)).float().cpu()

    data = cfg.data
    info = {
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
        "scale_factor": data.scale_factor if cfg.task == "superres" else 1,
        "img_size": cfg.model.img_size,
        "data": data,
        "selected": record,
    }
    return Predictor(model_fn, cfg.task, BandNormaliser.from_config(data), info["scale_factor"], info)
