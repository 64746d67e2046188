"""Downstream datasets of finetuning, in the sample format of :mod:`geofm.config.finetune`.

:func:`build_finetune_dataset` turns the ``data`` section of a finetuning config into one split's
dataset; programs reach downstream data through it alone.
"""

from geofm.data.finetune.dataset import ClassFolderDataset, build_finetune_dataset

__all__ = ["ClassFolderDataset", "build_finetune_dataset"]
