"""The training engine: DeepSpeed in every mode. The only module that imports ``deepspeed``.

On one CPU or GPU it runs ZeRO stage 0 whatever the config says (ZeRO only pays when optimizer
state is sharded over several processes; on one process its optimizer wrapper costs time and
memory) and skips the gradient all-reduce (with nobody to reduce with, DeepSpeed would still
flatten and copy back every gradient each step); under ``deepspeed`` or ``torchrun`` it runs data
parallel with the configured ZeRO stage. bf16 is used on GPUs, float32 on CPUs. AdamW is torch's
fused implementation on CPUs and CUDA GPUs (one kernel over all parameters instead of a loop of
per-tensor operations; the same update up to float rounding). Set ``DS_ACCELERATOR=cpu`` to force
the CPU accelerator.

Resuming reads DeepSpeed's checkpoint files through :func:`geofm.checkpoints.io.load_training_file`:
weights-only unpickling, as for every checkpoint geofm reads, so a crafted file cannot run code.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deepspeed
import deepspeed.ops
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.logging import logger as deepspeed_logger
from deepspeed.utils.tensor_fragment import fragment_address
from torch import nn

from geofm.checkpoints.io import load_training_file
from geofm.config import OptimizerConfig, TrainConfig
from geofm.errors import CheckpointNotFoundError, DatasetTooSmallError
from geofm.memory import keep_freed_memory
from geofm.training.engine_config import Schedule, deepspeed_config, global_batch, scaled_groups, scaled_lr, zero_stage
from geofm.training.optim import parameter_groups

if TYPE_CHECKING:
    from geofm.config.federated import LocalOptimizerConfig

log = logging.getLogger("geofm.training.engine")
# Start-up noise with no bearing on a run: torch's extension loader looks for CUDA on CPU machines,
# and ZeRO-2 calls a collective torch has renamed.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated", category=FutureWarning)

# Data records DeepSpeed pickles into its optimizer-state files; a resume rebuilds these classes only.
DEEPSPEED_RECORDS: dict[str, type] = {
    f"{cls.__module__}.{cls.__qualname__}": cls for cls in (fragment_address, LossScaler, ZeroStageEnum)
}


def make_schedule(
    train: TrainConfig, samples_per_epoch: int, world_size: int, data: str = "the training data"
) -> Schedule:
    """Steps per epoch (incomplete global batches are dropped), total and warmup steps.

    Args:
        train: the optimisation settings.
        samples_per_epoch: samples of one epoch, over all processes.
        world_size: processes training together.
        data: what the samples are (dataset or sources, split, root), for the error.

    Raises:
        DatasetTooSmallError: if an epoch holds no complete global batch.
    """
    steps_per_epoch = samples_per_epoch // global_batch(train, world_size)
    if steps_per_epoch == 0:
        raise DatasetTooSmallError(
            f"{data}: an epoch of {samples_per_epoch} samples holds no complete global batch of "
            f"{global_batch(train, world_size)} images (train.micro_batch_size {train.micro_batch_size} x "
            f"train.grad_accum_steps {train.grad_accum_steps} x {world_size} process(es)); add data or use a smaller batch"
        )
    return Schedule(
        steps_per_epoch,
        steps_per_epoch * train.epochs,
        max(1, round(train.warmup_epochs * steps_per_epoch)),
    )


def init_distributed() -> tuple[int, int]:
    """Join the process group and return (rank, world size).

    Under ``deepspeed`` or ``torchrun`` the launcher's environment describes the group; a plain
    launch becomes a group of one on a free local port. A group of one never builds DeepSpeed's
    shared-memory communication extension (it has nobody to share memory with); several CPU
    processes build it once per virtual environment, cached inside it (``TORCH_EXTENSIONS_DIR``).
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ["MASTER_PORT"] = str(free_port())
        _choose_shared_memory_comm(int(os.environ.get("WORLD_SIZE", "1")))
        with contextlib.redirect_stdout(io.StringIO()) as printed:  # DeepSpeed prints "... built successfully"
            deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
        log.debug("DeepSpeed: %s", printed.getvalue().strip())
    elif "LOCAL_RANK" not in os.environ and dist.get_world_size() == 1:
        # A group of one formed here earlier whose variables a federated run has since hidden from its
        # processes (federation.runtime.processes.PROCESS_GROUP_ENV): DeepSpeed's engine reads LOCAL_RANK again.
        os.environ["LOCAL_RANK"] = "0"
    return dist.get_rank(), dist.get_world_size()


def data_parallel_rank() -> tuple[int, int]:
    """This process's rank and the number of processes training together ((0, 1) outside a process group)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _choose_shared_memory_comm(world_size: int) -> None:
    """Decide, before DeepSpeed asks, whether its shared-memory all-reduce extension is built.

    DeepSpeed reads the answer from ``deepspeed.ops.__compatible_ops__``, which it otherwise fills
    by probing every op it knows with compiler runs (seconds, and linker noise such as "cannot
    find -laio"). Only the shared-memory op is asked about: never on one process, and on several
    when the accelerator has it (CPU), compiled once into this virtual environment.
    """
    compatible = {}
    if world_size > 1:
        cache = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is not None:
            compatible[builder.NAME] = builder.is_compatible()
            if (
                compatible[builder.NAME]
                and not any(cache.glob(f"{builder.NAME}/*.so"))
                and os.environ.get("RANK") == "0"
            ):
                log.info("compiling DeepSpeed's shared-memory all-reduce into %s (once per environment)", cache)
    deepspeed.ops.__compatible_ops__ = compatible


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now, for a process group's rendezvous."""
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


def local_devices() -> tuple[int, str]:
    """How many processes this machine can train data parallel on, and what they are: its GPUs under a GPU
    accelerator, else the CPU cores this process may run on (gloo, one process a core)."""
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        return accel.device_count(), "GPUs"
    return len(os.sched_getaffinity(0)), "CPU cores"


def use_bf16(train: OptimizerConfig) -> bool:
    """bf16 when asked for, or with ``auto`` on an accelerator that supports it."""
    if train.precision == "auto":
        accel = get_accelerator()
        return accel.device_name() != "cpu" and accel.is_bf16_supported()
    return train.precision == "bf16"


def compute_dtype(train: OptimizerConfig) -> torch.dtype:
    """The dtype of the model's inputs and parameters in training: bfloat16 when :func:`use_bf16`, else float32."""
    return torch.bfloat16 if use_bf16(train) else torch.float32


def fused_adamw() -> bool:
    """Whether torch's fused AdamW kernel serves this accelerator (CPUs and CUDA GPUs)."""
    return get_accelerator().device_name() in ("cpu", "cuda")


class _SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading by geofm's weights-only rules."""

    def load(self, path: str, map_location=None):
        return load_training_file(path, map_location, DEEPSPEED_RECORDS)


class _QuietSchedulerProbe(logging.Filter):
    """Drops DeepSpeed's warning that its initialisation itself causes by reading the lr before step 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "before it has started" not in record.getMessage()


deepspeed_logger.addFilter(_QuietSchedulerProbe())


# torch.compile backend of train.compile (None: the accelerator's, inductor).
COMPILE_BACKEND: str | None = None


def initialize(
    model: nn.Module,
    train: OptimizerConfig,
    world_size: int,
    schedule: Schedule | None,
    lr: float | None = None,
    param_groups: list[dict] | None = None,
    optimizer: LocalOptimizerConfig | None = None,
):
    """Wrap ``model`` in a DeepSpeed engine (optimizer and scheduler come from the config).

    The process joins its process group first if it has not yet (see :func:`init_distributed`).
    On a CPU, freed memory is kept for the next step (:func:`~geofm.memory.keep_freed_memory`).

    Args:
        model: the module to train.
        train: the optimisation settings.
        world_size: processes training together.
        schedule: step counts of the run; None keeps the learning rate at ``lr`` (a federated
            client's round, see :func:`~geofm.training.engine_config.deepspeed_config`).
        lr: the peak learning rate, default the config's scaled to the global batch.
        param_groups: the program's own AdamW groups (``params``, ``weight_decay``, optional
            ``lr_scale``); default :func:`parameter_groups`, all at the peak learning rate.
        optimizer: a federated client's local optimiser (see :func:`~geofm.training.engine_config.deepspeed_config`); default AdamW.
    """
    init_distributed()
    if get_accelerator().device_name() == "cpu":
        keep_freed_memory()
    if train.zero_stage != zero_stage(train, world_size) and dist.get_rank() == 0:
        log.info("one process: ZeRO stage 0 (train.zero_stage=%d applies across processes)", train.zero_stage)
    decay = train.weight_decay if optimizer is None else optimizer.weight_decay
    groups = parameter_groups(model, decay) if param_groups is None else param_groups
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=scaled_groups(groups, scaled_lr(train, world_size) if lr is None else lr),
        config=deepspeed_config(train, world_size, schedule, lr, optimizer, bf16=use_bf16(train), fused=fused_adamw()),
    )
    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise RuntimeError(f"unexpected DeepSpeed checkpoint engine {type(engine.checkpoint_engine).__name__}")
    engine.checkpoint_engine = _SafeCheckpointEngine(engine._config)
    if dist.get_world_size() == 1:
        engine.enable_backward_allreduce = False
    if train.compile:
        engine.compile(backend=COMPILE_BACKEND or get_accelerator().get_compile_backend())
    return engine


@contextlib.contextmanager
def plain_forward(engine) -> Iterator[None]:
    """Calls of a DeepSpeed ``engine`` run its module directly for the block (anything else is left as is).

    The engine's own forward hooks its outputs so that a backward through them enters its backward
    state (loss scaling, ZeRO's reduction, a refusal of ``tensor.backward`` at stage 0): a forward
    whose gradient is taken apart from :meth:`engine.backward` (SAM's ascent, through
    :func:`torch.autograd.grad`) must bypass it.
    """
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        yield
        return
    engine.forward = engine.module.__call__
    try:
        yield
    finally:
        del engine.forward


def save_checkpoint(engine, directory: Path, tag: str, client_state: dict) -> None:
    """Save model, optimizer and scheduler state under ``directory/tag`` (all ranks call this)."""
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)


def load_checkpoint(engine, directory: Path, tag: str) -> dict:
    """Restore a checkpoint saved by :func:`save_checkpoint`; return its client state.

    Raises:
        CheckpointNotFoundError: if ``directory/tag`` holds no DeepSpeed model states.
    """
    path, client_state = None, {}
    if any(Path(directory, tag).glob("*model_states.pt")):
        path, client_state = engine.load_checkpoint(str(directory), tag=tag)
    if path is None:
        raise CheckpointNotFoundError(
            f"{Path(directory, tag).resolve()}: no DeepSpeed checkpoint (model and optimizer states) to resume from; "
            "restore it or choose a new run.output_dir"
        )
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


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list on one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    return [obj]
