"""The interface between where downstream scenes come from (folders, torchgeo) and the dataset."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
from torch import Tensor


class SceneSource(ABC):
    """The full-size, normalised, checked scenes of one split, in the sample format of its task.

    Subclasses read folders or wrap a torchgeo dataset; :class:`~geofm.data.finetune.dataset.FinetuneDataset`
    crops, augments and tiles what they load.
    """

    task: str

    @abstractmethod
    def __len__(self) -> int:
        """Number of scenes."""

    @abstractmethod
    def load(self, index: int) -> dict[str, Tensor]:
        """One scene in the sample format of the task, at full size.

        Raises:
            RasterReadError: if a file cannot be read.
            DataMismatchError: if the scene's files do not fit together or with the config.
        """

    @abstractmethod
    def shape(self, index: int) -> tuple[int, int]:
        """Height and width of a scene's (low-resolution) image."""

    @abstractmethod
    def describe(self, index: int) -> str:
        """The files of a scene, for messages."""

    def labels(self) -> list[int] | np.ndarray | None:
        """Labels of every scene without reading images: class ids (classification), a (scenes,
        classes) multi-hot array (multilabel), or None where they are not cheaply known."""
        return None
