"""A run's batch and step arithmetic and its DeepSpeed config, as plain values: nothing here imports DeepSpeed.

What depends on the accelerator (bf16 support, torch's fused AdamW) is decided by :mod:`geofm.training.engine`
and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from geofm.config import OptimizerConfig

if TYPE_CHECKING:
    from geofm.config.federated import LocalOptimizerConfig


@dataclass(frozen=True)
class Schedule:
    """Step counts of a run, in optimizer steps."""

    steps_per_epoch: int
    total_steps: int
    warmup_steps: int


def global_batch(train: OptimizerConfig, world_size: int) -> int:
    """Images per optimizer step: micro-batch x accumulation steps x processes."""
    return train.micro_batch_size * train.grad_accum_steps * world_size


def zero_stage(train: OptimizerConfig, world_size: int) -> int:
    """The ZeRO stage a run uses: the configured one across processes, 0 on one process."""
    return train.zero_stage if world_size > 1 else 0


def deepspeed_config(
    train: OptimizerConfig,
    world_size: int,
    schedule: Schedule | None,
    lr: float | None = None,
    optimizer: LocalOptimizerConfig | None = None,
    *,
    bf16: bool,
    fused: bool,
) -> dict[str, Any]:
    """The DeepSpeed config of a run: AdamW, warmup + cosine, clipping, accumulation, ZeRO, bf16.

    The learning rate scales linearly with the global batch: ``base_lr * batch / lr_reference_batch``.
    Without a ``schedule`` (a federated client's round) the learning rate is the constant ``lr``.
    ``optimizer`` (a federated client's, every field set) replaces AdamW by torch's SGD (``sgd``) or
    sets AdamW's weight decay; its ``base_lr`` is already in ``lr``. ``bf16``: train in bfloat16;
    ``fused``: torch's fused AdamW kernel.
    """
    peak = scaled_lr(train, world_size) if lr is None else lr
    if optimizer is not None and optimizer.name == "sgd":
        chosen = {
            "type": "SGD",  # DeepSpeed builds torch.optim.SGD
            "params": {"lr": peak, "momentum": optimizer.momentum, "weight_decay": optimizer.weight_decay},
        }
    else:
        decay = train.weight_decay if optimizer is None else optimizer.weight_decay
        chosen = {
            "type": "AdamW",
            "params": {
                "lr": peak,
                "betas": list(train.betas),
                "eps": train.eps,
                "weight_decay": decay,
                "torch_adam": True,
                "adam_w_mode": True,
                "fused": fused,
            },
        }
    config: dict[str, Any] = {
        "train_batch_size": global_batch(train, world_size),
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": zero_stage(train, world_size)},
        "bf16": {"enabled": bf16},
        # Floating buffers follow the parameters into bf16: DeepSpeed keeps them in fp32 otherwise,
        # and Swin's fp32 attention mask would promote bf16 attention scores to fp32.
        **({"data_types": {"buffer_dtype": "bf16"}} if bf16 else {}),
        "optimizer": chosen,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if schedule is not None:
        config["scheduler"] = {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": schedule.total_steps,
                "warmup_num_steps": schedule.warmup_steps,
                "warmup_min_ratio": train.warmup_start_ratio,
                "cos_min_ratio": train.min_lr_ratio,
                "warmup_type": "linear",
            },
        }
    return config


def scaled_lr(train: OptimizerConfig, world_size: int) -> float:
    """Peak learning rate: ``base_lr`` scaled by global batch / ``lr_reference_batch``."""
    return train.base_lr * global_batch(train, world_size) / train.lr_reference_batch


def scaled_groups(groups: list[dict], peak_lr: float) -> list[dict]:
    """Parameter groups with their own peak ``lr``: ``peak_lr`` times each group's ``lr_scale`` (default 1).

    DeepSpeed's WarmupCosineLR records every group's ``lr`` when it is built and multiplies each by
    the same warmup/cosine ratio at every step, so per-group scales (layer-wise lr decay) hold
    throughout the schedule, and on resume (the scheduler's state is its step only).
    """
    return [{**group, "lr": peak_lr * group.get("lr_scale", 1.0)} for group in groups]
