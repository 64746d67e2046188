"""The interface between where downstream scenes come from (folders, torchgeo) and the dataset."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor

from geofm.data.grid import Window
from geofm.tasks import finetune_task

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split
    from geofm.data.finetune.torchgeo import TorchgeoSource


class SceneSource(ABC):
    """The full-size, normalised, checked scenes of one split, in the sample format of its task.

    Subclasses read folders or wrap a torchgeo dataset; :class:`~geofm.data.finetune.dataset.FinetuneDataset`
    crops, augments and tiles what they load.
    """

    task: str
    _kept: tuple[int, dict[str, Tensor]] | None = None

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

    def window(self, index: int, window: Window) -> dict[str, Tensor]:
        """The part of a scene inside ``window`` (of its low-resolution image; a super-resolution
        ``target`` at ``scale_factor`` times the offsets and sides), in the sample format of the task.

        This default cuts it from the whole scene, kept while consecutive windows of it are read;
        sources of files read the window alone.

        Raises:
            RasterReadError: if a file cannot be read.
            DataMismatchError: if the scene's files do not fit together or with the config.
        """
        return cut_window(self.kept(index), window)

    def kept(self, index: int) -> dict[str, Tensor]:
        """The whole scene, loaded once for consecutive calls with the same index."""
        if self._kept is None or self._kept[0] != index:
            self._kept = (index, self.load(index))
        return self._kept[1]

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


def cut_window(scene: dict[str, Tensor], window: Window) -> dict[str, Tensor]:
    """The part of every image and mask of a scene inside ``window``; ``target``, at ``f`` times the
    image's size, at ``f`` times the offsets and sides."""
    factor = scene["target"].shape[-1] // scene["image"].shape[-1] if "target" in scene else 1
    part = {}
    for key, value in scene.items():
        f = factor if key == "target" else 1
        rows = slice(window.row * f, (window.row + window.height) * f)
        part[key] = value[..., rows, window.col * f : (window.col + window.width) * f]
    return part


TorchgeoScene = Callable[["TorchgeoSource", dict[str, Tensor], str], dict[str, Tensor]]
"""A torchgeo sample as a task's scene: ``(source, sample, where) -> scene``; ``source.image`` normalises images."""


@dataclass(frozen=True)
class TaskData:
    """What a finetuning task reads, declared by its task module and passed to the data library.

    Attributes:
        name: the task's name, for messages.
        folders: the reader of a split of the user's folders, ``(data config, split) -> SceneSource``.
        target: the key of the target in the task's samples (checked in torchgeo samples).
        torchgeo: a torchgeo sample as the task's scene (:data:`TorchgeoScene`); None for
            ``resolution_pairs``, whose scenes pair two instances of the class.
        dense: per-pixel targets: training crops keep image and mask aligned, evaluation cuts each
            scene into a grid of ``img_size`` tiles. Otherwise one view of the whole scene.
        resolution_pairs: a low-resolution input and a ``data.scale_factor`` times larger target
            (super-resolution); the torchgeo class is instantiated twice (``lr_kwargs``, ``hr_kwargs``).
        stratified: train fractions are stratified by the labels the source knows without reading images.
        class_targets: a torchgeo class's ``targets`` list holds the scenes' class ids.
        labelled_masks: a split whose masks hold no labelled pixel is refused.
    """

    name: str
    folders: Callable[[FinetuneDataConfig, Split], SceneSource]
    target: str
    torchgeo: TorchgeoScene | None = None
    dense: bool = False
    resolution_pairs: bool = False
    stratified: bool = False
    class_targets: bool = False
    labelled_masks: bool = False


def task_data(task: str | TaskData) -> TaskData:
    """The data declaration of a registered task (by name), or ``task`` itself.

    Raises:
        ConfigError: for a name that is not a registered task, listing the nearest names.
    """
    if isinstance(task, TaskData):
        return task
    return finetune_task(task).data()
