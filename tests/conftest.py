"""Shared fixtures: tiny backbones and finetuning configs so the suite stays fast on two CPU cores, and
tiny downstream datasets written in the on-disk layouts of torchgeo's dataset classes."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("DS_ACCELERATOR", "cpu")

TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}
TINY_VIT = {"embed_dim": 32, "depth": 4, "num_heads": 2}
SWIN_ARCH = "swin_tiny_patch4_window7_224"
VIT_ARCH = "vit_small_patch16_224"
# An export's bands and its pretraining statistics per source, for the tests of exports read by other frameworks.
EXPORT_BANDS = ["red", "green", "blue", "nir"]
EXPORT_NORMALISATION = {
    "aerial": {
        "bands": ["red", "green", "blue"],
        "scale": 1 / 255,
        "mean": [0.48, 0.49, 0.32],
        "std": [0.12, 0.07, 0.08],
    },
    "s2": {
        "bands": ["blue", "green", "red", "nir"],
        "scale": 1e-4,
        "mean": [0.05, 0.08, 0.07, 0.26],
        "std": [0.03, 0.03, 0.04, 0.1],
    },
}


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: tiny models gain nothing from two, which wait on each other on loaded cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def sigterm_caught():
    """SIGTERM raises in the test instead of ending the test process, should the code under test not handle it;
    yields the handler, restored afterwards."""
    import signal

    def caught(signum, frame):
        raise RuntimeError("SIGTERM reached the test's own handler")

    previous = signal.signal(signal.SIGTERM, caught)
    yield caught
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def tiny_swin():
    from geofm.models.backbones import backbone_kwargs, create_backbone

    def make(in_chans: int = 3, img_size: int = 64, window_size: int = 4):
        kwargs = backbone_kwargs(in_chans=in_chans, img_size=img_size, window_size=window_size, timm_kwargs=TINY_SWIN)
        return create_backbone(SWIN_ARCH, kwargs)

    return make


@pytest.fixture
def tiny_vit():
    from geofm.models.backbones import backbone_kwargs, create_backbone

    def make(in_chans: int = 3, img_size: int = 64):
        return create_backbone(VIT_ARCH, backbone_kwargs(in_chans=in_chans, img_size=img_size, timm_kwargs=TINY_VIT))

    return make


TINY_HEAD_OPTIONS = {"segmentation": {"channels": 16}, "change": {"channels": 16}, "superres": {"channels": 4}}
"""``head.options`` of each task's own head in the tiny test configs (classification's linear head takes none)."""


def head_overrides(task: str) -> list[str]:
    """:data:`TINY_HEAD_OPTIONS` of ``task`` as command-line overrides of a shipped config."""
    return [f"head.options.{key}={value}" for key, value in TINY_HEAD_OPTIONS.get(task, {}).items()]


def _finetune_tree(task: str, output_dir: Path, family: str = "swin", **sections) -> dict:
    """A finetuning config tree of a tiny 32 px Swin (or ViT) on 4 bands, 2 epochs of batch 4."""
    vit = family == "vit"
    data = {
        "root": "unused",
        "bands": ["red", "green", "blue", "nir"],
        "dataset_bands": ["blue", "green", "red", "nir"],
        "scale": 0.0001,
        "mean": [0.25] * 4,
        "std": [0.1] * 4,
        "num_workers": 0,
    }
    data.update(
        {
            "classification": {"num_classes": 3},
            "multilabel": {"num_classes": 3},
            "segmentation": {"num_classes": 3, "ignore_index": 255},
            "change": {"num_classes": 2},
            "superres": {"scale_factor": 2},
        }[task]
    )
    model = (
        {"arch": VIT_ARCH, "img_size": 32, "timm_kwargs": TINY_VIT}
        if vit
        else {"arch": SWIN_ARCH, "img_size": 32, "window_size": 4, "timm_kwargs": TINY_SWIN}
    )
    tree = {
        "task": task,
        "run": {"output_dir": str(output_dir), "log_every": 1, "checkpoint_every": 100, "progress": False},
        "model": model,
        "head": {"options": dict(TINY_HEAD_OPTIONS.get(task, {}))},
        "data": data,
        "train": {"epochs": 2, "micro_batch_size": 4, "warmup_epochs": 0.5, "base_lr": 1e-3, "lr_reference_batch": 4},
    }
    for key, values in sections.items():
        tree[key] = (
            values
            if values is None or not isinstance(values, dict)
            else {**copy.deepcopy(tree.get(key) or {}), **values}
        )
    return tree


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name`` that ``make(folder)`` fills once per test session, shared by pytest-xdist's
    workers (a module- or session-scoped fixture is otherwise made again by each worker that runs one
    of its tests): the first to ask makes it while the others wait on its lock."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder = root / "made_once" / name
    folder.parent.mkdir(exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / ".made").exists():
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(folder)  # a worker that failed to make it left part of it
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(scope="session")
def finetune_tree():
    """:func:`_finetune_tree`: ``make(task, output_dir, family="swin", **sections)``."""
    return _finetune_tree


@pytest.fixture
def task_tree(tmp_path):
    """A finetuning config tree of a tiny 32 px Swin (or ViT, ``family="vit"``) on 4 bands, 2 epochs.

    ``make(task, name="run", family="swin", **sections)``: keyword sections update the tree's
    sections (``checkpoint=...`` sets the top-level key); the run writes to ``tmp_path/name``.
    """

    def make(task: str, name: str = "run", family: str = "swin", **sections) -> dict:
        return _finetune_tree(task, tmp_path / name, family, **sections)

    return make


@pytest.fixture
def task_config(task_tree):
    """The validated :class:`FinetuneConfig` of :func:`task_tree`'s tree."""
    from geofm.config.finetune import FinetuneConfig

    def make(task: str, name: str = "run", family: str = "swin", **sections):
        return FinetuneConfig.from_tree(task_tree(task, name, family, **sections))

    return make


RGB = ["red", "green", "blue"]
S2_FILES = ["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B11", "B12"]
"""BigEarthNet's Sentinel-2 band files, in the order torchgeo stacks them."""
BIGEARTHNET_LABELS = [["Pastures", "Coniferous forest"], ["Sea and ocean"], ["Discontinuous urban fabric", "Pastures"]]
"""Label sets of BigEarthNet patches 0, 1, 2 (then again): 43-class ids [17, 23], [42], [1, 17]."""
LEVIRCD_CHANGE = (slice(4, 12), slice(20, 30))
"""Where every LEVIR-CD pair changes (255 in its label): 80 pixels."""
OSCD_FILES = ["B01", "B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B09", "B10", "B11", "B12"]
VAIHINGEN_COLOURS = np.array(
    [(255, 0, 0), (255, 255, 255), (0, 0, 255), (0, 255, 255), (0, 255, 0), (255, 255, 0)], np.uint8
)
"""ISPRS Vaihingen label colours, indexed by class id."""


def _image(path: Path, array: np.ndarray) -> None:
    """Save a (H, W) or (H, W, 3) array with PIL, in the format of the path's ending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


class TorchgeoLayouts:
    """Writers of tiny datasets in torchgeo classes' on-disk layouts (as their releases unpack).

    Each method, named after its class (``ucmerced(root, ...)``, ``bigearthnet``...), fills ``root``
    and returns the ``data`` fields that read it (``torchgeo``, ``kwargs``, ``splits``,
    ``dataset_bands``, ``scale``, classes...), without ``root``, ``bands`` and normalisation statistics.
    """

    @staticmethod
    def ucmerced(root: Path, classes=("agricultural", "beach"), per_split=None, size: int = 24) -> dict:
        """UCMerced_LandUse/Images/<class>/<class>NN.tif and uc_merced-<split>.txt listing each split's files.

        ``per_split`` images per class and split (default train 2, val 1, test 1), random RGB.
        """
        rng = np.random.default_rng(0)
        per_split = per_split or {"train": 2, "val": 1, "test": 1}
        names: dict[str, list[str]] = {split: [] for split in per_split}
        for name in classes:
            splits = [split for split, n in per_split.items() for _ in range(n)]
            for i, split in enumerate(splits):
                file = f"{name}{i:02d}.tif"
                _image(
                    root / "UCMerced_LandUse" / "Images" / name / file,
                    rng.integers(0, 255, (size, size, 3), dtype=np.uint8),
                )
                names[split].append(file)
        for split, files in names.items():
            (root / f"uc_merced-{split}.txt").write_text("\n".join(files) + "\n")
        return {"torchgeo": "UCMerced", "dataset_bands": RGB, "scale": 1 / 255, "num_classes": len(classes)}

    @staticmethod
    def bigearthnet(root: Path, per_split=None, size: int = 20) -> dict:
        """BigEarthNet-v1.0/<patch>/<patch>_<band>.tif (uint16), <patch>_labels_metadata.json, bigearthnet-<split>.csv.

        Patch i of a split (default 2 per split) holds ``100 * (b + 1) + i`` in band file b and
        the labels ``BIGEARTHNET_LABELS[i % 3]``; torchgeo resamples every band to 120 px.
        """
        per_split = per_split or {"train": 2, "val": 2, "test": 2}
        folder = root / "BigEarthNet-v1.0"
        for split, n in per_split.items():
            patches = [f"S2A_MSIL2A_{split}_{i}" for i in range(n)]
            for i, patch in enumerate(patches):
                (folder / patch).mkdir(parents=True)
                for b, band in enumerate(S2_FILES):
                    _image(
                        folder / patch / f"{patch}_{band}.tif",
                        np.full((size, size), 100 * (b + 1) + i, dtype=np.uint16),
                    )
                labels = BIGEARTHNET_LABELS[i % len(BIGEARTHNET_LABELS)]
                (folder / patch / f"{patch}_labels_metadata.json").write_text(json.dumps({"labels": labels}))
            (root / f"bigearthnet-{split}.csv").write_text("".join(f"{patch},S1_{patch}\n" for patch in patches))
        return {
            "torchgeo": "BigEarthNet",
            "kwargs": {"bands": "s2", "num_classes": 43},
            "dataset_bands": S2_FILES,
            "scale": 1e-4,
            "num_classes": 43,
        }

    @staticmethod
    def loveda(root: Path, per_split=None, size: int = 40) -> dict:
        """<Split>/Urban/images_png/<i>.png and masks_png/<i>.png (0 no-data, 1-7 classes); Test has no masks.

        LoveDA withholds its test labels, so the returned ``splits`` evaluate on the val split.
        """
        rng = np.random.default_rng(1)
        for split, n in (per_split or {"train": 2, "val": 1, "test": 1}).items():
            scene = root / split.capitalize() / "Urban"
            for i in range(n):
                _image(scene / "images_png" / f"{i}.png", rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
                if split != "test":
                    _image(scene / "masks_png" / f"{i}.png", rng.integers(0, 8, (size, size), dtype=np.uint8))
        return {
            "torchgeo": "LoveDA",
            "kwargs": {"scene": ["urban"]},
            "splits": {"train": "train", "val": "val", "test": "val"},
            "dataset_bands": RGB,
            "scale": 1 / 255,
            "num_classes": 8,
            "ignore_index": 0,
        }

    @staticmethod
    def vaihingen2d(root: Path, truth: np.ndarray, areas=("area1", "area3"), pixel=(90, 60, 30)) -> dict:
        """top/top_mosaic_09cm_<area>.tif (IR-R-G, every pixel ``pixel``) and top_mosaic_09cm_<area>.tif in label colours.

        ``truth`` holds the class id of each pixel; the areas must be in the class's train list
        (area1, area3, area5...) or test list (area2, area4, area6...).
        """
        for area in areas:
            _image(root / "top" / f"top_mosaic_09cm_{area}.tif", np.full((*truth.shape, 3), pixel, dtype=np.uint8))
            _image(root / f"top_mosaic_09cm_{area}.tif", VAIHINGEN_COLOURS[truth])
        return {"torchgeo": "Vaihingen2D", "dataset_bands": ["nir", "red", "green"], "num_classes": 6}

    @staticmethod
    def levircd(root: Path, per_split=None, size: int = 32) -> dict:
        """A/<split>_<i>.png (before, every value ``10 * i``), B/ (after: before + 50), label/ (255 at LEVIRCD_CHANGE)."""
        for split, n in (per_split or {"train": 1, "val": 1, "test": 1}).items():
            for i in range(1, n + 1):
                _levircd_pair(root, f"{split}_{i}.png", size, i)
        return {"torchgeo": "LEVIRCD", "dataset_bands": RGB, "scale": 1 / 255, "num_classes": 2}

    @staticmethod
    def levircd_plus(root: Path, per_split=None, size: int = 32) -> dict:
        """LEVIR-CD+/<split>/{A,B,label}/<i>.png, pairs as in :meth:`levircd`; splits train and test."""
        for split, n in (per_split or {"train": 1, "test": 0}).items():
            (root / "LEVIR-CD+" / split).mkdir(parents=True, exist_ok=True)
            for i in range(1, n + 1):
                _levircd_pair(root / "LEVIR-CD+" / split, f"{i}.png", size, i)
        return {"torchgeo": "LEVIRCDPlus", "dataset_bands": RGB, "scale": 1 / 255, "num_classes": 2}

    @staticmethod
    def oscd(root: Path, size: int = 24, city: str = "paris", label_rows: int = 3) -> dict:
        """One train city: imgs_<date>_rect/<band>.tif holding ``100 * b + date`` per band file b, and cm/cm.png."""
        images = root / "Onera Satellite Change Detection dataset - Images" / city
        for date in (1, 2):
            for b, band in enumerate(OSCD_FILES):
                _image(
                    images / f"imgs_{date}_rect" / f"{band}.tif", np.full((size, size), 100 * b + date, dtype=np.uint16)
                )
        (images / "dates.txt").write_text("date_1: 20160101\ndate_2: 20180101\n")
        change = np.zeros((size, size), dtype=np.uint8)
        change[:label_rows] = 255
        _image(root / "Onera Satellite Change Detection dataset - Train Labels" / city / "cm" / "cm.png", change)
        return {"torchgeo": "OSCD", "num_classes": 2}

    @staticmethod
    def spacenet2(root: Path, per_split=None) -> dict:
        """SN2_buildings/<split>/AOI_2_Vegas_*/MUL (163 px) and MUL-PanSharpen (650 px) 4-band chips, train geojson.

        ``per_split`` lists the chip ids of each split (default train 3 and 7); a chip's PS-MS
        pixels all hold its id. SpaceNet2 has train and test splits: the returned ``splits``
        validate on test.
        """
        from geofm.data.writers import write_geotiff

        rng = np.random.default_rng(2)
        transform = (1.24, 0.0, 500_000.0, 0.0, -1.24, 4_000_000.0)
        sharp = (0.31, 0.0, 500_000.0, 0.0, -0.31, 4_000_000.0)
        for split, chips in (per_split or {"train": [3, 7]}).items():
            area = (
                root
                / "SN2_buildings"
                / split
                / ("AOI_2_Vegas_Train" if split == "train" else "AOI_2_Vegas_Test_public")
            )
            for chip in chips:
                ms = rng.integers(1, 2000, (4, 163, 163)).astype(np.uint16)
                write_geotiff(area / "MUL" / f"MUL_AOI_2_Vegas_img{chip}.tif", ms, transform=transform, crs=32611)
                ps = np.full((4, 650, 650), chip, dtype=np.uint16)
                write_geotiff(
                    area / "MUL-PanSharpen" / f"MUL-PanSharpen_AOI_2_Vegas_img{chip}.tif",
                    ps,
                    transform=sharp,
                    crs=32611,
                )
                if split == "train":
                    geojson = area / "geojson" / "buildings" / f"buildings_AOI_2_Vegas_img{chip}.geojson"
                    geojson.parent.mkdir(parents=True, exist_ok=True)
                    geojson.write_text(json.dumps({"type": "FeatureCollection", "features": []}))
        return {
            "torchgeo": "SpaceNet2",
            "kwargs": {"aois": [2]},
            "lr_kwargs": {"image": "MUL"},
            "hr_kwargs": {"image": "MUL-PanSharpen"},
            "splits": {"train": "train", "val": "test", "test": "test"},
            "dataset_bands": ["blue", "green", "red", "nir"],
            "scale": 1 / 2047,
            "scale_factor": 4,
            "superres_trim": True,
        }


def _levircd_pair(folder: Path, name: str, size: int, value: int) -> None:
    before = np.full((size, size, 3), 10 * value, dtype=np.uint8)
    change = np.zeros((size, size), dtype=np.uint8)
    change[LEVIRCD_CHANGE] = 255
    _image(folder / "A" / name, before)
    _image(folder / "B" / name, before + 50)
    _image(folder / "label" / name, change)


@pytest.fixture(scope="session")
def torchgeo_layouts() -> type[TorchgeoLayouts]:
    """:class:`TorchgeoLayouts`: ``torchgeo_layouts.<class>(root, ...)`` writes a tiny dataset, returns its data fields."""
    return TorchgeoLayouts


# Pretraining and federated tests share one generated archive, one stand-in teacher and child environments.
@pytest.fixture(scope="session")
def archive(tmp_path_factory) -> dict[str, Path]:
    from geofm.data.demo import make_demo_archive

    return make_demo_archive(tmp_path_factory.mktemp("demo"), seed=0)


@pytest.fixture(scope="session")
def teacher_file(tmp_path_factory) -> Path:
    """A random tiny Swin saved as a plain timm state dict (.pth), standing in for ImageNet weights."""
    import torch

    from geofm.models.backbones import backbone_kwargs, create_backbone

    torch.manual_seed(123)
    kwargs = backbone_kwargs(in_chans=3, img_size=32, window_size=4, timm_kwargs=TINY_SWIN)
    path = tmp_path_factory.mktemp("teacher") / "teacher_timm.pth"
    torch.save(create_backbone("swin_tiny_patch4_window7_224", kwargs).state_dict(), path)
    return path


@pytest.fixture(scope="session")
def satlas_file(tmp_path_factory) -> Path:
    """A random tiny torchvision Swin-v2 (window 2) saved as a Satlas release: ``backbone.backbone.*`` beside its FPN."""
    import torch
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

    torch.manual_seed(7)
    tiny = SwinTransformer(
        [4, 4], 16, [1, 1, 2, 1], [1, 2, 4, 8], [2, 2], block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2
    )
    state = {f"backbone.backbone.{k}": v for k, v in tiny.state_dict().items()}
    path = tmp_path_factory.mktemp("satlas") / "satlas_swinv2.pth"
    torch.save({**state, "intermediates.0.conv.weight": torch.zeros(8, 16, 1, 1)}, path)
    return path


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for a child geofm process: CPU accelerator, without this process's own process-group variables."""
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {**{k: v for k, v in os.environ.items() if k not in launcher}, "DS_ACCELERATOR": "cpu"}


SAVED_BEFORE_TASK_OPTIONS = Path(__file__).parent / "config" / "saved_before_task_options"
"""``config.yaml`` of tiny pretraining runs as geofm saved them with top-level ``masking`` and ``teacher``."""


@pytest.fixture
def config_saved_before_task_options():
    """Write ``run_dir/config.yaml`` as geofm saved run ``name`` (``gfm``, ``simmim``, ``dino``) before
    masking and teacher were masked image modelling's ``task_options``; ``paths`` fill its ``@TOKEN@``
    placeholders (``TEACHER``, a source's name; ``RUN`` is ``run_dir``), a token without one keeps its name."""
    import re

    def write(name: str, run_dir: Path, **paths) -> Path:
        values = {"RUN": str(run_dir), **{token: str(path) for token, path in paths.items()}}
        text = (SAVED_BEFORE_TASK_OPTIONS / f"{name}.yaml").read_text()
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "config.yaml"
        path.write_text(re.sub(r"@(\w+)@", lambda match: values.get(match[1], match[1]), text))
        return path

    return write
