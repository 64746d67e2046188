"""Resuming: only safe files are unpickled, and a resume never silently changes the run."""

import json
from pathlib import Path

import pytest
import torch

from geofm.config import PretrainConfig
from geofm.errors import CheckpointFormatError, ConfigError
from pretrain.central import pretrain

pytestmark = pytest.mark.slow


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: a stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_checkpoint_file_is_refused_on_resume_without_running_it(tiny_tree, tmp_path):
    tree = tiny_tree("crafted", run={"stop_after_steps": 2})
    run_dir = pretrain(PretrainConfig.from_tree(tree))
    states = run_dir / "checkpoints/last/mp_rank_00_model_states.pt"
    marker = tmp_path / "payload_ran"
    saved = torch.load(states, weights_only=True)
    saved["payload"] = _Payload(marker)
    torch.save(saved, states)

    with pytest.raises(
        CheckpointFormatError,
        match=r"mp_rank_00_model_states\.pt: refused to unpickle (_?io|builtins)\.open",  # _io.open on Python 3.12
    ):
        pretrain(PretrainConfig.from_tree(tiny_tree("crafted")))
    assert not marker.exists(), "nothing from the crafted file ran"


def test_resuming_with_another_global_batch_is_refused_with_the_way_out(tiny_tree):
    pretrain(PretrainConfig.from_tree(tiny_tree("batch", run={"stop_after_steps": 3})))
    with pytest.raises(ConfigError) as info:
        pretrain(PretrainConfig.from_tree(tiny_tree("batch", train={"micro_batch_size": 2})))
    message = str(info.value)
    assert "with 4 images per optimizer step (1 process(es)); now 2" in message
    assert "train.micro_batch_size=4 train.grad_accum_steps=1" in message
    # The same global batch through accumulation continues the same schedule.
    run_dir = pretrain(
        PretrainConfig.from_tree(tiny_tree("batch", train={"micro_batch_size": 2, "grad_accum_steps": 2}))
    )
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, 13))


def test_changing_the_schedule_of_an_unfinished_run_is_refused(tiny_tree):
    pretrain(PretrainConfig.from_tree(tiny_tree("schedule", run={"stop_after_steps": 3})))
    with pytest.raises(
        ConfigError, match=r"another learning-rate schedule \(train\.epochs 2 -> 3\).*restore the setting"
    ):
        pretrain(PretrainConfig.from_tree(tiny_tree("schedule", train={"epochs": 3})))
    with pytest.raises(ConfigError, match=r"--extend trains a finished run.*at step 3 of 12"):
        pretrain(PretrainConfig.from_tree(tiny_tree("schedule", train={"epochs": 3})), extend=True)


def test_a_finished_run_is_extended_only_explicitly(tiny_tree):
    run_dir = pretrain(PretrainConfig.from_tree(tiny_tree("extend")))
    finished = _metrics(run_dir)
    assert finished[-1]["step"] == 12 and json.loads((run_dir / "backbone.json").read_text())["steps"] == 12
    with pytest.raises(ConfigError, match=r"train\.epochs 2 -> 3.*rerun with --extend"):
        pretrain(PretrainConfig.from_tree(tiny_tree("extend", train={"epochs": 3})))
    with pytest.raises(ConfigError, match=r"--extend needs a larger train.epochs"):
        pretrain(PretrainConfig.from_tree(tiny_tree("extend", train={"base_lr": 1e-3})), extend=True)

    pretrain(PretrainConfig.from_tree(tiny_tree("extend", train={"epochs": 3})), extend=True)
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 19))
    assert records[:12] == finished, "the first 12 steps are kept as they were"
    assert records[12]["lr"] > finished[-1]["lr"], "the lr follows the cosine re-planned over 3 epochs"
    sidecar = json.loads((run_dir / "backbone.json").read_text())
    assert sidecar["steps"] == 18 and sidecar["config"]["train"]["epochs"] == 3


def test_the_export_reports_the_mean_of_the_last_epoch(tiny_tree):
    run_dir = pretrain(PretrainConfig.from_tree(tiny_tree("card", train={"epochs": 2})))
    records = _metrics(run_dir)[6:]
    metrics = json.loads((run_dir / "backbone.json").read_text())["metrics"]
    assert metrics["loss"] == pytest.approx(sum(r["loss"] for r in records) / 6, abs=1e-6)
    assert metrics["averaged_over"] == "steps 7-12 (the last epoch, 6 logged intervals)"
    assert "steps 7-12 (the last epoch" in (run_dir / "MODEL_CARD.md").read_text()


def test_a_run_saved_before_task_options_resumes_and_its_checkpoint_loads_for_finetuning(
    tiny_tree, config_saved_before_task_options, archive, teacher_file
):
    """A GFM run whose config.yaml holds top-level masking and teacher, as geofm saved it then, resumes
    with today's config and is read as a GFM checkpoint where finetuning starts from it."""
    from geofm.checkpoints import load_backbone_for_bands
    from geofm.checkpoints.facts import read_checkpoint
    from geofm.checkpoints.provenance import provenance
    from geofm.models.backbones import create_backbone
    from geofm.tasks.pretraining import student_kwargs

    cfg = PretrainConfig.from_tree(tiny_tree("old", run={"stop_after_steps": 4}))
    run_dir = pretrain(cfg)
    paths = {"TEACHER": teacher_file, **archive}
    config_saved_before_task_options("gfm", run_dir, **paths)

    facts = read_checkpoint(run_dir)
    assert facts.source.layout == "geofm_train" and provenance(facts)["method"] == "gfm"
    assert provenance(facts)["teacher"] == {"arch": "swin_tiny_patch4_window7_224", "checkpoint": str(teacher_file)}
    encoder = create_backbone(cfg.model.arch, student_kwargs(cfg))
    report = load_backbone_for_bands(encoder, run_dir, cfg.data.bands)
    assert not report.missing, "every backbone weight loads for finetuning"

    resumed = pretrain(PretrainConfig.from_tree(tiny_tree("old")))
    assert [r["step"] for r in _metrics(resumed) if "loss" in r] == list(range(1, 13)), "continued from step 4"
