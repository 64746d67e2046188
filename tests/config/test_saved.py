"""Configs that runs saved before a key moved read back in today's shape (geofm.config.saved)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from geofm.config import DataConfig, config_to_dict, read_config_tree
from geofm.config.finetune import FinetuneConfig
from geofm.config.pretrain import PretrainConfig
from geofm.config.saved import read_saved_config
from geofm.errors import ConfigError

FEDERATED = Path(__file__).parents[2] / "configs/federated/demo_fedsense_swin_micro__s2_l8_real__1bit_ef.yaml"


def test_a_run_saved_with_flat_source_layout_keys_reads_back_with_source_options(tmp_path):
    """A saved config of before the sources' options (every source wrote filename_regex and band_ids,
    null or band_files' default table where it left them out) is today's config once read back."""
    data = DataConfig.model_validate(read_config_tree(FEDERATED)["data"])
    today = {"task": "gfm", "data": config_to_dict(data)}
    sources = today["data"]["sources"]
    assert [s["layout"] for s in sources] == ["band_files"] * 3 and all(s["options"]["band_ids"] for s in sources)
    old = {**today, "data": {**today["data"], "sources": [_flat(s) for s in sources]}}
    old["data"]["sources"][0]["band_ids"] = "vocabulary"  # the default then: today's options leave it out
    del today["data"]["sources"][0]["options"]["band_ids"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))

    assert read_saved_config(tmp_path / "config.yaml") == today, "a resume compares equal trees"
    DataConfig.model_validate(today["data"])


def _flat(source: dict) -> dict:
    """A source as a run saved it before its layout's settings moved to ``options``."""
    flat = {key: value for key, value in source.items() if key != "options"}
    return {**flat, "filename_regex": source["options"]["filename_regex"], "band_ids": source["options"]["band_ids"]}


@pytest.mark.parametrize(
    ("task", "options", "flat"),
    [
        ("segmentation", {"channels": 16}, {"decoder_channels": 16}),
        ("superres", {"channels": 4, "residual": False}, {"superres_channels": 4, "superres_residual": False}),
        ("classification", {}, {}),
    ],
)
def test_a_run_saved_with_flat_head_keys_reads_back_with_head_options(task, options, flat, task_config, tmp_path):
    """A run's config.yaml of before head.options (every flat key written, defaults included) reads back
    as the config of today, so that eval, predict, report and resume take the run as it was."""
    from finetune.best import run_config  # the training stack: only where a finetuning run is read

    cfg = task_config(task, head={"options": options})
    saved = config_to_dict(cfg)
    old_defaults = {"decoder_channels": 256, "feature_blocks": None, "superres_channels": 16, "superres_residual": True}
    saved["head"] = {"name": None, **old_defaults, **flat}
    run_dir = tmp_path / "old_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))

    assert read_saved_config(run_dir / "config.yaml") == config_to_dict(cfg), "resume compares equal trees"
    assert run_config(run_dir) == cfg
    with pytest.raises(ConfigError, match=r"a head's own settings go in head\.options"):
        FinetuneConfig.from_tree(saved)


def test_a_federated_run_saved_with_flat_server_rule_keys_reads_back_with_their_options(tmp_path):
    """Every default of the aggregator and server optimiser was saved flat; only the chosen rule's
    non-default values move into its options."""
    from geofm.config.algorithm import AlgorithmConfig

    current = AlgorithmConfig(
        name="fedavg",
        server_optimizer={"name": "fedavgm", "lr": 0.5, "options": {"momentum": 0.5}},
        aggregator={"name": "krum", "options": {"multi_krum": 2}},
    )
    today = {"algorithm": config_to_dict(current)}
    old = {"algorithm": {**today["algorithm"]}}
    old["algorithm"]["server_optimizer"] = {"name": "fedavgm", "lr": 0.5, "momentum": 0.5}
    old["algorithm"]["server_optimizer"] |= {"beta1": 0.9, "beta2": 0.99, "tau": 0.001}
    old["algorithm"]["aggregator"] = {"name": "krum", "trim_fraction": 0.1, "byzantine_clients": 0, "multi_krum": 2}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))

    assert read_saved_config(tmp_path / "config.yaml") == today
    with pytest.raises(ValueError, match=r"momentum, beta1, beta2, tau: the server optimiser's own settings go in"):
        AlgorithmConfig.model_validate(old["algorithm"])


@pytest.mark.parametrize("name", ["gfm", "simmim"])
def test_a_masked_image_modelling_run_saved_with_top_level_masking_and_teacher_reads_them_back_as_its_options(
    name, config_saved_before_task_options, tmp_path
):
    """GFM and SimMIM runs saved ``masking`` and ``teacher`` at the top level; they are the task's options now."""
    path = config_saved_before_task_options(name, tmp_path / "run", TEACHER=tmp_path / "teacher.pth")
    old = yaml.safe_load(path.read_text())

    tree = read_saved_config(path)

    assert "masking" not in tree and "teacher" not in tree and tree["task"] == "mim"
    assert tree["task_options"] == {"masking": old["masking"], "teacher": old["teacher"]}
    assert config_to_dict(PretrainConfig.from_tree(tree, str(path))) == tree, "a resume compares equal trees"
    assert (old["teacher"] is None) == (name == "simmim")


def test_a_dino_run_saved_with_the_default_masking_and_no_teacher_reads_back_without_them(
    config_saved_before_task_options, tmp_path
):
    path = config_saved_before_task_options("dino", tmp_path / "run")
    old = yaml.safe_load(path.read_text())
    assert old["masking"] == {"mask_patch_size": 32, "mask_ratio": 0.6} and old["teacher"] is None

    tree = read_saved_config(path)

    assert "masking" not in tree and "teacher" not in tree and tree["task"] == "dino"
    assert not {"masking", "teacher"} & set(tree["task_options"])
    assert config_to_dict(PretrainConfig.from_tree(tree, str(path))) == tree, "a resume compares equal trees"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("masking", {"mask_patch_size": 16, "mask_ratio": 0.6}),
        ("teacher", {"arch": "swin_tiny_patch4_window7_224", "img_size": 32, "checkpoint": "teacher.pth"}),
    ],
)
def test_a_dino_config_with_a_masking_or_a_teacher_is_refused_in_one_line_naming_the_file_and_field(
    field, value, config_saved_before_task_options, tmp_path
):
    path = config_saved_before_task_options("dino", tmp_path / "run")
    old = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**old, field: value}, sort_keys=False))

    with pytest.raises(ConfigError) as caught:
        read_saved_config(path)

    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: {field}: ")
    assert f"task dino does not read; remove {field}" in message


def test_a_run_saved_before_configs_named_a_task_is_masked_image_modelling(config_saved_before_task_options, tmp_path):
    path = config_saved_before_task_options("gfm", tmp_path / "run")
    old = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({k: v for k, v in old.items() if k not in ("task", "task_options")}))

    tree = read_saved_config(path)

    assert "task" not in tree and tree["task_options"]["teacher"] == old["teacher"]
    assert PretrainConfig.from_tree(tree).task == "mim"
