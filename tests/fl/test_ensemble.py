"""Ensemble distillation's pieces: the averaged soft labels and the distillation loss by hand, public tiles, its config."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

from federation.cli import program_run_config
from federation.runtime.contract import INSTITUTIONS
from geofm.config.ensemble import EnsembleConfig
from geofm.config.finetune_data import FinetuneDataConfig
from geofm.data.writers import write_geotiff
from geofm.errors import ConfigError
from geofm.fl.oneshot.ensemble import (
    average_state,
    distill,
    distillation_loss,
    ensemble_probabilities,
    public_tiles,
    tile_starts,
)


def _softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def test_the_teachers_probabilities_are_averaged_by_their_weights_at_temperature():
    a, b = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 4.0]])
    averaged = ensemble_probabilities([a, b], [3.0, 1.0], temperature=2.0)
    pa, pb = _softmax([1.0, 0.0]), _softmax([0.0, 2.0])  # the logits halved
    expected = [0.75 * x + 0.25 * y for x, y in zip(pa, pb, strict=True)]
    assert averaged[0].tolist() == pytest.approx(expected, rel=1e-6)
    plain = ensemble_probabilities([a, b], [1.0, 1.0], temperature=1.0)
    by_hand = [(x + y) / 2 for x, y in zip(_softmax([2, 0]), _softmax([0, 4]), strict=True)]
    assert plain[0].tolist() == pytest.approx(by_hand)


def test_the_loss_is_the_kl_divergence_at_temperature_scaled_by_its_square():
    teacher = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    student = torch.tensor([[1.0, 0.0, -1.0], [0.0, 3.0, 0.0]])
    t = 2.0
    by_hand = 0.0
    for p, z in zip(teacher.tolist(), student.tolist(), strict=True):
        q = _softmax([v / t for v in z])
        by_hand += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    assert distillation_loss(student, teacher, t).item() == pytest.approx(t * t * by_hand / 2, rel=1e-5)
    matched = torch.log(teacher) * t  # the student's softened softmax equals the teacher: no divergence
    assert distillation_loss(matched, teacher, t).item() == pytest.approx(0.0, abs=1e-6)


def test_distilling_moves_the_student_to_the_targets():
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    images = torch.randn(16, 1, 2, 2)
    teacher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    with torch.no_grad():
        targets = torch.softmax(teacher(images) * 3, dim=-1)  # a linear student can match them
    seen = []
    losses = distill(
        student,
        images,
        targets,
        temperature=1.0,
        epochs=30,
        batch_size=8,
        lr=0.05,
        device=torch.device("cpu"),
        seed=0,
        after_epoch=lambda epoch, loss: seen.append(epoch),
    )
    assert seen == list(range(1, 31)) and losses[-1] < 0.2 * losses[0]


def test_averaged_state_weights_floats_and_keeps_integers():
    a = {"w": np.array([1.0, 3.0], dtype=np.float32), "index": np.array([0, 1])}
    b = {"w": np.array([3.0, 7.0], dtype=np.float32), "index": np.array([0, 1])}
    state = average_state([a, b], [3.0, 1.0])
    assert state["w"].tolist() == [1.5, 4.0] and state["w"].dtype == torch.float32
    assert state["index"].tolist() == [0, 1]


def test_public_images_are_normalised_tiles_of_the_models_bands(tmp_path):
    assert tile_starts(96, 64) == [0, 32] and tile_starts(64, 64) == [0] and tile_starts(32, 64) == []
    pixels = np.stack([np.full((96, 80), v, dtype=np.uint8) for v in (10, 20, 30)])
    write_geotiff(tmp_path / "public" / "a.tif", pixels, transform=(1, 0, 0, 0, -1, 96), crs=None)
    data = FinetuneDataConfig(
        root=tmp_path,
        bands=["blue", "red"],
        dataset_bands=["red", "green", "blue"],
        scale=0.1,
        mean=[1.0, 0.0, 2.0],
        std=[1.0, 1.0, 0.5],
        num_classes=2,
    )
    tiles = public_tiles(tmp_path / "public", data, 64)
    assert tiles.shape == (4, 2, 64, 64)  # rows 0, 32; columns 0, 16
    assert tiles[:, 0].unique().tolist() == [pytest.approx(2.0)]  # (30 * 0.1 - 2) / 0.5
    assert tiles[:, 1].unique().tolist() == [pytest.approx(0.0)]  # (10 * 0.1 - 1) / 1
    with pytest.raises(ConfigError, match=r"ensemble.public: no folder .*none"):
        public_tiles(tmp_path / "none", data, 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"ensemble.public: .*empty holds no image"):
        public_tiles(tmp_path / "empty", data, 64)
    with pytest.raises(ConfigError, match=r"no image .* 128 px"):
        public_tiles(tmp_path / "public", data, 128)


@pytest.fixture
def ensemble_tree(finetune_tree, tmp_path):
    tree = finetune_tree(
        "classification", tmp_path / "run", data={"root": str(tmp_path), "class_names": ["a", "b", "c"]}
    )
    tree["federation"] = {"rounds": 1, "clients": 2, "partition": "dirichlet", "dirichlet_alpha": 0.5}
    tree["ensemble"] = {"public": str(tmp_path / "public")}
    return tree


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"federation": {"rounds": 3, "clients": 2}}, "ensemble distillation is one-shot"),
        ({"federation": {"rounds": 1, "clients": 2, "fraction": 0.5}}, "federation.fraction"),
        ({"federation": {"rounds": 1}}, "needs federation.clients"),
        ({"federation": {"rounds": 1, "clients": 2, "min_clients": 3}}, "min_clients 3 exceeds"),
        ({"task": "segmentation"}, "ensemble distillation is one-shot federated classification"),
        ({"ensemble": {"public": "p", "temperature": 0}}, "ensemble.temperature"),
        ({"ensemble": {"public": "p", "weighting": "per_class"}}, "ensemble.weighting"),
        ({"ensemble": {"public": "p", "student_init": "random"}}, "ensemble.student_init"),
        ({"ensemble": {}}, "ensemble.public"),
        ({"data": {"class_names": None}}, "data.class_names"),
    ],
)
def test_the_config_refuses_what_the_ensemble_cannot_run(ensemble_tree, change, message):
    tree = {**ensemble_tree, **change, "data": {**ensemble_tree["data"], **change.get("data", {})}}
    with pytest.raises(ConfigError, match=message):
        EnsembleConfig.from_tree(tree)


def test_the_server_inputs_check_names_a_public_folder_missing_or_without_images(ensemble_tree, tmp_path):
    cfg = EnsembleConfig.from_tree(ensemble_tree)
    with pytest.raises(ConfigError, match=r"ensemble.public: no folder .*public \(the public unlabelled images"):
        cfg.check_server_inputs()
    (tmp_path / "public" / "forest").mkdir(parents=True)
    (tmp_path / "public" / "notes.txt").write_text("not an image")
    with pytest.raises(ConfigError, match=r"ensemble.public: .*public holds no image with a suffix of data.suffixes"):
        cfg.check_server_inputs()
    pixels = np.ones((3, 8, 8), np.uint8)
    write_geotiff(tmp_path / "public" / "forest" / "a.TIF", pixels, transform=(1, 0, 0, 0, -1, 8), crs=None)
    cfg.check_server_inputs()  # class folders are searched, suffixes matched without case


def test_geofm_fed_simulate_takes_the_ensembles_institutions_from_its_config(ensemble_tree, tmp_path):
    config = tmp_path / "ensemble.json"  # JSON is YAML
    config.write_text(json.dumps(ensemble_tree))
    args = argparse.Namespace(config=config, overrides=["federation.clients=3"], program="ensemble", institutions=None)
    assert program_run_config(args)[INSTITUTIONS] == "client00,client01,client02"
