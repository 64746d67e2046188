"""The GPU device check: its dry run on the CPU where the engine libraries are absent, its budgets and its pieces.

Benchmarks measure and never gate: nothing here looks at a timing, only at what ran and what was written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.common import run_child
from benchmarks.device_check import ENGINE_LIBRARIES, REQUIREMENTS, loader_section, missing_requirements, settings_of
from benchmarks.device_step import StepShape, make_step
from geofm.errors import ConfigError

REPO = Path(__file__).parents[2]
CONFIGS = [
    "configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml",
    "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml",
]
# Put first on a child's path, this makes the libraries a GPU machine lacks fail to import, as they would there.
ABSENT = f"""
import importlib.abc
import sys


class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {set(ENGINE_LIBRARIES)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)")


sys.meta_path.insert(0, Absent())
"""


@pytest.mark.slow
def test_the_dry_run_runs_every_section_without_the_engine_libraries(tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ABSENT)
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OUT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.device_check", "--dry-run", "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "device_check.json").read_text())
    results = record["results"]
    assert results["card"] == "cpu" and results["environment"]["engine_libraries_imported"] == []
    assert results["setup"]["status"] == "ok"
    assert set(results["steps"]) == {"plain_bf16", "geofm_bf16", "geofm_bf16_compiled"}
    for variant, step in results["steps"].items():
        assert step["status"] == "ok", f"{variant}: {step.get('output')}"
        assert step["images_per_s"] > 0 and step["flops"] > 0 and step["peak_mib"] > 0
    plain, geofm = results["steps"]["plain_bf16"], results["steps"]["geofm_bf16"]
    assert geofm["fused_attention"] and not plain["fused_attention"] and plain["teacher_dtype"] == "bfloat16"
    loader = results["loader"]
    assert loader["status"] == "ok", loader
    assert [row["workers"] for row in loader["workers"]] == [1] and loader["workers"][0]["chips_per_s"] > 0
    tests = results["tests"]
    assert tests["status"] == "ok" and "tests/models/test_cuda.py" in tests["files"], tests
    assert tests.get("skipped", 0) >= 1 and "failed" not in tests, "without CUDA the tests marked cuda are skipped"
    assert "skipped" in (out / "cuda_tests.txt").read_text()
    summary = (out / "device_check.md").read_text()
    assert summary.startswith("# geofm device check: cpu") and "| geofm_bf16_compiled | cpu | ok |" in summary
    assert summary in proc.stdout, "the Markdown summary is printed too"


@pytest.mark.slow
def test_the_loader_section_times_a_chip_store_with_each_worker_count():
    settings = {**settings_of(True, "{}"), "loader_workers": [0, 1]}
    result = loader_section(settings, budget=600, step_rate=100.0)
    assert result["status"] == "ok", result.get("output")
    assert {k: result["store"][k] for k in ("chips", "bands", "size")} == {"chips": 16, "bands": 4, "size": 64}
    assert [row["workers"] for row in result["workers"]] == [0, 1]
    for row in result["workers"]:
        assert row["chips_per_s"] > 0 and row["over_step"] == pytest.approx(row["chips_per_s"] / 100.0)


@pytest.mark.slow
def test_a_section_past_its_budget_is_stopped_and_keeps_what_it_printed():
    wait = "import json, time; print(json.dumps({'event': 'built'}), flush=True); time.sleep(600)"
    child = run_child([sys.executable, "-S", "-c", wait], budget_s=5)
    assert child.status == "timed out" and child.events("built") == [{"event": "built"}]


@pytest.mark.slow
def test_a_check_stopped_by_timeout_stops_the_section_it_was_running(tmp_path):
    pid_file = tmp_path / "section.pid"
    section = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(600)"
    check = (
        "import sys; from benchmarks.common import exit_on_sigterm, run_child; exit_on_sigterm(); "
        f"run_child([sys.executable, '-S', '-c', {section!r}], budget_s=600)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", check], cwd=REPO, env=env)
    while not (pid_file.exists() and pid_file.read_text()):  # the section has started
        assert process.poll() is None, "the check ended before its section started"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait() == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.slow
def test_a_failed_section_says_so_with_its_output():
    child = run_child([sys.executable, "-S", "-c", "raise SystemExit('no kernel image')"], budget_s=60)
    assert child.status == "failed" and "no kernel image" in child.output


@pytest.mark.parametrize("config", CONFIGS)
def test_the_step_shape_read_from_the_file_is_what_the_validated_config_says(config):
    from geofm.config import PretrainConfig
    from geofm.tasks.mim.task import mim_options

    cfg = PretrainConfig.from_file(REPO / config)
    shape = StepShape.from_file(config)
    m, t, masking = cfg.model, mim_options(cfg).teacher, mim_options(cfg).masking
    assert shape.student == {
        "arch": m.arch,
        "img_size": m.img_size,
        "window_size": m.window_size,
        "timm_kwargs": m.timm_kwargs,
        **({"drop_path_rate": m.drop_path_rate} if "drop_path_rate" in shape.student else {}),
    }
    for name in ("arch", "img_size", "window_size", "timm_kwargs", "stage", "include_merging"):
        assert shape.teacher[name] == getattr(t, name), name
    assert all(shape.teacher[name] == getattr(t, name) for name in shape.teacher)
    assert shape.bands == cfg.data.bands and shape.micro_batch == cfg.train.micro_batch_size
    assert (shape.mask_patch_size, shape.mask_ratio) == (masking.mask_patch_size, masking.mask_ratio)


def test_the_plain_step_trains_the_student_the_config_describes(one_torch_thread):
    step = make_step("geofm_bf16", StepShape.from_file(CONFIGS[1], micro_batch=2), torch.device("cpu"))
    before = [p.detach().clone() for p in step.model.parameters()]
    step()
    assert step.model.encoder.patch_embed.proj.in_channels == 4 and step.batch["image"].shape == (2, 4, 64, 64)
    assert any(not torch.equal(a, b) for a, b in zip(before, step.model.parameters(), strict=True))


def test_a_config_without_what_the_step_needs_is_named(tmp_path):
    config = tmp_path / "simmim.yaml"
    config.write_text("model: {arch: swin_tiny_patch4_window7_224, img_size: 64, window_size: 4}\n")
    with pytest.raises(ConfigError, match=r"simmim\.yaml: task_options\.teacher\.arch is missing"):
        StepShape.from_file(config)


def test_settings_take_a_json_object_of_known_keys():
    assert settings_of(True, '{"steps": 5}')["steps"] == 5
    with pytest.raises(ConfigError, match="unknown stepz"):
        settings_of(False, '{"stepz": 5}')
    with pytest.raises(ConfigError, match="not a JSON object"):
        settings_of(False, "steps=5")


def test_only_missing_requirements_are_installed_and_pytest_is_pinned_as_the_lock_pins_it():
    assert missing_requirements(["pytest==0.1", "geofm-surely-absent==1.0"]) == ["geofm-surely-absent==1.0"]
    locked = set((REPO / "requirements.lock").read_text().splitlines())
    pins = set(re.findall(r"^(pytest\S*==\S+)$", REQUIREMENTS.read_text(), re.MULTILINE))
    assert pins and pins <= locked
