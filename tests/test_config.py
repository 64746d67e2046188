from pathlib import Path

import pytest
import yaml

from geofm.config import PretrainConfig
from geofm.config.base import read_config_tree
from geofm.errors import ConfigError
from geofm.tasks.mim.task import mim_options

CONFIGS = sorted(Path(__file__).parents[1].joinpath("configs", "pretrain").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = PretrainConfig.from_file(path)
    assert cfg.run.output_dir.name == path.stem, "configs are named after the run they make"


def test_paper_setting():
    cfg = PretrainConfig.from_file(
        Path(__file__).parents[1] / "configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml"
    )
    assert (cfg.model.img_size, cfg.model.window_size, cfg.train.epochs) == (192, 6, 100)
    assert (cfg.train.base_lr, cfg.train.lr_reference_batch, cfg.train.warmup_epochs) == (2e-4, 512, 10)
    assert (cfg.train.weight_decay, cfg.train.grad_clip) == (0.05, 5.0)
    masking, teacher = mim_options(cfg).masking, mim_options(cfg).teacher
    assert (masking.mask_patch_size, masking.mask_ratio) == (32, 0.6)
    assert (teacher.stage, teacher.include_merging, teacher.alpha) == (3, True, 1.0)
    assert (teacher.img_size, teacher.window_size, teacher.resize_mode, teacher.align_corners) == (
        224,
        7,
        "bilinear",
        True,
    )
    assert teacher.distill_loss == "pooled_cosine"


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
        ("train.epoch=3", r"override train\.epoch=3: unknown key \(did you mean epochs\?\)"),
        ("data.sources.1.nodta=0", r"override data\.sources\.1\.nodta=0: unknown key \(did you mean nodata\?\)"),
        ("modle={arch: swin}", r"override modle={arch: swin}: unknown key \(did you mean model\?\)"),
        ("train.zzz=1", r"override train\.zzz=1: unknown key$"),
        ("train.epochs=ten", r"override train\.epochs=ten: .*integer.*'ten'"),
        ("model.arch=resnet50", "unknown backbone architecture 'resnet50'"),
        ("task_options.masking.mask_patch_size=24", r"not divisible by task_options\.masking\.mask_patch_size"),
        ("task_options.masking.mask_patch_size=2", "not divisible by the backbone's patch size"),
        ("task_options.teacher.stage=4", "stage 4 with include_merging=True does not exist"),
        (
            "task_options.masking.mask_ration=0.5",
            r"override task_options\.masking\.mask_ration=0\.5: unknown key \(did you mean mask_ratio",
        ),
        ("train.warmup_epochs=20", "warmup_epochs .* must be shorter than epochs"),
        ("train.zero_stage=3", r"train\.zero_stage"),
        ("data.on_bad_file=ignore", r"data\.on_bad_file"),
        ("model.img_size=80", "must be divisible by 8"),
        ("data.bands=[green, nir]", "must name red, green and blue"),
        ("data.bands=[red, green, blue, nri]", r"nri\]: unknown band 'nri': did you mean nir\?"),
        (
            "data.sources.1.bands=[blue, green, red, nri]",
            r"nri\] \(satellite_4band\): unknown band 'nri'",
        ),
        ("data.bands=[red, green, blue, swir16]", r"data\.bands \['swir16'\] are provided by no source"),
        ("data.bands=[red, green, blue, b04]", "names red more than once"),
        ("data.sources.5.root=/x", "data.sources is a list of 2 entries; '5' is not an index of it"),
        ("run.output_dir.x=1", "run.output_dir is not a section"),
    ],
)
def test_config_errors_name_the_field(demo_tree, override, message):
    path, _ = demo_tree
    with pytest.raises(ConfigError, match=message) as info:
        PretrainConfig.from_file(path, [override])
    assert str(path) in str(info.value)


def test_an_override_is_named_where_it_set_the_wrong_value(demo_tree):
    path, _ = demo_tree
    with pytest.raises(ConfigError) as info:
        PretrainConfig.from_file(path, ["train.epochz=3", "train={warmup_epochz: 1}"])
    assert str(info.value) == (
        f"the overrides of {path} are invalid\n"
        "  override train.epochz=3: unknown key (did you mean epochs?)\n"
        "  override train={warmup_epochz: 1}: train.warmup_epochz: unknown key (did you mean warmup_epochs?)"
    )


DINO = Path(__file__).parents[1] / "configs/pretrain/demo_dino_swin_micro__img64_win4__4band.yaml"


@pytest.mark.parametrize(
    "override, line",
    [
        ("task_options.teacher_tmp=0.1", "  override task_options.teacher_tmp=0.1: unknown key (did you mean"),
        (
            "task_options={teacher_tmp: 0.1}",
            "  override task_options={teacher_tmp: 0.1}: task_options.teacher_tmp: unknown key (did you mean",
        ),
        ("algorithm.x=1", "  override algorithm.x=1: algorithm: unknown key"),
    ],
)
def test_a_misspelt_option_given_on_the_command_line_is_named_as_the_override(override, line):
    with pytest.raises(ConfigError) as info:
        PretrainConfig.from_file(DINO, [override])
    assert str(info.value).startswith(f"the overrides of {DINO} are invalid\n{line}")
    assert "teacher_temp" in str(info.value) or "algorithm" in override


def test_a_misspelt_option_in_the_file_is_named_by_its_field(tmp_path):
    tree = yaml.safe_load(DINO.read_text())
    tree["task_options"]["teacher_tmp"] = 0.1
    with pytest.raises(ConfigError) as info:
        PretrainConfig.from_file(_write(tmp_path, tree))
    assert (
        str(info.value).splitlines()[1].startswith("  task_options.teacher_tmp: unknown key (did you mean teacher_temp")
    )


def test_a_missing_section_names_the_values_it_needs_and_the_file(demo_tree, tmp_path):
    _, tree = demo_tree
    del tree["run"]
    with pytest.raises(ConfigError) as info:
        PretrainConfig.from_file(_write(tmp_path, tree), ["train.epochs=-1"])
    assert str(info.value) == (
        f"{tmp_path / 'c.yaml'}: invalid configuration\n"
        "  run.output_dir: Field required\n"
        "  override train.epochs=-1: Input should be greater than 0 (got -1)"
    )


def test_a_field_a_section_check_names_is_said_once(demo_tree, tmp_path):
    _, tree = demo_tree
    tree["data"]["bands"] = ["red", "gren"]
    with pytest.raises(ConfigError) as info:
        PretrainConfig.from_file(_write(tmp_path, tree))
    assert "\n  data.bands: unknown band 'gren': did you mean green?" in str(info.value)
    assert "data: data.bands" not in str(info.value)


def test_source_stats_must_match_bands(demo_tree, tmp_path):
    _, tree = demo_tree
    tree["data"]["sources"][1]["mean"] = [0.1, 0.2]
    with pytest.raises(ConfigError, match=r"satellite_4band.*one value per band"):
        PretrainConfig.from_file(_write(tmp_path, tree))


def test_vit_window_size_is_rejected(demo_tree, tmp_path):
    _, tree = demo_tree
    tree["model"]["arch"] = "vit_small_patch16_224"
    tree["model"]["timm_kwargs"] = {}
    with pytest.raises(ConfigError, match="window_size applies to Swin"):
        PretrainConfig.from_file(_write(tmp_path, tree))


def test_overrides_apply_and_parse_yaml(demo_tree):
    path, _ = demo_tree
    overrides = ["train.epochs=2", "task_options.teacher=null", "data.bands=[red, green, blue]"]
    cfg = PretrainConfig.from_file(path, overrides)
    assert cfg.train.epochs == 2 and mim_options(cfg).teacher is None and cfg.data.bands == ["red", "green", "blue"]


def test_overrides_reach_list_entries(demo_tree):
    path, _ = demo_tree
    cfg = PretrainConfig.from_file(path, ["data.sources.0.root=/archive/aerial", "data.sources.-1.weight=3"])
    assert str(cfg.data.sources[0].root) == "/archive/aerial" and cfg.data.sources[1].weight == 3


def test_band_aliases_resolve_and_custom_bands_are_declared(demo_tree):
    path, _ = demo_tree
    cfg = PretrainConfig.from_file(
        path, ["data.bands=[B04, b03, B02, b08]", "data.sources.1.bands=[blue, green, red, NIR]"]
    )
    assert cfg.data.bands == ["red", "green", "blue", "nir"] and cfg.data.sources[1].bands == [
        "blue",
        "green",
        "red",
        "nir",
    ]
    with pytest.raises(ConfigError, match=r"declare other bands under data.custom_bands"):
        PretrainConfig.from_file(path, ["data.sources.1.bands=[blue, green, red, ndvi]"])
    cfg = PretrainConfig.from_file(
        path,
        [
            "data.custom_bands=[ndvi]",
            "data.sources.1.bands=[blue, green, red, ndvi]",
            "data.bands=[red, green, blue, ndvi]",
        ],
    )
    assert cfg.data.bands[-1] == "ndvi"


def test_a_config_builds_on_its_base_section_by_section(demo_tree, tmp_path):
    path, _ = demo_tree
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {path}\ntrain: {{epochs: 3}}\nrun: {{output_dir: runs/child}}\n")
    cfg = PretrainConfig.from_file(child, ["train.base_lr=0.5"])
    parent = PretrainConfig.from_file(path)
    assert (cfg.train.epochs, cfg.train.base_lr, cfg.train.micro_batch_size) == (3, 0.5, parent.train.micro_batch_size)
    assert cfg.data == parent.data and str(cfg.run.output_dir) == "runs/child" and cfg.run.seed == parent.run.seed
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="base configs form a cycle"):
        PretrainConfig.from_file(loop)
    orphan = tmp_path / "orphan.yaml"
    orphan.write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing\.yaml does not exist \(base of"):
        PretrainConfig.from_file(orphan)


def test_base_files_and_overrides_combine_mappings_alike_and_replace_only_when_told(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("data: {kwargs: {bands: s2, num_classes: 19}, root: r}\nmodel: {timm_kwargs: {embed_dim: 16}}\n")
    merging = tmp_path / "merging.yaml"
    merging.write_text("base: base.yaml\ndata: {kwargs: {bands: all}}\n")
    replacing = tmp_path / "replacing.yaml"
    replacing.write_text("base: base.yaml\ndata: {kwargs: !replace {bands: s2}}\n")
    assert read_config_tree(merging)["data"] == {"kwargs": {"bands": "all", "num_classes": 19}, "root": "r"}
    assert read_config_tree(replacing)["data"]["kwargs"] == {"bands": "s2"}
    # The command line combines in the same way as a base file does.
    assert read_config_tree(base, ["data.kwargs={bands: all}"])["data"]["kwargs"] == {"bands": "all", "num_classes": 19}
    assert read_config_tree(base, ["data.kwargs=!replace {bands: s2}"])["data"]["kwargs"] == {"bands": "s2"}
    assert read_config_tree(base, ["data.kwargs={}"])["data"]["kwargs"] == {}, "an empty mapping clears"
    assert read_config_tree(base, ["model=null"])["model"] is None, "anything but a mapping replaces"
    tree = read_config_tree(replacing)
    assert type(tree["data"]["kwargs"]) is dict, "the marker is gone once the tree is read"


def test_replace_on_a_list_or_a_value_replaces_as_without_it(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("data: {bands: [red, green, blue, nir], num_workers: 2}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\ndata: {bands: !replace [red, green], num_workers: !replace 0}\n")
    assert read_config_tree(child)["data"] == {"bands": ["red", "green"], "num_workers": 0}
    overridden = read_config_tree(base, ["data.bands=!replace [nir]", "data.num_workers=!replace null"])
    assert overridden["data"] == {"bands": ["nir"], "num_workers": None}


def test_malformed_override_and_missing_file(demo_tree):
    path, _ = demo_tree
    with pytest.raises(ConfigError, match=r"key.path=value"):
        PretrainConfig.from_file(path, ["train.epochs"])
    with pytest.raises(ConfigError, match=r"override 'train.epochs=\[1,': the value is not valid YAML"):
        PretrainConfig.from_file(path, ["train.epochs=[1,"])
    with pytest.raises(ConfigError, match="does not exist"):
        PretrainConfig.from_file("nope.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_run_saves_masking_and_teacher_only_as_masked_image_modelling_options(path, tmp_path):
    """What ``config.yaml`` of a run of each shipped config holds: a DINO run neither masking nor teacher,
    a masked-image-modelling run the values its config gives, every other one at its default."""
    from geofm.config.sections import MaskingConfig
    from geofm.training.rundir import RunCheckpoints

    cfg = PretrainConfig.from_file(path)
    RunCheckpoints(tmp_path, keep=1, rank=0).start(cfg)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())

    assert "masking" not in saved and "teacher" not in saved
    given = read_config_tree(path).get("task_options", {})
    if cfg.task == "dino":
        assert not {"masking", "teacher"} & set(saved["task_options"])
        return
    assert saved["task_options"]["masking"] == {**MaskingConfig().model_dump(), **given["masking"]}
    teacher = saved["task_options"]["teacher"]
    assert teacher is None if given.get("teacher") is None else teacher.items() >= given["teacher"].items()


def test_a_config_is_of_the_kind_its_task_declares():
    """Pretraining or finetuning, central or federated: the registered task says which, not a key of the config."""
    from geofm.config.federated import read_federated_config
    from geofm.config.fedfinetune import FederatedFinetuneConfig
    from geofm.tasks import TASKS

    folder = Path(__file__).parents[1] / "configs/federated"
    for name, kind in (
        ("demo_dino_fedavg_swin_micro__3inst.yaml", "pretraining"),
        ("demo_fedsense_swin_micro__3inst__1bit_ef.yaml", "pretraining"),
        ("demo_fedavg_classification__swin_micro__3clients.yaml", "finetuning"),
    ):
        tree = read_config_tree(folder / name)
        assert TASKS.get(tree.get("task", "mim")).kind == kind, name
        cfg = read_federated_config(tree, name)
        assert isinstance(cfg, FederatedFinetuneConfig) == (kind == "finetuning"), name
