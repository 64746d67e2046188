"""Downstream datasets of finetuning: torchgeo classes by name or the user's folders, in one sample format.

:func:`build_finetune_dataset` turns the ``data`` section of a finetuning config into one split's
:class:`FinetuneDataset`. Its samples follow :mod:`geofm.config.finetune`: images in the model's
bands, ``(raw * scale - mean) / std`` with nodata set to 0; ``label`` int64 (classification) or
float32 multi-hot (multilabel); ``mask`` int64 (segmentation; change in {0, 1}); ``target`` at
``scale_factor`` times the size of ``image`` (superres). Folder layouts: :mod:`.folders`; torchgeo
classes: :mod:`.torchgeo`; augmentation and evaluation views: :mod:`.augment`; train fractions:
:mod:`.subset`; chips and spatial splits of large scenes: :mod:`.regions`; the training order and
each sample's augmentation seed: :mod:`.sampler`. Files that do not fit together raise
:class:`~geofm.errors.DataMismatchError` naming them.
"""

from geofm.data.finetune.dataset import FinetuneDataset, build_finetune_dataset
from geofm.data.finetune.folders import FOLDER_LAYOUTS
from geofm.data.finetune.normalise import BandNormaliser
from geofm.data.finetune.source import SceneSource, TaskData, task_data
from geofm.data.finetune.subset import subset_indices
from geofm.data.finetune.torchgeo import KNOWN_BANDS, TorchgeoSource

__all__ = [
    "FOLDER_LAYOUTS",
    "KNOWN_BANDS",
    "BandNormaliser",
    "FinetuneDataset",
    "SceneSource",
    "TaskData",
    "TorchgeoSource",
    "build_finetune_dataset",
    "subset_indices",
    "task_data",
]
