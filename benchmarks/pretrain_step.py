"""``geofm bench pretrain-step``: images/s of one GFM training step, optimised against plain eager fp32.

One step is the frozen teacher's forward, the student's masked forward (encoder, decoder,
projector), the loss, the backward and the optimizer step, on synthetic batches of the config's
shape (no data loading). Two variants start from identical weights:

* ``optimised``: geofm's own step, :func:`geofm.tasks.mim.task.mim_forward` in
  :func:`geofm.training.loop.micro_step` on the DeepSpeed engine as configured (fused AdamW, the teacher at
  ``task_options.teacher.precision``, fused attention where it pays, bf16 on GPUs);
* ``eager_fp32``: the same model written plainly: an fp32 teacher, explicit attention, torch's
  default AdamW and ``clip_grad_norm_``, no engine.

Each variant runs in a process of its own (see :class:`VariantProcess`); the parent alternates
their steps. Also reported: the teacher's share of each step, peak memory, the FLOPs of the step
(counted with :class:`torch.utils.flop_counter.FlopCounterMode`) and on a GPU the model FLOPs
utilisation. The teacher gets random weights of its architecture: speed does not depend on what
it learnt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Report,
    Target,
    child_env,
    current_rss_mib,
    paired_ratio,
    peak_rss_mib,
    repo_path,
    summary,
    synchronizer,
)
from benchmarks.gfm_step import build, count_flops, host_syncs, synthetic_batch

DEFAULTS: dict[str, Any] = {
    "config": "configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml",
    "overrides": [],
    "micro_batch": None,  # None: 4 on a CPU, the config's train.micro_batch_size on a GPU
    "rounds": 5,
    "warmup": 1,
    "memory": True,  # peak memory of each variant (a child process per variant on a CPU)
    "flops": True,
    "peak_tflops": None,  # the device's peak for MFU; None: known GPUs only
}
QUICK: dict[str, Any] = {
    "config": "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml",
    "micro_batch": 4,
    "rounds": 3,
}
VARIANTS = ("optimised", "eager_fp32")
GFM_V100_IMAGES_PER_S = 178.0  # GFM paper: Swin-B, 192 px, per V100 GPU
MFU_TARGET = 0.35  # the Swin-B 192 px bf16 step's model FLOPs utilisation on a GPU
# Dense bf16 tensor-core peaks (TFLOP/s) by device name, most specific first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def load_config(settings: dict[str, Any], folder: Path):
    """The benchmark's config: the file with its overrides, the micro-batch, and a random teacher in ``folder``."""
    from geofm.config import PretrainConfig
    from geofm.models.backbones import backbone_kwargs, create_backbone
    from geofm.tasks.mim.task import mim_options, with_teacher_checkpoint

    overrides = list(settings["overrides"])
    if settings["micro_batch"] is not None:
        overrides.append(f"train.micro_batch_size={settings['micro_batch']}")
    elif not torch.cuda.is_available():
        overrides.append("train.micro_batch_size=4")
    cfg = PretrainConfig.from_file(repo_path(settings["config"]), overrides)
    t = mim_options(cfg).teacher
    if t is not None:
        kwargs = backbone_kwargs(in_chans=3, img_size=t.img_size, window_size=t.window_size, timm_kwargs=t.timm_kwargs)
        weights = folder / "random_teacher.pth"
        if not weights.exists():
            torch.manual_seed(1)
            torch.save(create_backbone(t.arch, kwargs).state_dict(), weights)
        cfg = with_teacher_checkpoint(cfg, weights)
    return cfg


def peak_tflops(settings: dict[str, Any]) -> float | None:
    """The device's dense bf16 peak: the setting, or a known GPU's datasheet figure."""
    if settings["peak_tflops"] is not None:
        return float(settings["peak_tflops"])
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((tf for key, tf in PEAK_BF16_TFLOPS if key in name), None)
    return None


class VariantProcess:
    """One variant's step in a process of its own, stepped on request.

    Each variant gets a fresh process so that process-wide choices of the optimised path (the
    allocator's settings, thread pools) do not leak into the baseline, and so that its peak memory
    is its own. The parent alternates requests between the processes; only one computes at a time.
    """

    def __init__(self, variant: str, settings: dict[str, Any], folder: Path) -> None:
        self.variant = variant
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.pretrain_step", "--serve", variant, json.dumps(settings), str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        self.info = self._reply()

    def _reply(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"the {self.variant} step process failed:\n{self.process.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        """Send a command (``step``, ``teacher``, ``flops``, ``syncs``, ``memory``) and return the reply."""
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._reply()

    def timed(self, command: str) -> float:
        """Seconds the process spent on ``command``, measured inside it around the device's work."""
        return self.ask(command)["seconds"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()


def _serve(variant: str, settings: dict[str, Any], folder: Path) -> None:
    """In a fresh process: build one variant, then answer commands from stdin until it closes."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr
    cfg = load_config(settings, folder)
    step = build(variant, cfg, synthetic_batch(cfg))
    sync = synchronizer(step.dev)
    built = current_rss_mib()
    if step.dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        built = torch.cuda.memory_allocated() / 2**20
    reply.write(json.dumps({"precision": step.precision, "device": str(step.dev)}) + "\n")
    for command in sys.stdin:
        command = command.strip()
        if command in ("step", "teacher"):
            call = step if command == "step" else step.teacher_forward
            sync()
            started = time.perf_counter()
            call()
            sync()
            answer: dict[str, Any] = {"seconds": time.perf_counter() - started}
        elif command == "flops":
            answer = {"flops": count_flops(step)}
        elif command == "syncs":
            answer = {"syncs": host_syncs(step)}
        else:  # memory
            peak = torch.cuda.max_memory_allocated() / 2**20 if step.dev.type == "cuda" else peak_rss_mib()
            answer = {"peak_mib": peak, "step_mib": None if built is None else peak - built}
        reply.write(json.dumps(answer) + "\n")


def run(settings: dict[str, Any]) -> Report:
    from geofm.tasks.mim.task import mim_options  # the device check imports this module without pydantic

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cfg = load_config(settings, folder)  # writes the random teacher the processes share
        teacher = mim_options(cfg).teacher
        processes = {v: VariantProcess(v, settings, folder) for v in VARIANTS}
        try:
            calls: dict[str, Any] = {v: (lambda p=p: p.timed("step")) for v, p in processes.items()}
            if teacher is not None:
                calls.update({f"teacher_{v}": (lambda p=p: p.timed("teacher")) for v, p in processes.items()})
            for _ in range(settings["warmup"]):
                for call in calls.values():
                    call()
            times: dict[str, list[float]] = {name: [] for name in calls}
            names = list(calls)
            for r in range(settings["rounds"]):
                shift = r % len(names)
                for name in names[shift:] + names[:shift]:
                    times[name].append(calls[name]())
            memory = {v: p.ask("memory") for v, p in processes.items()} if settings["memory"] else {}
            flops = processes["eager_fp32"].ask("flops")["flops"] if settings["flops"] else None
            syncs = processes["optimised"].ask("syncs")["syncs"]
            info = {v: p.info for v, p in processes.items()}
        finally:
            for p in processes.values():
                p.close()

    micro = cfg.train.micro_batch_size
    gpu = info["optimised"]["device"].startswith("cuda")
    results: dict[str, Any] = {
        "arch": cfg.model.arch,
        "img_size": cfg.model.img_size,
        "micro_batch": micro,
        "teacher": None
        if teacher is None
        else {"arch": teacher.arch, "img_size": teacher.img_size, "precision": teacher.precision},
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "variants": {},
        "speedup": paired_ratio(times, "eager_fp32", "optimised"),
        "step_flops": flops,
        "host_syncs_per_step": syncs,
    }
    rows = []
    peak = peak_tflops(settings)
    for v in VARIANTS:
        seconds = summary(times[v])
        record: dict[str, Any] = {
            "precision": info[v]["precision"],
            "step_s": seconds,
            "images_per_s": micro / seconds["median"],
            "memory": memory.get(v),
        }
        if teacher is not None:
            record["teacher_s"] = summary(times[f"teacher_{v}"])
            record["teacher_share"] = paired_ratio(times, f"teacher_{v}", v)
        if flops is not None:
            record["achieved_tflops"] = flops / seconds["median"] / 1e12
            record["mfu"] = record["achieved_tflops"] / peak if peak else None
        results["variants"][v] = record
        rows.append(
            {
                "variant": v,
                "precision": record["precision"],
                "step s": seconds["median"],
                "images/s": record["images_per_s"],
                "teacher share": record.get("teacher_share"),
                "peak MiB": (record["memory"] or {}).get("peak_mib"),
                "step MiB": (record["memory"] or {}).get("step_mib"),
                "TFLOP/s": record.get("achieved_tflops"),
                "MFU": record.get("mfu"),
            }
        )
    targets = []
    notes = [
        f"speed-up optimised over eager fp32: {results['speedup']:.2f}x (median of {settings['rounds']} paired rounds)"
    ]
    if gpu:
        optimised = results["variants"]["optimised"]
        results["gfm_reported_v100_images_per_s"] = GFM_V100_IMAGES_PER_S
        notes.append(f"GFM reports about {GFM_V100_IMAGES_PER_S:g} images/s per V100 for Swin-B at 192 px")
        targets.append(Target("Swin-B 192 px bf16 MFU", optimised.get("mfu"), ">=", MFU_TARGET))
    else:
        targets.append(Target("optimised / eager fp32 step speed (CPU)", results["speedup"], ">=", 1.3, "x"))
        notes.append("no GPU here: bf16 images/s and MFU are measured only where torch.cuda.is_available()")
    notes.append(
        "peak MiB: the variant process's peak (resident memory on a CPU, allocated on a GPU); step MiB: above the built model"
    )
    return Report(results, targets, rows, notes)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--serve":
    _serve(sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4]))
