import json
import logging
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file

from geofm.config import PretrainConfig
from geofm.errors import CheckpointFormatError, ConfigError
from geofm.tasks.mim.figures import SHOWN_CHIPS, figure_size
from pretrain.central import pretrain

pytestmark = pytest.mark.slow


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_gfm_run_end_to_end(tiny_tree, caplog):
    tree = tiny_tree()
    with caplog.at_level("INFO", logger="geofm.pretrain"):
        run_dir = pretrain(PretrainConfig.from_tree(tree))
    startup = [r.startup for r in caplog.records if hasattr(r, "startup")]
    assert len(startup) == 1, "the start-up phases are logged once, with the first step"
    assert list(startup[0]) == [
        "inputs",
        "distributed",
        "model",
        "data_index",
        "prepare",
        "engine",
        "first_batch",
        "first_step",
    ]
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert set(records[0]) >= {"step", "loss", "loss_mim", "loss_distill", "lr", "images_per_s"}
    assert records[-1]["loss_distill"] < records[0]["loss_distill"] < 0.5, "the distillation term is active"
    assert (run_dir / "loss_curve.png").stat().st_size > 0
    with Image.open(run_dir / "reconstruction.png") as png:  # 4 chips of 32 px: one row each
        width, height = figure_size(SHOWN_CHIPS, 32, 32)
        assert png.format == "PNG" and png.size == (round(width * 120), round(height * 120))
    assert (run_dir / "checkpoints/last").resolve().name == "step_0000012"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_0000008", "step_0000012"]

    sidecar = json.loads((run_dir / "backbone.json").read_text())
    assert sidecar["arch"] == "swin_tiny_patch4_window7_224" and sidecar["bands"] == ["red", "green", "blue", "nir"]
    state = load_file(run_dir / "backbone.safetensors")
    assert not any(k.startswith(("mask_token", "decoder", "projector", "teacher")) for k in state)
    model = timm.create_model(sidecar["arch"], pretrained=False, **sidecar["timm_kwargs"])
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_teacher_never_changes_and_gets_no_optimizer_state(tiny_tree):
    from geofm.tasks.mim.masking import MaskGenerator
    from geofm.tasks.mim.task import build_student, mim_options
    from geofm.tasks.mim.teacher_from_checkpoint import build_teacher
    from geofm.training import engine as ds

    cfg = PretrainConfig.from_tree(tiny_tree())
    teacher = build_teacher(mim_options(cfg).teacher, cfg.data.teacher_band_indices)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    model = build_student(cfg)
    schedule = ds.make_schedule(cfg.train, 24, 1)
    engine = ds.initialize(model, cfg.train, 1, schedule)
    masks = MaskGenerator(32, 8, 4, 0.6)
    for _ in range(3):
        images = torch.randn(4, 4, 32, 32)
        losses = engine(images, torch.stack([masks() for _ in range(4)]), None, teacher(images))
        engine.backward(losses["loss"])
        engine.step()
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    optimized = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in optimized for p in teacher.parameters())
    assert all(p.grad is None for p in teacher.parameters())
    assert model.projector.weight.abs().sum() > 0


def test_plain_simmim_without_teacher(tiny_tree):
    run_dir = pretrain(PretrainConfig.from_tree(tiny_tree(teacher=None, train={"epochs": 1})))
    assert all(r["loss_distill"] == 0 for r in _metrics(run_dir))
    assert json.loads((run_dir / "backbone.json").read_text())["method"] == "simmim"


def test_resume_gives_the_same_result_as_an_uninterrupted_run(tiny_tree):
    straight = pretrain(PretrainConfig.from_tree(tiny_tree("straight")))
    first = pretrain(PretrainConfig.from_tree(tiny_tree("resumed", run={"stop_after_steps": 5})))
    assert _metrics(first)[-1]["step"] == 5 and not (first / "backbone.safetensors").exists()
    resumed = pretrain(PretrainConfig.from_tree(tiny_tree("resumed")))
    a, b = _metrics(straight), _metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 13))
    for ra, rb in zip(a, b, strict=False):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-6), ra["step"]
    wa, wb = load_file(straight / "backbone.safetensors"), load_file(resumed / "backbone.safetensors")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_killed_run_resumes_from_last_checkpoint(tiny_tree, killed_then_resumed):
    # 240 steps: the run cannot end before the kill that follows its first checkpoint, however fast
    killed_then_resumed(tiny_tree("killed", train={"epochs": 40}), more=6)


def test_sigterm_saves_the_step_reached(tiny_tree, write_config, child_env, wait_for, tmp_path):
    """A scheduler's SIGTERM ends the run with a checkpoint at the step it reached: nothing is lost."""
    # 240 steps: the run cannot end before the signal that follows its third logged step
    tree = tiny_tree("terminated", train={"epochs": 40}, run={"checkpoint_every": 1000})
    config = write_config(tree, tmp_path / "terminated.yaml")
    cmd = [sys.executable, "-m", "geofm.cli", "pretrain", "--config", str(config)]
    proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = Path(tree["run"]["output_dir"]) / "metrics.jsonl"
    wait_for(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, "logging 3 steps")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate()
    assert proc.returncode == 2 and "saved a checkpoint" in stderr, stderr[-3000:]
    last = Path(tree["run"]["output_dir"]) / "checkpoints/last"
    assert int(last.resolve().name.split("_")[1]) == _metrics(Path(tree["run"]["output_dir"]))[-1]["step"] >= 3


def test_resuming_with_another_model_is_refused(tiny_tree):
    pretrain(PretrainConfig.from_tree(tiny_tree("changed", run={"stop_after_steps": 1})))
    with pytest.raises(ConfigError, match="another model"):
        pretrain(PretrainConfig.from_tree(tiny_tree("changed", model={"window_size": 2})))


def test_every_missing_input_is_reported_at_once_and_no_run_directory_is_left(tiny_tree, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    tree = tiny_tree(teacher={"checkpoint": "weights/missing.pth"}, model={"init_checkpoint": "weights/init.pth"})
    tree["data"]["sources"][0]["root"] = "data/nowhere"
    tree["data"]["sources"][1]["root"] = str(empty)
    with pytest.raises(ConfigError) as info:
        pretrain(PretrainConfig.from_tree(tree), source="my.yaml")
    message = str(info.value)
    assert message.startswith("my.yaml: 4 input(s) cannot be read"), message
    for expected in (
        f"data.sources.0.root (aerial_rgb): image folder {tmp_path / 'data/nowhere'} does not exist",
        f"data.sources.1.root (satellite_4band): no file in {empty} matches",
        f"task_options.teacher.checkpoint: checkpoint not found: {tmp_path / 'weights/missing.pth'}",
        f"model.init_checkpoint: checkpoint not found: {tmp_path / 'weights/init.pth'}",
    ):
        assert expected in message, f"missing {expected!r} in:\n{message}"
    assert not Path(tree["run"]["output_dir"]).exists(), "a failed start leaves no run directory"


def test_a_failed_build_leaves_no_run_directory(tiny_tree, tmp_path):
    broken = tmp_path / "teacher.pth"
    broken.write_bytes(b"\x00not a checkpoint at all")
    tree = tiny_tree(teacher={"checkpoint": str(broken)})
    with pytest.raises(CheckpointFormatError, match="not a torch checkpoint"):
        pretrain(PretrainConfig.from_tree(tree))
    assert not Path(tree["run"]["output_dir"]).exists()


def test_corrupt_geotiff_errors_or_is_skipped_counted_and_warned_of_once(
    tiny_tree, archive, write_config, child_env, tmp_path, caplog
):
    import shutil

    folder = tmp_path / "aerial_with_bad_file"
    shutil.copytree(archive["aerial_rgb"], folder)
    bad = sorted(folder.glob("*.tif"))[0]
    bad.write_bytes(bad.read_bytes()[:300])  # truncated
    tree = tiny_tree("bad", train={"epochs": 1}, data={"num_workers": 1})
    tree["data"]["sources"][0]["root"] = str(folder)
    tree["data"]["sources"][0]["weight"] = 10.0
    done = subprocess.run(
        [sys.executable, "-m", "geofm.cli", "pretrain", "--config", str(write_config(tree, tmp_path / "bad.yaml"))],
        check=False,
        env=child_env,
        capture_output=True,
        text=True,
    )
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and errors == [
        f"geofm: error: {bad}: cannot read raster: Read failed. ({bad.name}, "
        "band 1: IReadBlock failed at X offset 0, Y offset 0: TIFFReadEncodedStrip() failed.)"
    ], done.stderr[-3000:]
    assert "DataLoader worker" not in done.stderr and "Traceback" not in done.stderr

    tree["run"]["output_dir"] = str(tmp_path / "skip")
    tree["data"]["on_bad_file"] = "skip"
    tree["train"]["epochs"] = 3  # every epoch walks all aerial files again: the bad one is met each epoch
    with caplog.at_level(logging.WARNING, logger="geofm.data"):
        run_dir = pretrain(PretrainConfig.from_tree(tree))
    skipped = [r["skipped_files"] for r in _metrics(run_dir)]
    assert skipped[-1] == 1, f"the one bad file is counted once however often it is drawn: {skipped}"
    warnings = [message for message in caplog.messages if str(bad) in message]
    assert len(warnings) == 1 and warnings[0].startswith(f"source 'aerial_rgb': skipping {bad}: "), warnings


def test_bf16_path_runs_on_cpu_and_exports_float32(tiny_tree):
    """The GPU precision path (bf16 engine, bf16 teacher) exercised on the CPU accelerator."""
    run_dir = pretrain(PretrainConfig.from_tree(tiny_tree("bf16", train={"epochs": 1, "precision": "bf16"})))
    saved = torch.load(run_dir / "checkpoints/last/mp_rank_00_model_states.pt", weights_only=False)
    assert saved["module"]["encoder.patch_embed.proj.weight"].dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in load_file(run_dir / "backbone.safetensors").values())
    fp32 = pretrain(PretrainConfig.from_tree(tiny_tree("fp32", train={"epochs": 1})))
    bf16_losses, fp32_losses = ([r["loss"] for r in _metrics(d)] for d in (run_dir, fp32))
    assert all(math.isfinite(loss) for loss in bf16_losses)
    # the same seed and data: bf16 follows the fp32 run's losses within bf16's precision
    assert bf16_losses == pytest.approx(fp32_losses, rel=0.05)


def test_vit_student_with_swin_teacher(tiny_tree):
    """A ViT student tapped at 3/4 depth distils a Swin teacher's stage-3 features."""
    vit = {
        "arch": "vit_small_patch16_224",
        "window_size": None,
        "timm_kwargs": {"embed_dim": 32, "depth": 4, "num_heads": 2},
    }
    tree = tiny_tree("vit", model=vit, masking={"mask_patch_size": 16}, train={"epochs": 1})
    run_dir = pretrain(PretrainConfig.from_tree(tree))
    records = _metrics(run_dir)
    assert len(records) == 6 and all(r["loss_distill"] != 0 for r in records)
    sidecar = json.loads((run_dir / "backbone.json").read_text())
    model = timm.create_model(sidecar["arch"], pretrained=False, **sidecar["timm_kwargs"])
    assert not model.load_state_dict(load_file(run_dir / "backbone.safetensors")).missing_keys


def test_student_starts_from_an_rgb_export_with_kernels_following_band_names(tiny_tree):
    """Continual pretraining from earlier weights: RGB kernels go to red, green, blue; nir starts fresh."""
    from geofm.tasks.mim.task import build_student

    rgb_run = pretrain(
        PretrainConfig.from_tree(
            tiny_tree("rgb", teacher=None, train={"epochs": 1}, data={"bands": ["blue", "green", "red"]})
        )
    )
    exported = load_file(rgb_run / "backbone.safetensors")["patch_embed.proj.weight"]
    tree = tiny_tree(model={"init_checkpoint": str(rgb_run)})
    torch.manual_seed(0)
    student = build_student(PretrainConfig.from_tree(tree))
    kernel = student.encoder.patch_embed.proj.weight.detach()
    assert torch.equal(kernel[:, [0, 1, 2]], exported[:, [2, 1, 0]])  # model bands red, green, blue, nir
    assert not torch.equal(kernel[:, 3], torch.zeros_like(kernel[:, 3]))
    block = "layers.1.blocks.0.attn.qkv.weight"
    assert torch.equal(student.encoder.state_dict()[block], load_file(rgb_run / "backbone.safetensors")[block])


def test_pretraining_on_per_band_products_passes_over_cloudy_chips_and_counts_them(tiny_tree, tmp_path):
    """A SimMIM run on a folder of Sentinel-2 band files (10 m bands, a 20 m SCL) cut into 32 px chips, one cloudy."""
    import numpy as np

    from geofm.data.writers import write_geotiff

    folder = tmp_path / "bands"
    rng = np.random.default_rng(0)
    for band_id in ("B02", "B03", "B04", "B08"):
        dn = rng.integers(500, 4000, (1, 64, 64)).astype(np.uint16)
        write_geotiff(folder / f"T32TQM_{band_id}.tif", dn, transform=(10, 0, 5e5, 0, -10, 5e6), crs="EPSG:32632")
    scl = np.full((1, 32, 32), 4, dtype=np.uint8)
    scl[:, :16, :14] = 9  # the first chip (rows and columns 0-31 at 10 m) is 3/4 cloud
    write_geotiff(folder / "T32TQM_SCL.tif", scl, transform=(20, 0, 5e5, 0, -20, 5e6), crs="EPSG:32632")
    tree = tiny_tree("products", teacher=None, train={"epochs": 1}, data={"samples_per_epoch": 8})
    tree["data"]["sources"] = [
        {
            "name": "sentinel2",
            "root": str(folder),
            "layout": "band_files",
            "options": {"filename_regex": r"(?P<scene>\w+)_(?P<band>\w+)\.tif", "band_ids": "sentinel2"},
            "bands": ["blue", "green", "red", "nir"],
            "scale": 0.0001,
            "mean": [0.2] * 4,
            "std": [0.1] * 4,
            "chip_size": 32,
            "quality": {"band": "SCL", "generation": "sentinel2_scl"},
        }
    ]
    run_dir = pretrain(PretrainConfig.from_tree(tree))
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["skipped_invalid_chips"] == 1 and records[-1]["skipped_files"] == 0
    assert (run_dir / "backbone.safetensors").exists()


def _run_with(tiny_tree, name: str, model: dict, teacher: dict) -> Path:
    """A 2-step central GFM run (8 samples, micro-batch 4)."""
    tree = tiny_tree(name, model=model, teacher=teacher, train={"epochs": 1}, data={"samples_per_epoch": 8})
    run_dir = pretrain(PretrainConfig.from_tree(tree))
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2] and all(r["loss_distill"] != 0 for r in records)
    return run_dir


def test_satlas_swin_v2_is_the_student_and_the_teacher_of_a_central_run(tiny_tree, satlas_file):
    """A Satlas file (torchvision's Swin-v2) starts the student and, unconverted, is the frozen teacher."""
    swinv2 = {"arch": "swinv2_tiny_window8_256", "window_size": 2}

    run_dir = _run_with(
        tiny_tree, "satlas", {**swinv2, "init_checkpoint": str(satlas_file)}, {**swinv2, "checkpoint": str(satlas_file)}
    )

    sidecar = json.loads((run_dir / "backbone.json").read_text())
    assert set(sidecar["releases"]) == {"model.init_checkpoint", "task_options.teacher.checkpoint"}
    assert "ODC-BY-1.0" in (run_dir / "MODEL_CARD.md").read_text()
    model = timm.create_model(sidecar["arch"], pretrained=False, **sidecar["timm_kwargs"])
    assert not model.load_state_dict(load_file(run_dir / "backbone.safetensors")).missing_keys


def test_dofa_starts_a_vit_student_and_its_export_is_the_teacher(tiny_tree, tmp_path):
    """A DOFA file starts a 4-band ViT student (kernels made for red, green, blue, nir) distilling from the RGB
    export of the same file."""
    from torchgeo.models.dofa import DOFA

    from geofm.checkpoints import convert_checkpoint

    torch.manual_seed(0)
    dofa = tmp_path / "dofa.pth"
    torch.save(DOFA(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2).state_dict(), dofa)
    vit = {"embed_dim": 32, "depth": 4, "num_heads": 2, "patch_size": 8, "global_pool": "avg"}
    export = tmp_path / "dofa_rgb"
    convert_checkpoint(dofa, export, bands=["red", "green", "blue"], timm_kwargs={"num_heads": 2})
    arch = {"arch": "vit_small_patch16_224", "window_size": None, "timm_kwargs": vit}

    run_dir = _run_with(
        tiny_tree, "dofa", {**arch, "init_checkpoint": str(dofa)}, {**arch, "checkpoint": str(export), "block": 3}
    )

    sidecar = json.loads((run_dir / "backbone.json").read_text())
    assert sidecar["releases"]["model.init_checkpoint"]["licence"] == "CC-BY-4.0"
    assert sidecar["releases"]["task_options.teacher.checkpoint"]["name"] == "DOFA"
