"""The GFM training step on synthetic batches, in the variants the benchmarks time.

geofm's own step on the DeepSpeed engine (:class:`OptimisedStep`) and plain PyTorch (:class:`PlainStep`, and
eager fp32 :class:`EagerStep`), built by :func:`build`; the step's FLOPs (:func:`count_flops`) and its
host synchronisations (:func:`host_syncs`). Shared by ``geofm bench pretrain-step``, ``geofm bench data``
and the GPU device check.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode


def synthetic_batch(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """A CPU batch shaped like the pile's for a pretraining config (see :func:`random_batch`)."""
    from geofm.tasks.mim.task import mim_options

    m = mim_options(cfg).masking
    return random_batch(
        cfg.train.micro_batch_size,
        len(cfg.data.bands),
        cfg.model.img_size,
        cfg.model.arch,
        cfg.model.timm_kwargs,
        m.mask_patch_size,
        m.mask_ratio,
        seed,
    )


def random_batch(
    batch: int,
    bands: int,
    size: int,
    arch: str,
    timm_kwargs: dict[str, Any],
    mask_patch_size: int,
    mask_ratio: float,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A CPU batch shaped like the pile's: normalised images, SimMIM token masks for ``arch``, all pixels valid."""
    from geofm.models.backbones import patch_size_of
    from geofm.tasks.mim.masking import MaskGenerator

    generator = torch.Generator().manual_seed(seed)
    masks = MaskGenerator(size, mask_patch_size, patch_size_of(arch, timm_kwargs), mask_ratio)
    return {
        "image": torch.randn(batch, bands, size, size, generator=generator),
        "mask": torch.stack([masks(generator) for _ in range(batch)]),
        "valid": torch.ones(batch, bands, size, size, dtype=torch.bool),
    }


class OptimisedStep:
    """geofm's training step on the DeepSpeed engine, as a pretraining run takes it."""

    def __init__(self, cfg, state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> None:
        from geofm.tasks.mim.task import build_student, mim_forward, mim_options, prepare_models
        from geofm.tasks.mim.teacher_from_checkpoint import build_teacher
        from geofm.training import engine as ds

        _, world = ds.init_distributed()
        self.dev = ds.device()
        model = build_student(cfg)
        model.load_state_dict(state)
        teacher = mim_options(cfg).teacher
        self.teacher = build_teacher(teacher, cfg.data.teacher_band_indices) if teacher is not None else None
        prepare_models(model, self.teacher, cfg, self.dev)
        self.engine = ds.initialize(model, cfg.train, world, ds.make_schedule(cfg.train, 10**6, world))
        self.dtype = ds.compute_dtype(cfg.train)
        self.forward = mim_forward(self.engine, self.teacher, self.dev, self.dtype)
        self.batch = batch
        self.precision = str(self.dtype).removeprefix("torch.")

    def __call__(self) -> None:
        from geofm.training.loop import micro_step

        micro_step(self.engine, self.forward, self.batch)

    def teacher_forward(self) -> None:
        self.teacher(self.batch["image"].to(self.dev, self.dtype))


class PlainStep:
    """A GFM step written plainly, no engine: teacher forward, student losses, backward, clipping, optimizer step.

    Args:
        model: the student (a :class:`~geofm.tasks.mim.model.MaskedImageModel`, compiled or not).
        teacher: the frozen teacher, or None for plain SimMIM.
        optimizer: over the student's parameters.
        clip: the gradient norm clipped to.
        batch: the micro-batch, moved to ``dev`` at each step (place it there first to time compute alone).
        dev: the device.
        autocast: the dtype of ``torch.autocast`` around the forward passes (None: none).
    """

    def __init__(self, model, teacher, optimizer, clip: float, batch, dev: torch.device, autocast=None) -> None:
        self.model = model
        self.teacher = teacher
        self.optimizer = optimizer
        self.clip = clip
        self.batch = batch
        self.dev = dev
        self.autocast = autocast

    def _autocast(self):
        return torch.autocast(self.dev.type, dtype=self.autocast, enabled=self.autocast is not None)

    def __call__(self) -> None:
        images = self.batch["image"].to(self.dev)
        with self._autocast():
            targets = self.teacher(images) if self.teacher is not None else None
            self.optimizer.zero_grad(set_to_none=True)
            losses = self.model(images, self.batch["mask"].to(self.dev), self.batch["valid"].to(self.dev), targets)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()

    def teacher_forward(self) -> None:
        with self._autocast():
            self.teacher(self.batch["image"].to(self.dev))


class EagerStep(PlainStep):
    """The same step written plainly in fp32: explicit attention, an fp32 teacher, torch AdamW, no engine."""

    def __init__(self, cfg, state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> None:
        from geofm.models.backbones import set_fused_attention
        from geofm.tasks.mim.task import build_student, mim_options
        from geofm.tasks.mim.teacher_from_checkpoint import build_teacher
        from geofm.training import engine as ds
        from geofm.training.engine_config import scaled_lr
        from geofm.training.optim import parameter_groups

        dev = ds.device()
        model = build_student(cfg).to(dev)
        model.load_state_dict(state)
        set_fused_attention(model, False)
        teacher, options = None, mim_options(cfg)
        if options.teacher is not None:
            teacher = build_teacher(options.teacher, cfg.data.teacher_band_indices).to(dev)
            set_fused_attention(teacher, False)
        t = cfg.train
        optimizer = torch.optim.AdamW(
            parameter_groups(model, t.weight_decay), lr=scaled_lr(t, 1), betas=t.betas, eps=t.eps
        )
        super().__init__(model, teacher, optimizer, t.grad_clip, batch, dev)
        self.precision = "float32"


def build(variant: str, cfg, batch: dict[str, torch.Tensor]):
    """One variant's step, from the weights every variant shares (seeded)."""
    from geofm.tasks.mim.task import build_student

    torch.manual_seed(0)
    state = build_student(cfg).state_dict()
    return (OptimisedStep if variant == "optimised" else EagerStep)(cfg, state, batch)


def count_flops(step) -> float:
    """FLOPs of one step (teacher forward, student forward and backward), from torch's FLOP counter."""
    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())


def host_syncs(step) -> int | None:
    """Host-device synchronisations one CUDA step causes (None on a CPU, where there are none to count)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
