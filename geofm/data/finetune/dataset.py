"""One split of a downstream dataset, in the sample format of its task, and the entry point that builds it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils.data import Dataset

from geofm.data.finetune.augment import ClassificationView, fit_tile, flip_randomly, random_crop
from geofm.data.finetune.regions import Region, data_regions
from geofm.data.finetune.sampler import SampleIndex
from geofm.data.finetune.source import SceneSource, TaskData, cut_window, task_data
from geofm.data.finetune.subset import subset_indices
from geofm.data.finetune.torchgeo import TorchgeoSource
from geofm.data.grid import Window, grid_origins
from geofm.errors import ConfigError, DataMismatchError

if TYPE_CHECKING:
    from geofm.config.finetune_data import FinetuneDataConfig, Split

logger = logging.getLogger("geofm.data")


class FinetuneDataset(Dataset[dict[str, Tensor]]):
    """Samples of one split, ready for a DataLoader's default collation.

    The split's scenes, or with ``data.split`` and ``data.chip_size`` windows of them
    (:attr:`regions`, see :mod:`geofm.data.finetune.regions`), give the samples. Training
    (``train=True``): one random view per region, drawn anew at each reading (see
    :mod:`geofm.data.finetune.augment`); dense tasks read the crop's window alone. Evaluation:
    classification scenes resized whole to ``img_size``; segmentation, change and super-resolution
    regions cut into a grid of ``img_size`` tiles that covers every pixel (the last row and column
    of tiles are flush with the far edges, overlapping their neighbours), one sample per tile, in
    order. Each sample is a dict in the task's format (:mod:`geofm.config.finetune`), nothing else.

    An index is a position, whose random view draws from torch's global generator, or a
    :class:`~geofm.data.finetune.sampler.SampleIndex`, whose view draws from its own seed alone.
    """

    def __init__(
        self,
        source: SceneSource,
        data: TaskData,
        cfg: FinetuneDataConfig,
        img_size: int,
        train: bool,
        regions: list[Region] | None = None,
    ) -> None:
        """Initialise a new FinetuneDataset instance.

        Args:
            source: the scenes of the split.
            data: what the task reads (dense targets, resolution pairs).
            cfg: the downstream data section (augmentation switches, ignore_index, scale_factor).
            img_size: side of the samples (super-resolution: of the low-resolution input).
            train: random training crops, or the deterministic evaluation views.
            regions: the parts of scenes used (a spatial split, chips, a train fraction), default
                every scene whole.

        Raises:
            RasterReadError: evaluating dense tasks, if a scene's size cannot be read.
        """
        self.source = source
        self.data = data
        self.img_size = img_size
        self.train = train
        self.regions = [Region(scene) for scene in range(len(source))] if regions is None else list(regions)
        self.mask_fill = cfg.unscored_label
        self.hflip, self.vflip = cfg.hflip, cfg.vflip
        self.tiles: list[tuple[int, int, int]] = [(r, 0, 0) for r in range(len(self.regions))]
        self.extents: list[tuple[int, int]] = []  # of each region, to tile it for a dense task's evaluation
        if data.dense and not train:
            whole = [r for r in self.regions if r.window is None]
            if whole and isinstance(source, TorchgeoSource):
                logger.info("reading %d scenes of torchgeo %s once for their sizes", len(whole), source.name)
            self.extents = [self.extent(region) for region in self.regions]
            self.tiles = [
                (r, y, x)
                for r, (height, width) in enumerate(self.extents)
                for y in grid_origins(height, img_size)
                for x in grid_origins(width, img_size)
            ]
        if not data.dense:
            self.view = ClassificationView(img_size, train, cfg.crop_scale, cfg.hflip, cfg.vflip)
        self._cached: tuple[int, dict[str, Tensor]] | None = None

    @property
    def tiled(self) -> bool:
        """Whether the samples are evaluation tiles of dense regions (:attr:`tiles` and :attr:`extents`)."""
        return bool(self.extents)

    @property
    def scenes(self) -> list[int]:
        """The scenes the samples are drawn from, in order."""
        return sorted({region.scene for region in self.regions})

    def __len__(self) -> int:
        """Number of samples: regions, or tiles when evaluating a dense task."""
        return len(self.tiles)

    def extent(self, region: Region) -> tuple[int, int]:
        """Height and width of a region (of a scene's low-resolution image)."""
        return (region.window.height, region.window.width) if region.window else self.source.shape(region.scene)

    def read_region(self, index: int) -> dict[str, Tensor]:
        """The whole of region ``index``."""
        scene, window = self.regions[index]
        return self.source.load(scene) if window is None else self.source.window(scene, window)

    def _region(self, index: int) -> dict[str, Tensor]:
        """The whole of region ``index``, kept while consecutive tiles of it are read."""
        if self._cached is None or self._cached[0] != index:
            self._cached = (index, self.read_region(index))
        return self._cached[1]

    def sample_window(self, index: int) -> tuple[int, Window | None]:
        """The scene of a sample and the window of it the sample comes from (None: the whole scene)."""
        r, top, left = self.tiles[index]
        scene, window = self.regions[r]
        if not self.data.dense or self.train:
            return scene, window
        height, width = self.extents[r]
        row, col = (window.row, window.col) if window else (0, 0)
        size = self.img_size
        return scene, Window(row + top, col + left, min(size, height), min(size, width))

    def __getitem__(self, index: int | SampleIndex) -> dict[str, Tensor]:
        """One sample in the task's format."""
        if not isinstance(index, SampleIndex):
            return self._sample(index)
        with torch.random.fork_rng(devices=[]):
            # The CPU generator alone: torch.manual_seed would also seed every GPU, for nothing.
            torch.default_generator.manual_seed(index.seed)
            return self._sample(index.index)

    def _sample(self, index: int) -> dict[str, Tensor]:
        r, top, left = self.tiles[index]
        scene, window = self.regions[r]
        if not self.data.dense:
            return self.view(self.source.load(scene))
        size = self.img_size
        if not self.train:
            return fit_tile(cut_window(self._region(r), Window(top, left, size, size)), 0, 0, size, self.mask_fill)
        area = window or Window(0, 0, *self.source.shape(scene))
        inside, top, left = random_crop(area, size)
        crop = fit_tile(self.source.window(scene, inside), top, left, size, self.mask_fill)
        return flip_randomly(crop, self.hflip, self.vflip)


def build_finetune_dataset(
    data_cfg: FinetuneDataConfig, task: str | TaskData, split: Split, img_size: int, train: bool
) -> FinetuneDataset:
    """One split of a downstream dataset, from a torchgeo class or the user's folders.

    The train split is reduced to ``data_cfg.train_fraction`` of its regions (scenes, or with
    ``data.split`` and ``data.chip_size`` windows of them; seeded by ``data_cfg.subset_seed``,
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
        DatasetTooSmallError: if ``data.split`` gives ``split`` no region.
    """
    data = task_data(task)
    if data.resolution_pairs and data_cfg.scale_factor is None:
        raise ConfigError(f"task {data.name} needs data.scale_factor")
    if data_cfg.torchgeo is not None:
        source: SceneSource = TorchgeoSource(data_cfg, data, split)
    else:
        source = data.folders(data_cfg, split)
    regions = data_regions(data_cfg, split, source)
    if split == "train" and data_cfg.train_fraction < 1:
        whole = data_cfg.split is None and data_cfg.chip_size is None
        labels = source.labels() if data.stratified and whole else None
        if labels is None:
            logger.info(
                "train_fraction %s of %s: no labels known without reading images, drawn uniformly",
                data_cfg.train_fraction,
                data.name,
            )
        chosen = subset_indices(len(regions), data_cfg.train_fraction, data_cfg.subset_seed, labels)
        regions = [regions[i] for i in chosen]
    dataset = FinetuneDataset(source, data, data_cfg, img_size, train, regions)
    if data.labelled_masks:
        check_labelled(dataset, data_cfg, split)
    return dataset


def check_labelled(dataset: FinetuneDataset, data_cfg: FinetuneDataConfig, split: Split) -> None:
    """Refuse a split of a dense task without a single labelled pixel: nothing to learn or score.

    Reads the split's regions (scenes, or windows of them) only until the first labelled pixel (the
    first region, as a rule).

    Raises:
        DataMismatchError: naming the dataset, split and root.
    """
    unscored = data_cfg.unscored_label
    if not dataset.regions:
        return  # an empty split is refused with its own message where it is used
    for index in range(len(dataset.regions)):
        if bool((dataset.read_region(index)["mask"] != unscored).any()):
            return
    what = f"torchgeo {data_cfg.torchgeo}" if data_cfg.torchgeo else "the folders"
    part = f"data.split by {data_cfg.split.by}" if data_cfg.split else repr(data_cfg.splits[split])
    count = f"{len(dataset.regions)} scenes" if dataset.regions[0].window is None else f"{len(dataset.regions)} windows"
    raise DataMismatchError(
        f"{what} at {data_cfg.root}, split {split} ({part}): none of its {count} has a labelled pixel (every mask "
        f"value is data.ignore_index={data_cfg.ignore_index}); there is nothing to train on or score"
    )
