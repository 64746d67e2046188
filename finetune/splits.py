"""The splits a finetuning run reads, built from its config; a split without samples is refused before training."""

from __future__ import annotations

from geofm.config.finetune import FinetuneConfig
from geofm.config.finetune_data import Split
from geofm.data.finetune import FinetuneDataset, build_finetune_dataset
from geofm.errors import DatasetTooSmallError


def describe_split(cfg: FinetuneConfig, split: Split) -> str:
    """One split of a finetuning config's dataset, with its root, for messages."""
    data = cfg.data
    if data.torchgeo is not None:
        source = f"torchgeo {data.torchgeo}(root={str(data.root.resolve())!r}, split={data.splits[split]!r})"
    elif data.split is not None:
        source = f"data.split by {data.split.by} of the folder {data.root.resolve()}"
    else:
        source = f"folder {(data.root / data.splits[split]).resolve()}"
    return f"the {split} split ({source})"


def build_split(cfg: FinetuneConfig, split: Split, *, train: bool) -> FinetuneDataset:
    """One split of the config's dataset: training views (``train``) or evaluation views.

    Raises:
        DatasetTooSmallError: if the split holds no sample, naming the dataset, split and root.
        DatasetNotFoundError, DataMismatchError, ConfigError: as
            :func:`~geofm.data.finetune.build_finetune_dataset`.
    """
    try:
        dataset = build_finetune_dataset(cfg.data, cfg.task, split, cfg.model.img_size, train=train)
    except DatasetTooSmallError as err:
        raise DatasetTooSmallError(f"{describe_split(cfg, split)}: {err}") from None
    if not len(dataset):
        raise DatasetTooSmallError(f"{describe_split(cfg, split)} holds no sample")
    return dataset
