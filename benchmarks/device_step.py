"""The GFM step of the GPU device check, in plain PyTorch: no DeepSpeed, no config schema.

The device check (:mod:`benchmarks.device_check`) runs where only torch, timm, einops,
safetensors and numpy are installed, so its step is built from geofm's model code directly
(:mod:`geofm.models`, :mod:`geofm.tasks.mim.loss`) and the shape is read from a pretraining config
file without validating it. Every variant starts from the same seeded random weights (a step's
speed does not depend on what the weights learnt) and runs its forward passes under bf16 autocast:

* ``plain_bf16``: :class:`benchmarks.gfm_step.PlainStep` as its ``eager_fp32`` variant builds
  it (explicit attention, torch's default AdamW), in bf16 autocast;
* ``geofm_bf16``: geofm's choices on a GPU: fused attention (``scaled_dot_product_attention``), the
  teacher's weights in ``task_options.teacher.precision: auto`` (bf16 where native), fused AdamW;
* ``geofm_bf16_compiled``: the same with the student compiled, as ``train.compile`` does.

The teacher computes in bf16 in every variant: geofm's teacher computes in its weights' dtype, so
fp32 weights would keep it in fp32 under autocast too, and the comparison would not be fair.
DeepSpeed's bf16 engine (bf16 weights with an fp32 master copy) is not installed there; autocast
over fp32 weights runs the same matrix products in bf16.

``python -m benchmarks.device_step VARIANT SETTINGS_JSON`` runs one variant and prints one JSON
record per line as it goes (``built``, ``flops``, each ``warmup`` and ``step``, ``syncs``,
``memory``, ``done``), so that the device check keeps what was measured when it stops a variant
at its time budget.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import current_rss_mib, emit, peak_rss_mib, repo_path, synchronizer
from benchmarks.gfm_step import PlainStep, count_flops, host_syncs, random_batch
from geofm.errors import ConfigError

VARIANTS: dict[str, dict[str, Any]] = {
    "plain_bf16": {"fused_attention": False, "teacher_precision": "bf16", "fused_adamw": False, "compiled": False},
    "geofm_bf16": {"fused_attention": True, "teacher_precision": "auto", "fused_adamw": True, "compiled": False},
    "geofm_bf16_compiled": {
        "fused_attention": True,
        "teacher_precision": "auto",
        "fused_adamw": True,
        "compiled": True,
    },
}
# Optimizer values: a step's speed does not depend on them.
LEARNING_RATE, WEIGHT_DECAY, GRAD_CLIP = 1e-4, 0.05, 5.0
TEACHER_RESIZE = ("resize_mode", "align_corners")  # FrozenTeacher's options, when the file sets them
DISTILLATION = ("alpha", "distill_loss")  # MaskedImageModel's options, when the file sets them


TEACHER, MASKING = "task_options.teacher", "task_options.masking"
"""Where a GFM config keeps masked image modelling's teacher and masking."""


@dataclass(frozen=True)
class StepShape:
    """What the step computes, from a Swin GFM pretraining config: student, teacher, bands, masking, batch."""

    student: dict[str, Any]
    teacher: dict[str, Any]
    bands: list[str]
    mask_patch_size: int
    mask_ratio: float
    micro_batch: int

    @classmethod
    def from_file(cls, path: str | Path, micro_batch: int | None = None) -> StepShape:
        """Read the shape from a config file's keys (``micro_batch`` replaces ``train.micro_batch_size``).

        Raises:
            ConfigError: the file cannot be read, or lacks a key the step needs (named).
        """
        import yaml

        path = repo_path(path)
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"{path}: cannot read the pretraining config: {err}") from None

        def section_of(dotted: str) -> dict:
            node = tree
            for part in dotted.split("."):
                node = (node or {}).get(part)
            return node or {}

        def key(section: str, name: str, default: Any = None) -> Any:
            value = section_of(section).get(name, default)
            if value is None:
                raise ConfigError(
                    f"{path}: {section}.{name} is missing; the device check reads it from a Swin GFM pretraining config"
                )
            return value

        backbone = ("arch", "img_size", "window_size")
        student = {name: key("model", name) for name in backbone}
        student["timm_kwargs"] = key("model", "timm_kwargs", {})
        if "drop_path_rate" in tree["model"]:
            student["drop_path_rate"] = tree["model"]["drop_path_rate"]
        teacher = {name: key(TEACHER, name) for name in (*backbone, "stage", "include_merging")}
        teacher["timm_kwargs"] = key(TEACHER, "timm_kwargs", {})
        given = section_of(TEACHER)
        teacher.update({name: given[name] for name in (*TEACHER_RESIZE, *DISTILLATION) if name in given})
        return cls(
            student=student,
            teacher=teacher,
            bands=list(key("data", "bands")),
            mask_patch_size=key(MASKING, "mask_patch_size"),
            mask_ratio=key(MASKING, "mask_ratio"),
            micro_batch=micro_batch or key("train", "micro_batch_size"),
        )


def build_models(shape: StepShape):
    """The student (mask token, decoder, projector) and its frozen teacher, from seeded random weights."""
    from geofm.data.bands import teacher_band_indices
    from geofm.models.backbones import backbone_kwargs, create_backbone
    from geofm.tasks.mim.model import MaskedImageModel, Tap
    from geofm.tasks.mim.teacher import FrozenTeacher

    def backbone(spec: dict[str, Any], in_chans: int) -> torch.nn.Module:
        kwargs = backbone_kwargs(
            in_chans=in_chans,
            img_size=spec["img_size"],
            window_size=spec["window_size"],
            timm_kwargs=spec["timm_kwargs"],
        )
        return create_backbone(spec["arch"], kwargs, spec.get("drop_path_rate", 0.0))

    torch.manual_seed(0)
    t = shape.teacher
    tap = Tap(t["stage"], t["include_merging"])
    resize = {name: t[name] for name in TEACHER_RESIZE if name in t}
    teacher = FrozenTeacher(backbone(t, 3), tap, teacher_band_indices(shape.bands), t["img_size"], **resize)
    distillation = {name: t[name] for name in DISTILLATION if name in t}
    student = MaskedImageModel(
        backbone(shape.student, len(shape.bands)), len(shape.bands), tap, teacher.out_channels, **distillation
    )
    return student, teacher


def make_step(variant: str, shape: StepShape, dev: torch.device) -> PlainStep:
    """``variant``'s step on ``dev`` (not compiled yet), its micro-batch already on the device."""
    from geofm.models.backbones import set_fused_attention
    from geofm.tasks.mim.teacher import teacher_dtype
    from geofm.training.optim import parameter_groups

    choices = VARIANTS[variant]
    student, teacher = build_models(shape)
    for model in (student, teacher):
        set_fused_attention(model, choices["fused_attention"])
    student.to(dev)
    teacher.to(dev, teacher_dtype(choices["teacher_precision"], dev))
    optimizer = torch.optim.AdamW(
        parameter_groups(student, WEIGHT_DECAY), lr=LEARNING_RATE, fused=True if choices["fused_adamw"] else None
    )
    s = shape.student
    batch = random_batch(
        shape.micro_batch,
        len(shape.bands),
        s["img_size"],
        s["arch"],
        s["timm_kwargs"],
        shape.mask_patch_size,
        shape.mask_ratio,
    )
    batch = {name: value.to(dev) for name, value in batch.items()}
    return PlainStep(student, teacher, optimizer, GRAD_CLIP, batch, dev, torch.bfloat16)


def _memory_mib(dev: torch.device) -> dict[str, float | None]:
    """Memory held now and at the peak: allocated on a GPU, resident on a CPU."""
    if dev.type == "cuda":
        return {
            "now": torch.cuda.memory_allocated(dev) / 2**20,
            "peak": torch.cuda.max_memory_allocated(dev) / 2**20,
            "peak_reserved": torch.cuda.max_memory_reserved(dev) / 2**20,
        }
    return {"now": current_rss_mib(), "peak": peak_rss_mib()}


def serve(variant: str, settings: dict[str, Any]) -> None:
    """Build ``variant``, count its FLOPs, warm it up (compiling it first if it is compiled) and time its steps.

    Timed steps stop early at 80% of ``settings["budget_s"]``; the records go to stdout line by line.
    """
    started = time.perf_counter()

    dev = torch.device(settings["device"])
    shape = StepShape.from_file(settings["config"], settings["micro_batch"])
    step = make_step(variant, shape, dev)
    sync = synchronizer(dev)
    built = _memory_mib(dev)["now"]
    emit(
        "built",
        seconds=time.perf_counter() - started,
        micro_batch=shape.micro_batch,
        teacher_dtype=str(step.teacher.backbone.patch_embed.proj.weight.dtype).removeprefix("torch."),
        **{name: value for name, value in VARIANTS[variant].items() if name != "teacher_precision"},
    )
    emit("flops", flops=count_flops(step))  # on the eager model: compiled code runs the same products
    if VARIANTS[variant]["compiled"]:
        step.model = torch.compile(step.model, backend=settings["compile_backend"])

    def timed() -> float:
        sync()
        start = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - start

    for _ in range(settings["warmup"]):
        emit("warmup", seconds=timed())
    soft_deadline = started + 0.8 * settings["budget_s"]
    for _ in range(settings["steps"]):
        if time.perf_counter() > soft_deadline:
            break
        emit("step", seconds=timed())
    emit("syncs", syncs=host_syncs(step))
    memory = _memory_mib(dev)
    emit(
        "memory",
        peak_mib=memory["peak"],
        step_mib=memory["peak"] - built,
        peak_reserved_mib=memory.get("peak_reserved"),
    )
    emit("done")


if __name__ == "__main__" and len(sys.argv) == 3:
    serve(sys.argv[1], json.loads(sys.argv[2]))
