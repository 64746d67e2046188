"""Finetuning on one large scene: a region split, chips and several crops per chip, persistent loader workers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from finetune.run import finetune
from geofm.config.finetune import FinetuneConfig
from geofm.data.writers import write_geotiff
from geofm.errors import ConfigError
from tests.finetune.conftest import TRANSFORM
from tests.finetune.test_run import _records

SIDE = 256
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def scene_root(tmp_path_factory):
    """One 256 x 256 four-band scene with a 3-class mask, in ``images/`` and ``masks/`` of the root."""
    root = tmp_path_factory.mktemp("scene")
    rng = np.random.default_rng(0)
    classes = (np.add.outer(np.arange(SIDE) // 16, np.arange(SIDE) // 24) % 3).astype(np.uint8)
    image = rng.normal(1500, 200, (4, SIDE, SIDE)) + 600.0 * classes
    write_geotiff(root / "images" / "scene.tif", image.clip(1, 60000).astype(np.uint16), transform=TRANSFORM, crs=32632)
    write_geotiff(root / "masks" / "scene.tif", classes[None], transform=TRANSFORM, crs=32632)
    return root


def _tree(finetune_tree, root, output, **run):
    data = {
        "root": str(root),
        "split": {"by": "regions", "fractions": [0.25, 0.25, 0.5], "block": 128},
        "chip_size": 64,
        "crops_per_scene": 2,
        "num_workers": 2,
    }
    return finetune_tree("segmentation", output, data=data, run={"log_every": 1, "progress": False, **run})


@pytest.mark.slow
def test_a_scene_split_into_regions_trains_on_its_chips_and_resumes_exactly(scene_root, finetune_tree, tmp_path):
    straight = finetune(FinetuneConfig.from_tree(_tree(finetune_tree, scene_root, tmp_path / "straight")))
    records = _records(straight)
    # train: 1 of the 4 blocks of 128 px, its 4 chips of 64 px, 2 crops a chip: 8 samples, 2 steps of 4 an epoch
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4], "2 epochs of 2 steps"
    assert [r["step"] for r in records if "val" in r] == [2, 4], "validations through persistent workers"
    evaluation = json.loads((straight / "eval.json").read_text())
    assert evaluation["scored_pixels"] == 2 * 128 * 128, "the 2 test blocks, tiled once over"

    stopped = _tree(finetune_tree, scene_root, tmp_path / "resumed", stop_after_steps=1)
    finetune(FinetuneConfig.from_tree(stopped))
    resumed = finetune(FinetuneConfig.from_tree(_tree(finetune_tree, scene_root, tmp_path / "resumed")))
    for a, b in zip(_records(resumed), records, strict=True):
        assert a["step"] == b["step"]
        if "loss" in a:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), f"step {a['step']}: the resumed run diverged"
    assert json.loads((resumed / "eval.json").read_text())["metrics"] == pytest.approx(evaluation["metrics"])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"chip_size": 16}, r"data.chip_size 16 is smaller than model.img_size 32"),
        (
            {"split": {"by": "regions", "fractions": [0.8, 0.1, 0.1]}},
            r"data.split.block .* by: regions, which needs it",
        ),
        ({"split": {"by": "rows", "fractions": [0.8, 0.1, 0.2]}}, r"3 shares \(train, val, test\) summing to 1"),
        (
            {"split": {"by": "rows", "fractions": [0.8, 0.1, 0.1]}, "splits": {"val": "test"}},
            r"data.splits names split folders; with data.split",
        ),
    ],
)
def test_chip_and_split_settings_are_checked_with_the_config(task_tree, data, message):
    with pytest.raises(ConfigError, match=message):
        FinetuneConfig.from_tree(task_tree("segmentation", data=data))


def test_a_classification_scene_is_not_cut(task_tree):
    with pytest.raises(ConfigError, match=r"a classification scene is one sample with one label"):
        FinetuneConfig.from_tree(task_tree("classification", data={"chip_size": 64}))
