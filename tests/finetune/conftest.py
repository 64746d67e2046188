"""Tiny finetuning setups: generated class folders of 4-band GeoTIFFs and in-memory datasets of every task."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from geofm.data.finetune.sampler import SampleIndex
from geofm.data.writers import write_geotiff

CLASSES = ["field", "forest", "water"]
TRANSFORM = (10.0, 0.0, 500_000.0, 0.0, -10.0, 4_000_000.0)


@pytest.fixture(scope="session")
def class_folders(tmp_path_factory) -> Path:
    """train/val/test split folders, one sub-folder per class, of 40 px 4-band (blue, green, red, nir) uint16 GeoTIFFs."""
    root = tmp_path_factory.mktemp("classes")
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 8), ("val", 3), ("test", 3)):
        for label, name in enumerate(CLASSES):
            for i in range(per_class):
                pixels = rng.normal(1000 + 800 * label, 150, (4, 40, 40)).clip(1, 60000).astype(np.uint16)
                write_geotiff(root / split / name / f"{i}.tif", pixels, transform=TRANSFORM, crs=32632, nodata=0)
    return root


@pytest.fixture
def one_shot_tree(finetune_tree, class_folders):
    """``make(output_dir)``: a one-shot config tree on :func:`class_folders`: 2 label-skewed clients, the
    classifier (or a client's model) trained 1 epoch; each program adds its section."""

    def make(output_dir: Path) -> dict:
        tree = finetune_tree("classification", output_dir, data={"root": str(class_folders), "class_names": CLASSES})
        tree["train"] = {**tree["train"], "epochs": 1, "warmup_epochs": 0}
        tree["federation"] = {"rounds": 1, "clients": 2, "partition": "dirichlet", "dirichlet_alpha": 0.5}
        return tree

    return make


@pytest.fixture
def feddiff_tree(one_shot_tree):
    """``make(output_dir)``: a FedDiff config tree of :func:`one_shot_tree`: a U-Net of 4 and 8 channels,
    20 timesteps, 2 sampling steps, FMF dropping 20 %."""

    def make(output_dir: Path) -> dict:
        tree = one_shot_tree(output_dir)
        tree["diffusion"] = {
            "unet": {"channels": [4, 8], "norm_groups": 2},
            "timesteps": 20,
            "epochs": 1,
            "batch_size": 8,
            "sampling_steps": 2,
            "sample_batch": 8,
            "fmf_gamma": 20.0,
        }
        return tree

    return make


@pytest.fixture
def ensemble_tree(one_shot_tree, tmp_path):
    """``make(output_dir)``: an ensemble distillation config tree of :func:`one_shot_tree` whose public images
    are three 48 px 4-band scenes no client holds (four 32 px tiles each), distilled for 2 epochs in batches of 4."""
    rng = np.random.default_rng(1)
    for i in range(3):
        pixels = rng.normal(1500, 600, (4, 48, 48)).clip(1, 60000).astype(np.uint16)
        write_geotiff(tmp_path / "public" / f"{i}.tif", pixels, transform=TRANSFORM, crs=32632)

    def make(output_dir: Path) -> dict:
        tree = one_shot_tree(output_dir)
        tree["ensemble"] = {"public": str(tmp_path / "public"), "epochs": 2, "batch_size": 4}
        return tree

    return make


@pytest.fixture
def oscar_tree(feddiff_tree, class_folders):
    """``make(output_dir)``: an OSCAR config tree on :func:`class_folders` with :func:`feddiff_tree`'s clients,
    U-Net, sampling and classifier; the server's public imagery is the val split (its class names ignored),
    the encoder the config's own random backbone."""

    def make(output_dir: Path) -> dict:
        tree = feddiff_tree(output_dir)
        del tree["diffusion"]["fmf_gamma"]
        tree["oscar"] = {"public": str(class_folders / "val"), "p_uncond": 0.1, "guidance_scale": 2.0}
        return tree

    return make


class RandomTaskData(Dataset):
    """``n`` random samples in a task's sample format (see geofm.config.finetune), fixed by ``seed``; an
    index is a position or, as the training loader gives it, a :class:`SampleIndex`."""

    def __init__(self, task: str, n: int, size: int = 32, bands: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.samples = []
        for _ in range(n):
            image = torch.randn(bands, size, size, generator=g)
            if task == "classification":
                sample = {"image": image, "label": torch.randint(0, 3, (), generator=g)}
            elif task == "multilabel":
                sample = {"image": image, "label": (torch.rand(3, generator=g) > 0.5).float()}
            elif task == "segmentation":
                mask = torch.randint(0, 3, (size, size), generator=g)
                mask[:4] = 255
                sample = {"image": image, "mask": mask}
            elif task == "change":
                after = torch.randn(bands, size, size, generator=g)
                sample = {"image1": image, "image2": after, "mask": torch.randint(0, 2, (size, size), generator=g)}
            else:
                sample = {"image": image, "target": torch.randn(bands, 2 * size, 2 * size, generator=g)}
            self.samples.append(sample)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int | SampleIndex) -> dict:
        return self.samples[index.index if isinstance(index, SampleIndex) else index]


@pytest.fixture
def random_datasets(monkeypatch):
    """Make the finetuning program read :class:`RandomTaskData` (8 train, 4 val, 4 test samples)."""
    import finetune.splits

    def build(data_cfg, task, split, img_size, train):
        size, seed = {"train": (8, 0), "val": (4, 1), "test": (4, 2)}[split]
        return RandomTaskData(task, size, img_size, len(data_cfg.bands), seed=seed)

    monkeypatch.setattr(finetune.splits, "build_finetune_dataset", build)
    return build


@pytest.fixture(scope="session")
def classification_run(class_folders, finetune_tree, tmp_path_factory) -> Path:
    """A finished 2-epoch classification run on :func:`class_folders` (12 steps, validation each epoch)."""
    from finetune.run import finetune
    from geofm.config.finetune import FinetuneConfig

    tree = finetune_tree("classification", tmp_path_factory.mktemp("runs") / "cls", data={"root": str(class_folders)})
    return finetune(FinetuneConfig.from_tree(tree))


@pytest.fixture
def rgb_export(task_config, tmp_path) -> Path:
    """A geofm export of a random tiny Swin (that of :func:`task_config`) on red, green, blue."""
    from finetune.models import finetune_backbone_kwargs
    from geofm.checkpoints import export_backbone
    from geofm.models.backbones import create_backbone

    rgb = ["red", "green", "blue"]
    cfg = task_config("classification", data={"bands": rgb, "dataset_bands": rgb, "mean": [0.3] * 3, "std": [0.1] * 3})
    kwargs = finetune_backbone_kwargs(cfg)
    torch.manual_seed(7)
    out = tmp_path / "export"
    model = create_backbone(cfg.model.arch, kwargs)
    export_backbone(model, out, arch=cfg.model.arch, create_kwargs=kwargs, metadata={"bands": rgb})
    return out
