"""``geofm bench one-shot``: its methods' configs, their selection, and its quick run."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import one_shot as bench
from federation.runtime.contract import PROGRAMS
from geofm.config.ensemble import EnsembleConfig
from geofm.config.feddiff import FedDiffConfig
from geofm.config.federated import read_federated_config
from geofm.config.oscar import OscarConfig
from geofm.data.demo import make_demo_archive
from geofm.errors import ConfigError
from tests.benchmarks.conftest import run_quick

TASK = {
    "data": {
        "root": "chips",
        "bands": ["red", "green", "blue"],
        "dataset_bands": ["red", "green", "blue"],
        "mean": [0.3, 0.4, 0.3],
        "std": [0.2, 0.1, 0.1],
        "num_classes": 4,
        "class_names": ["a", "b", "c", "d"],
    },
    "public": "public",
}


def test_every_method_is_a_valid_config_of_its_program(tmp_path: Path) -> None:
    settings = dict(bench.DEFAULTS)

    released = tmp_path / "released" / "backbone.safetensors"

    def tree(method: str) -> dict:
        return bench.method_tree(settings, method, TASK, 0.1, 5, 2, tmp_path / method, released)

    one_round = read_federated_config(tree("fedavg_1round"))
    reference = read_federated_config(tree("fedavg"))
    assert one_round.federation.rounds == 1 and one_round.train.local_epochs == settings["epochs"]
    assert reference.federation.rounds == settings["fedavg_rounds"] and reference.train.local_epochs == 1
    assert FedDiffConfig.from_tree(tree("feddiff")).diffusion.privacy is None
    assert FedDiffConfig.from_tree(tree("feddiff_no_fmf")).diffusion.fmf_gamma == 0
    epsilons = [FedDiffConfig.from_tree(tree(f"feddiff_dp_eps{e}")).diffusion.privacy.epsilon for e in (50, 10)]
    assert epsilons == [50.0, 10.0]
    ensemble = EnsembleConfig.from_tree(tree("ensemble"))
    assert ensemble.ensemble.public == Path("public") and ensemble.federation.dirichlet_alpha == 0.1
    oscar = OscarConfig.from_tree(tree("oscar"))
    assert oscar.oscar.public == Path("public") and oscar.encoder.checkpoint == released, "a pretrained encoder"
    assert oscar.encoder.model.timm_kwargs == oscar.model.timm_kwargs and oscar.checkpoint is None
    random_encoder = OscarConfig.from_tree(tree("oscar_random_encoder"))
    assert random_encoder.encoder.checkpoint is None, "the classifier's own backbone, random"
    with pytest.raises(ValueError, match="released backbone"):
        bench.method_tree(settings, "oscar", TASK, 0.1, 5, 2, tmp_path / "o")
    ddpm, feddiff = oscar.diffusion.model_dump(), FedDiffConfig.from_tree(tree("feddiff")).diffusion.model_dump()
    assert ddpm == {key: feddiff[key] for key in ddpm}, "OSCAR's server U-Net: FedDiff's clients' DDPM settings"
    assert {cfg.run.seed for cfg in (one_round, reference, ensemble, oscar)} == {2}, "paired seeds"


def test_every_method_runs_a_registered_program_and_a_selection_is_checked() -> None:
    assert {program for program, _ in bench.METHODS.values()} <= set(PROGRAMS.names())
    assert "oscar" in bench.selected_methods(None) and bench.selected_methods(None) == list(bench.METHODS)
    assert bench.selected_methods(["ensemble", "oscar"]) == ["ensemble", "oscar"]
    with pytest.raises(ConfigError, match="methods: unknown dense"):
        bench.selected_methods(["feddiff", "dense"])


def test_a_refused_method_is_skipped_with_its_reason_and_the_others_keep_their_seeds(monkeypatch, tmp_path: Path):
    def fake_run(program: str, tree: dict) -> dict:
        if program == "feddiff":
            raise ConfigError("federation.partition 'dirichlet' (alpha 0.01) left a client without samples")
        seed = tree["run"]["seed"]
        return {
            "accuracy": 0.5 + seed / 10,
            "uplink_bytes": 8,
            "client_seconds": 1.0,
            "server_seconds": 2.0,
            "epsilon": None,
        }

    monkeypatch.setattr(bench, "run_method", fake_run)
    setting = {"task": "demo", "alpha": 0.01, "clients": 10}
    settings = {**bench.DEFAULTS, "seeds": [0, 1]}
    results = bench.run_setting(settings, ["feddiff", "ensemble"], "demo", TASK, setting, tmp_path, {})
    assert results[0]["method"] == "feddiff" and results[0]["skipped"].startswith("seed 0: federation.partition")
    assert results[1]["per_seed"] == [0.5, 0.6] and results[1]["mean"] == pytest.approx(0.55)
    assert bench.row(results[0])["accuracy"].startswith("seed 0: federation.partition")
    monkeypatch.setattr(bench, "run_method", lambda program, tree: pytest.fail("a finished run ran again"))
    again = bench.run_setting(settings, ["ensemble"], "demo", TASK, setting, tmp_path, {})
    assert again[0]["per_seed"] == [0.5, 0.6], "a rerun reads the finished runs from the work folder"


def test_an_unknown_task_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown task 'mars'"):
        bench.prepare_tasks({**bench.DEFAULTS, "tasks": ["mars"]}, tmp_path)


@pytest.mark.slow
def test_the_quick_run_measures_each_method(tmp_path: Path) -> None:
    archive = tmp_path / "demo"
    make_demo_archive(archive, seed=0)
    overrides = [f"archive={archive}", f"work_dir={tmp_path / 'work'}"]
    record = run_quick("one-shot", tmp_path, [*overrides, f"figure={tmp_path / 'samples.png'}"])
    results = record["results"]["results"]
    assert [r["method"] for r in results] == ["feddiff", "oscar", "fedavg_1round", "ensemble"]
    for result in results:
        assert 0.0 <= result["mean"] <= 1.0 and len(result["per_seed"]) == 1 and result["std"] == 0.0
        assert result["uplink_bytes"] > 0 and result["client_seconds"] > 0 and result["epsilon"] is None
        assert (result["task"], result["alpha"], result["clients"]) == ("demo", 0.5, 2)
    assert results[2]["uplink_bytes"] == pytest.approx(results[3]["uplink_bytes"], rel=1e-3), "both: the model once"
    assert results[1]["uplink_bytes"] < results[0]["uplink_bytes"] / 10, "OSCAR: class embeddings, not a model"
    assert bench.markdown(record["results"]).count("| demo a=0.5 K=2 |") == 4
    if record["results"]["figures"]["demo"] is not None:
        assert Path(record["results"]["figures"]["demo"]).stat().st_size > 0
