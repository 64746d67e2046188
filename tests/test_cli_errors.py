"""Bad inputs reach the user as one ``geofm: error:`` line naming what is wrong, never as a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from geofm.cli import main
from geofm.config import PretrainConfig
from geofm.data.pile import PretrainPile, shown_samples
from geofm.data.writers import write_geotiff
from geofm.tasks.mim.figures import SHOWN_CHIPS

RGB = ["red", "green", "blue"]
TRANSFORM = (1.0, 0.0, 500_000.0, 0.0, -1.0, 5_000_000.0)
MICRO_SWIN = {
    "arch": "swin_tiny_patch4_window7_224",
    "img_size": 32,
    "window_size": 4,
    "timm_kwargs": {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]},
}
MICRO_VIT = {
    "arch": "vit_small_patch16_224",
    "img_size": 32,
    "timm_kwargs": {"embed_dim": 32, "depth": 4, "num_heads": 2},
}


def _error(capsys, args: list[str]) -> str:
    """What ``geofm ARGS`` prints on stderr: exit status 2, one ``geofm: error:`` line, no traceback."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("geofm: error: ")]) == 1, err
    return err


def _rgb_tifs(folder, count: int, size: int = 32) -> None:
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(1, 255, (3, size, size), dtype=np.uint8)
        write_geotiff(folder / f"scene_{i}.tif", pixels, transform=TRANSFORM, crs=32632)


def _pretrain_config(tmp_path, images: int, model: dict = MICRO_SWIN, teacher: dict | None = None, **train) -> str:
    """A micro Swin (or ``model``) pretraining config on ``images`` 32 px RGB files."""
    _rgb_tifs(tmp_path / "rgb", images)
    tree = {
        "run": {"output_dir": str(tmp_path / "run"), "log_every": 1, "checkpoint_every": 100, "progress": False},
        "model": model,
        "task_options": {"teacher": teacher, "masking": {"mask_patch_size": 16}},
        "data": {
            "bands": RGB,
            "num_workers": 0,
            "sources": [
                {
                    "name": "rgb",
                    "root": str(tmp_path / "rgb"),
                    "pattern": "*.tif",
                    "bands": RGB,
                    "scale": 1 / 255,
                    "mean": [0.5] * 3,
                    "std": [0.2] * 3,
                }
            ],
        },
        "train": {"epochs": 2, "warmup_epochs": 0.5, "base_lr": 1e-3, "lr_reference_batch": 4, **train},
    }
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_a_pile_smaller_than_one_global_batch_names_its_sources_and_the_batch(tmp_path, capsys):
    config = _pretrain_config(tmp_path, images=3, micro_batch_size=2, grad_accum_steps=2)
    err = _error(capsys, ["pretrain", "--config", config])
    assert f"data.sources rgb (3 samples under {tmp_path / 'rgb'})" in err
    assert "an epoch of 3 samples holds no complete global batch of 4 images" in err
    assert "train.micro_batch_size 2 x train.grad_accum_steps 2 x 1 process(es)" in err
    assert not (tmp_path / "run").exists(), "refused before the run directory is created"


@pytest.mark.slow
def test_a_resume_whose_engine_checkpoint_is_gone_names_it(tmp_path, capsys):
    config = _pretrain_config(tmp_path, images=4, micro_batch_size=2)
    assert main(["pretrain", "--config", config, "run.stop_after_steps=1"]) == 0
    last = (tmp_path / "run/checkpoints/last").resolve()
    for states in last.glob("*_states.pt"):
        states.unlink()
    err = _error(capsys, ["pretrain", "--config", config])
    assert f"geofm: error: {last}: no DeepSpeed checkpoint" in err and "choose a new run.output_dir" in err


def _truncate_unshown(config: str) -> dict:
    """Cut short every file of the config's one source but the chips the reconstruction figure shows (read
    before training): the first batch meets a bad file. Returns the cut files' full bytes."""
    cfg = PretrainConfig.from_file(config)
    pile = PretrainPile(cfg.data, cfg.model.img_size)
    shown = {index.file for index in shown_samples(pile.source_sizes, SHOWN_CHIPS, cfg.run.seed)}
    files = [chip.file for chip in pile.sources[0].chips]
    cut = {path: path.read_bytes() for i, path in enumerate(files) if i not in shown}
    for path, data in cut.items():
        path.write_bytes(data[:300])
    return cut


@pytest.mark.slow
def test_a_start_that_fails_at_its_first_batch_leaves_no_run_directory_and_a_run_with_a_checkpoint_keeps_it(
    tmp_path, capsys
):
    config = _pretrain_config(tmp_path, images=8, micro_batch_size=4)
    cut = _truncate_unshown(config)
    assert "cannot read raster" in _error(capsys, ["pretrain", "--config", config])
    assert not (tmp_path / "run").exists()

    for path, data in cut.items():
        path.write_bytes(data)
    assert main(["pretrain", "--config", config, "run.stop_after_steps=1"]) == 0
    _truncate_unshown(config)
    assert "cannot read raster" in _error(capsys, ["pretrain", "--config", config])
    assert (tmp_path / "run/checkpoints/last/progress.json").exists(), "the run keeps its checkpoint"


def test_a_finetuning_train_split_smaller_than_one_global_batch_names_the_dataset(
    tmp_path, capsys, task_tree, torchgeo_layouts
):
    fields = torchgeo_layouts.ucmerced(tmp_path / "ucm", per_split={"train": 1, "val": 1, "test": 1}, size=32)
    data = {"root": str(tmp_path / "ucm"), **fields, "bands": RGB, "mean": [0.5] * 3, "std": [0.2] * 3}
    config = tmp_path / "ucm.yaml"
    config.write_text(yaml.safe_dump(task_tree("classification", data=data)))
    err = _error(capsys, ["finetune", "--config", str(config)])
    assert f"the train split (torchgeo UCMerced(root='{tmp_path / 'ucm'}', split='train'))" in err
    assert "an epoch of 2 samples holds no complete global batch of 4 images" in err


def test_an_empty_torchgeo_split_names_the_class_split_and_root(tmp_path, capsys, monkeypatch, task_tree):
    """torchgeo's Inria class takes the first letters+digits of a file's path as its tile number: with the
    root given as ``inria`` it files ``austin1.tif`` under val (tiles 1-5), leaving train empty."""
    for part in ("images", "gt"):
        folder = tmp_path / "inria/AerialImageDataset/train" / part
        folder.mkdir(parents=True)
        pixels = np.ones((3 if part == "images" else 1, 32, 32), np.uint8)
        write_geotiff(folder / "austin1.tif", pixels, transform=TRANSFORM, crs=32632)
    monkeypatch.chdir(tmp_path)
    data = {
        "torchgeo": "InriaAerialImageLabeling",
        "root": "inria",
        "bands": RGB,
        "dataset_bands": RGB,
        "scale": 1 / 255,
        "mean": [0.5] * 3,
        "std": [0.2] * 3,
        "num_classes": 2,
    }
    config = tmp_path / "inria.yaml"
    config.write_text(yaml.safe_dump(task_tree("segmentation", data=data)))
    err = _error(capsys, ["finetune", "--config", str(config)])
    root = tmp_path / "inria"
    assert (
        f"geofm: error: the train split (torchgeo InriaAerialImageLabeling(root='{root}', split='train')) holds no sample"
        in err
    )
    err = _error(capsys, ["finetune", "--config", str(config), "data.train_fraction=0.5"])
    assert "split='train')): no sample to draw a data.train_fraction 0.5 subset from" in err


def test_a_vit_tap_beyond_the_depth_is_a_config_error(tmp_path, capsys):
    student = _pretrain_config(tmp_path, images=4, model={**MICRO_VIT, "distill_block": 9}, micro_batch_size=2)
    err = _error(capsys, ["pretrain", "--config", student])
    assert "  config: model.distill_block 9 does not exist in vit_small_patch16_224 (4 blocks)" in err
    teacher = {**MICRO_VIT, "checkpoint": str(tmp_path / "teacher.pth"), "block": 5}
    config = _pretrain_config(tmp_path, images=4, model=MICRO_VIT, teacher=teacher, micro_batch_size=2)
    err = _error(capsys, ["pretrain", "--config", config])
    assert "  task_options.teacher: block 5 does not exist in vit_small_patch16_224 (4 blocks)" in err


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--max-files", "0"], "geofm: error: max_files (--max-files) must be positive, got 0"),
        (["--nodata", "0"], "have no valid pixel (all nodata or not finite) in the 1 files read from {rgb}"),
    ],
)
def test_band_statistics_the_files_cannot_give(tmp_path, capsys, args, expected):
    folder = tmp_path / "rgb"
    write_geotiff(folder / "zeros.tif", np.zeros((3, 8, 8), np.uint8), transform=TRANSFORM, crs=32632)
    err = _error(capsys, ["data", "stats", str(folder), "--bands", *RGB, *args])
    assert expected.format(rgb=folder) in err


def test_band_statistics_take_only_band_names_a_config_takes(tmp_path, capsys):
    folder = tmp_path / "rgb"
    write_geotiff(folder / "ones.tif", np.ones((3, 8, 8), np.uint8), transform=TRANSFORM, crs=32632)
    err = _error(capsys, ["data", "stats", str(folder), "--bands", "red", "green", "nri"])
    assert "geofm: error: --bands: unknown band 'nri': did you mean nir?" in err
    assert "declare them with --custom-bands" in err


def test_an_unknown_benchmark_setting(capsys):
    assert "geofm: error: unknown setting 'bitz'; this benchmark has bits" in _error(
        capsys, ["bench", "codec", "bitz=1"]
    )


FEDERATED_DEMO = Path(__file__).parents[1] / "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml"


def _output_commands(tmp_path, task_tree, blocked: Path) -> dict[str, tuple[list[str], str]]:
    """Each command that writes, with its output at ``blocked``: its args and the option it names."""
    finetune = tmp_path / "finetune.yaml"
    finetune.write_text(yaml.safe_dump(task_tree("classification")))
    pretrain = _pretrain_config(tmp_path, images=4, micro_batch_size=2)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump({"config": str(FEDERATED_DEMO), "output_dir": str(blocked), "algorithms": {"fedavg": {}}})
    )
    output_dir = f"run.output_dir={blocked}"
    return {
        "pretrain": (["pretrain", "--config", pretrain, output_dir], "run.output_dir"),
        "finetune": (["finetune", "--config", str(finetune), output_dir], "run.output_dir"),
        "fed simulate": (["fed", "simulate", "--config", str(FEDERATED_DEMO), output_dir], "run.output_dir"),
        "fed certs": (
            ["fed", "certs", "--deployment", str(blocked), "--institutions", "a,b", "--host", "h"],
            "--deployment",
        ),
        "fed sweep": (["fed", "sweep", "--config", str(sweep)], f"{sweep}: output_dir"),
        "predict": (["predict", "--model", "run", "--input", "a.tif", "--output", f"{blocked}.tif"], "--output"),
        "demo-data": (["demo-data", "--out", str(blocked)], "--out"),
        "data prepare": (
            ["data", "prepare", "--config", pretrain, "--source", "rgb", "--chip-size", "32", "--out", str(blocked)],
            "--out",
        ),
        "data bigearthnet-metadata": (["data", "bigearthnet-metadata", "ben", "--out", f"{blocked}.csv"], "--out"),
        "checkpoint convert": (["checkpoint", "convert", "weights.pth", str(blocked)], "dst"),
        "eval": (["eval", "--config", str(finetune), "--out", f"{blocked}.json", "checkpoint=run"], "--out"),
        "report": (["report", "a.json", "--baseline", "b.json", "--out", str(blocked)], "--out"),
        "bench": (["bench", "codec", "--out", f"{blocked}.json"], "--out"),
        "bench work_dir": (["bench", "fed-benefit", f"work_dir={blocked}"], "work_dir"),
    }


COMMANDS = [
    "pretrain",
    "finetune",
    "fed simulate",
    "fed certs",
    "fed sweep",
    "predict",
    "demo-data",
    "data prepare",
    "data bigearthnet-metadata",
    "checkpoint convert",
    "eval",
    "report",
    "bench",
    "bench work_dir",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_below_a_file_is_refused_before_anything_is_built(tmp_path, capsys, task_tree, command):
    (tmp_path / "afile").write_text("")
    args, option = _output_commands(tmp_path, task_tree, tmp_path / "afile" / "out")[command]
    err = _error(capsys, args)
    assert f"geofm: error: {option} {tmp_path / 'afile' / 'out'}" in err
    assert f"cannot be written: {tmp_path / 'afile'} is a file, not a folder; choose another path" in err


@pytest.fixture
def refused(tmp_path, monkeypatch) -> Path:
    """A folder that refuses new files, as /sys or a read-only mount does even to root (whom ``os.access``
    tells yes): its write probe fails."""
    import tempfile

    folder = tmp_path / "refused"
    folder.mkdir()
    probe = tempfile.NamedTemporaryFile

    def refusing(*args, **kwargs):
        if Path(kwargs.get("dir", "")) == folder:
            raise PermissionError(1, "Operation not permitted", str(folder / ".probe"))
        return probe(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refusing)
    return folder


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_in_a_folder_that_refuses_writes_is_refused_before_anything_is_built(
    tmp_path, capsys, task_tree, refused, command
):
    args, option = _output_commands(tmp_path, task_tree, refused / "out")[command]
    err = _error(capsys, args)
    assert f"geofm: error: {option} {refused / 'out'}" in err
    assert f"cannot be written: {refused} is not writable (Operation not permitted); choose another path" in err
    assert not (refused / "out").exists()


def test_a_write_refused_during_a_run_names_the_option_and_path(tmp_path, capsys, monkeypatch):
    """A store's shard that cannot be written (a full disk) once prepare has started; a library naming the
    path only in its message (rasterio) is recognised too."""
    import geofm.data.prepare

    out = tmp_path / "store"
    shard = out / "00000.pixels.npy.tmp"
    args = ["data", "prepare", "--config", _pretrain_config(tmp_path, images=1), "--source", "rgb"]
    args += ["--chip-size", "32", "--out", str(out), "--no-progress"]
    elsewhere = OSError(5, "Input/output error", "/elsewhere")  # not an output: a traceback, as any bug's
    for error in (
        OSError(28, "No space left on device", str(shard)),
        OSError(f"Attempt to create new tiff file '{out}.tmp' failed: Permission denied"),
        elsewhere,
    ):

        def failing(*_, error=error, **__):
            raise error

        monkeypatch.setattr(geofm.data.prepare, "prepare_store", failing)
        if error is elsewhere:
            with pytest.raises(OSError, match="Input/output error"):
                main(args)
            continue
        err = _error(capsys, args)
        if error.filename:
            assert err == (
                f"geofm: error: --out {out} cannot be written ({shard}): No space left on device; choose another path\n"
            )
        else:
            assert err.startswith(f"geofm: error: --out {out} cannot be written: Attempt to create new tiff file")


def test_an_override_typo_is_named_by_every_command_that_reads_a_config(tmp_path, capsys, task_tree):
    finetune = tmp_path / "finetune.yaml"
    finetune.write_text(yaml.safe_dump(task_tree("classification")))
    for config, args in (
        (FEDERATED_DEMO, ["fed", "simulate", "--config", str(FEDERATED_DEMO), "federation.roundz=3"]),
        (finetune, ["eval", "--config", str(finetune), "checkpoint=run", "train.epochz=3"]),
    ):
        err = _error(capsys, args)
        assert f"geofm: error: the overrides of {config} are invalid\n  override {args[-1]}: unknown key" in err
