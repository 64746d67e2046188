from pathlib import Path

import pytest
import yaml

from geofm.config import load_config
from geofm.errors import ConfigError

CONFIGS = sorted(Path(__file__).parents[1].joinpath("configs", "pretrain").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.run.output_dir.name == path.stem, "configs are named after the run they make"


def test_paper_setting():
    cfg = load_config(Path(__file__).parents[1] / "configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml")
    assert (cfg.model.img_size, cfg.model.window_size, cfg.train.epochs) == (192, 6, 100)
    assert (cfg.train.base_lr, cfg.train.lr_reference_batch, cfg.train.warmup_epochs) == (2e-4, 512, 10)
    assert (cfg.train.weight_decay, cfg.train.grad_clip) == (0.05, 5.0)
    assert (cfg.masking.mask_patch_size, cfg.masking.mask_ratio) == (32, 0.6)
    assert (cfg.teacher.stage, cfg.teacher.include_merging, cfg.teacher.alpha) == (3, True, 1.0)


@pytest.fixture
def demo_tree():
    path = Path(__file__).parents[1] / "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml"
    return path, yaml.safe_load(path.read_text())


def _write(tmp_path, tree):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.epoch=3", r"train\.epoch: unknown key"),
        ("train.epochs=ten", r"train\.epochs: .*integer.*'ten'"),
        ("model.arch=resnet50", "unknown backbone architecture 'resnet50'"),
        ("masking.mask_patch_size=24", "not divisible by masking.mask_patch_size"),
        ("masking.mask_patch_size=2", "not divisible by the backbone's patch size"),
        ("teacher.stage=4", "stage 4 with include_merging=True does not exist"),
        ("train.warmup_epochs=20", "warmup_epochs .* must be shorter than epochs"),
        ("train.zero_stage=3", r"train\.zero_stage"),
        ("data.on_bad_file=ignore", r"data\.on_bad_file"),
        ("model.img_size=72", "must be divisible by 8"),
        ("data.bands=[red, green, nir, swir]", "must name red, green and blue"),
    ],
)
def test_config_errors_name_the_field(demo_tree, override, message):
    path, _ = demo_tree
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path, [override])
    assert str(path) in str(info.value)


def test_source_stats_must_match_bands(demo_tree, tmp_path):
    _, tree = demo_tree
    tree["data"]["sources"][1]["mean"] = [0.1, 0.2]
    with pytest.raises(ConfigError, match="satellite_4band.*one value per band"):
        load_config(_write(tmp_path, tree))


def test_vit_window_size_is_rejected(demo_tree, tmp_path):
    _, tree = demo_tree
    tree["model"]["arch"] = "vit_small_patch16_224"
    tree["model"]["timm_kwargs"] = {}
    with pytest.raises(ConfigError, match="window_size applies to Swin"):
        load_config(_write(tmp_path, tree))


def test_overrides_apply_and_parse_yaml(demo_tree):
    path, _ = demo_tree
    cfg = load_config(path, ["train.epochs=2", "teacher=null", "data.bands=[red, green, blue]"])
    assert cfg.train.epochs == 2 and cfg.teacher is None and cfg.data.bands == ["red", "green", "blue"]


def test_malformed_override_and_missing_file(demo_tree):
    path, _ = demo_tree
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(path, ["train.epochs"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.yaml")
