"""One split of a downstream dataset, in the sample format of its task, and the entry point that builds it."""

from __future__ import annotations

import logging

from torch import Tensor
from torch.utils.data import Dataset

from geofm.config.finetune import FinetuneDataConfig, Split
from geofm.data.finetune.augment import (
    ClassificationView,
    DenseAugmentation,
    SuperresAugmentation,
    crop_tile,
)
from geofm.data.finetune.source import SceneSource, TaskData, task_data
from geofm.data.finetune.subset import subset_indices
from geofm.data.finetune.torchgeo import TorchgeoSource
from geofm.data.grid import grid_origins
from geofm.errors import ConfigError, DataMismatchError

logger = logging.getLogger("geofm.data")


class FinetuneDataset(Dataset[dict[str, Tensor]]):
    """Samples of one split, ready for a DataLoader's default collation.

    Training (``train=True``): one random crop per scene and epoch (see
    :mod:`geofm.data.finetune.augment`). Evaluation: classification scenes resized whole to
    ``img_size``; segmentation, change and super-resolution scenes cut into a grid of ``img_size``
    tiles that covers every pixel (the last row and column of tiles are flush with the far edges,
    overlapping their neighbours), one sample per tile, in scene order. Each sample is a dict in the
    task's format (:mod:`geofm.config.finetune`), nothing else.
    """

    def __init__(
        self,
        source: SceneSource,
        data: TaskData,
        cfg: FinetuneDataConfig,
        img_size: int,
        train: bool,
        scenes: list[int] | None = None,
    ) -> None:
        """Initialise a new FinetuneDataset instance.

        Args:
            source: the scenes of the split.
            data: what the task reads (dense targets, resolution pairs).
            cfg: the downstream data section (augmentation switches, ignore_index, scale_factor).
            img_size: side of the samples (super-resolution: of the low-resolution input).
            train: random training crops, or the deterministic evaluation views.
            scenes: the scenes used (a train fraction), default all.

        Raises:
            RasterReadError: evaluating dense tasks, if a scene's size cannot be read.
        """
        self.source = source
        self.data = data
        self.img_size = img_size
        self.train = train
        self.scenes = list(range(len(source))) if scenes is None else list(scenes)
        self.factor = int(cfg.scale_factor or 1) if data.resolution_pairs else 1
        self.mask_fill = mask_fill = cfg.unscored_label
        dense = data.dense
        self.tiles: list[tuple[int, int, int]] = []
        if dense and not train:
            if isinstance(source, TorchgeoSource):
                logger.info("reading %d scenes of torchgeo %s once for their sizes", len(self.scenes), source.name)
            for scene in self.scenes:
                height, width = source.shape(scene)
                self.tiles += [
                    (scene, y, x) for y in grid_origins(height, img_size) for x in grid_origins(width, img_size)
                ]
        else:
            self.tiles = [(scene, 0, 0) for scene in self.scenes]
        if not dense:
            self.view = ClassificationView(img_size, train, cfg.crop_scale, cfg.hflip, cfg.vflip)
        elif data.resolution_pairs:
            self.view = SuperresAugmentation(img_size, self.factor, cfg.hflip, cfg.vflip)
        else:
            self.view = DenseAugmentation(img_size, cfg.hflip, cfg.vflip, mask_fill)
        self._cached: tuple[int, dict[str, Tensor]] | None = None

    def __len__(self) -> int:
        """Number of samples: scenes, or tiles when evaluating a dense task."""
        return len(self.tiles)

    def _scene(self, scene: int) -> dict[str, Tensor]:
        """A scene, kept while consecutive tiles of it are read."""
        if self._cached is None or self._cached[0] != scene:
            self._cached = (scene, self.source.load(scene))
        return self._cached[1]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        """One sample in the task's format."""
        scene, top, left = self.tiles[index]
        if self.train or not self.data.dense:
            return self.view(self.source.load(scene))
        return crop_tile(self._scene(scene), top, left, self.img_size, self.factor, self.mask_fill)


def build_finetune_dataset(
    data_cfg: FinetuneDataConfig, task: str | TaskData, split: Split, img_size: int, train: bool
) -> FinetuneDataset:
    """One split of a downstream dataset, from a torchgeo class or the user's folders.

    The train split is reduced to ``data_cfg.train_fraction`` (seeded by ``data_cfg.subset_seed``,
    stratified where labels are known without reading images; see
    :func:`~geofm.data.finetune.subset.subset_indices`).

    Args:
        data_cfg: the downstream data section.
        task: a registered finetuning task's name, or its data declaration.
        split: train, val or test.
        img_size: side of the samples (super-resolution: of the low-resolution input).
        train: random training augmentation (True) or the deterministic evaluation views.

    Returns:
        The dataset.

    Raises:
        ConfigError: for an unknown task, resolution pairs without ``scale_factor``, or
            torchgeo arguments the class refuses.
        DatasetNotFoundError: if the data is missing, naming the folder and how to get it.
        DataMismatchError: if files lack their partners or classes/bands do not fit the config.
    """
    data = task_data(task)
    if data.resolution_pairs and data_cfg.scale_factor is None:
        raise ConfigError(f"task {data.name} needs data.scale_factor")
    if data_cfg.torchgeo is not None:
        source: SceneSource = TorchgeoSource(data_cfg, data, split)
    else:
        source = data.folders(data_cfg, split)
    scenes = None
    if split == "train" and data_cfg.train_fraction < 1:
        labels = source.labels() if data.stratified else None
        if labels is None:
            logger.info(
                "train_fraction %s of %s: no labels known without reading images, drawn uniformly",
                data_cfg.train_fraction,
                data.name,
            )
        scenes = subset_indices(len(source), data_cfg.train_fraction, data_cfg.subset_seed, labels)
    dataset = FinetuneDataset(source, data, data_cfg, img_size, train, scenes)
    if data.labelled_masks:
        check_labelled(dataset, data_cfg, split)
    return dataset


def check_labelled(dataset: FinetuneDataset, data_cfg: FinetuneDataConfig, split: Split) -> None:
    """Refuse a split of a dense task without a single labelled pixel: nothing to learn or score.

    Reads scenes only until the first labelled pixel (the first scene, as a rule).

    Raises:
        DataMismatchError: naming the dataset, split and root.
    """
    unscored = data_cfg.unscored_label
    if not dataset.scenes:
        return  # an empty split is refused with its own message where it is used
    for scene in dataset.scenes:
        if bool((dataset.source.load(scene)["mask"] != unscored).any()):
            return
    what = f"torchgeo {data_cfg.torchgeo}" if data_cfg.torchgeo else "the folders"
    raise DataMismatchError(
        f"{what} at {data_cfg.root}, split {split} ({data_cfg.splits[split]!r}): none of its {len(dataset.scenes)} "
        f"scenes has a labelled pixel (every mask value is data.ignore_index={data_cfg.ignore_index}); there is "
        "nothing to train on or score"
    )
