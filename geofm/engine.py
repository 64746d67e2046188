"""The training engine: DeepSpeed in every mode. The only module that imports ``deepspeed``.

On one CPU or GPU it runs ZeRO stage 0; under ``deepspeed`` or ``torchrun`` it runs data
parallel with the configured ZeRO stage. bf16 is used on GPUs, float32 on CPUs. Set
``DS_ACCELERATOR=cpu`` to force the CPU accelerator.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from timm.optim import param_groups_weight_decay
from torch import nn

from geofm.config import TrainConfig


@dataclass(frozen=True)
class Schedule:
    """Step counts of a run, in optimizer steps."""

    steps_per_epoch: int
    total_steps: int
    warmup_steps: int


def global_batch(train: TrainConfig, world_size: int) -> int:
    """Images per optimizer step: micro-batch x accumulation steps x processes."""
    return train.micro_batch_size * train.grad_accum_steps * world_size


def make_schedule(train: TrainConfig, samples_per_epoch: int, world_size: int) -> Schedule:
    """Steps per epoch (incomplete global batches are dropped), total and warmup steps."""
    steps_per_epoch = samples_per_epoch // global_batch(train, world_size)
    if steps_per_epoch == 0:
        raise ValueError(
            f"an epoch of {samples_per_epoch} samples holds no complete global batch of "
            f"{train.micro_batch_size} x {train.grad_accum_steps} accumulation x {world_size} processes"
        )
    return Schedule(
        steps_per_epoch,
        steps_per_epoch * train.epochs,
        max(1, round(train.warmup_epochs * steps_per_epoch)),
    )


def init_distributed() -> tuple[int, int]:
    """Join the process group and return (rank, world size).

    Under ``deepspeed`` or ``torchrun`` the launcher's environment describes the group; a plain
    launch becomes a group of one on a free local port.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """This process's device (the local GPU, or the CPU)."""
    accel = get_accelerator()
    if accel.device_name() == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    accel.set_device(local_rank)
    return torch.device(accel.device_name(local_rank))


def use_bf16(train: TrainConfig) -> bool:
    """bf16 when asked for, or with ``auto`` on an accelerator that supports it."""
    if train.precision == "auto":
        accel = get_accelerator()
        return accel.device_name() != "cpu" and accel.is_bf16_supported()
    return train.precision == "bf16"


def deepspeed_config(train: TrainConfig, world_size: int, schedule: Schedule) -> dict[str, Any]:
    """The DeepSpeed config of a run: AdamW, warmup + cosine, clipping, accumulation, ZeRO, bf16.

    The learning rate scales linearly with the global batch: ``base_lr * batch / lr_reference_batch``.
    """
    return {
        "train_batch_size": global_batch(train, world_size),
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        "bf16": {"enabled": use_bf16(train)},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": scaled_lr(train, world_size),
                "betas": list(train.betas),
                "eps": train.eps,
                "weight_decay": train.weight_decay,
                "torch_adam": True,
                "adam_w_mode": True,
            },
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": schedule.total_steps,
                "warmup_num_steps": schedule.warmup_steps,
                "warmup_min_ratio": train.warmup_start_ratio,
                "cos_min_ratio": train.min_lr_ratio,
                "warmup_type": "linear",
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def scaled_lr(train: TrainConfig, world_size: int) -> float:
    """Peak learning rate: ``base_lr`` scaled by global batch / ``lr_reference_batch``."""
    return train.base_lr * global_batch(train, world_size) / train.lr_reference_batch


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on norms, biases and the model's ``no_weight_decay()`` names.

    Frozen parameters are left out, so a teacher inside ``model`` would get no optimizer state.
    """
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    return param_groups_weight_decay(model, weight_decay=weight_decay, no_weight_decay_list=skip)


def initialize(model: nn.Module, train: TrainConfig, world_size: int, schedule: Schedule):
    """Wrap ``model`` in a DeepSpeed engine (optimizer and scheduler come from the config)."""
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(model, train.weight_decay),
        config=deepspeed_config(train, world_size, schedule),
    )
    return engine


def save_checkpoint(engine, directory: Path, tag: str, client_state: dict) -> None:
    """Save model, optimizer and scheduler state under ``directory/tag`` (all ranks call this)."""
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)


def load_checkpoint(engine, directory: Path, tag: str) -> dict:
    """Restore a checkpoint saved by :func:`save_checkpoint`; return its client state."""
    path, client_state = engine.load_checkpoint(str(directory), tag=tag)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")
    return client_state


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def mean_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """Average a tensor over data-parallel ranks (identity on one process)."""
    if dist.is_initialized():
        values = values.clone()
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return values


def max_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of a tensor over data-parallel ranks (identity on one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values
