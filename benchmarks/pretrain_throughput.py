"""Pretraining step throughput of a config's model, GFM (with teacher) and plain SimMIM side by side.

Measures the model alone (synthetic batches on the device, no data loading), with the config's
engine settings (bf16 on GPU). The teacher gets random weights of its architecture: the figure is
about speed, not quality. Prints one JSON line per variant and the GFM/SimMIM time ratio.

example:
  python benchmarks/pretrain_throughput.py --config configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml --steps 20 train.micro_batch_size=64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from geofm import engine as ds
from geofm.config import PretrainConfig
from geofm.models.backbones import backbone_kwargs, create_backbone
from geofm.models.masking import MaskGenerator
from geofm.models.teacher import build_teacher
from pretrain.central import build_student, train_micro_step


def measure(cfg, steps: int, warmup: int) -> dict:
    _, world = ds.init_distributed()
    dev = ds.device()
    teacher = build_teacher(cfg.teacher, cfg.data.teacher_band_indices) if cfg.teacher else None
    model = build_student(cfg)
    engine = ds.initialize(model, cfg.train, world, ds.make_schedule(cfg.train, 10**6, world))
    dtype = torch.bfloat16 if ds.use_bf16(cfg.train) else torch.float32
    if teacher is not None:
        teacher.to(dev, dtype)
    b, c, s = cfg.train.micro_batch_size, len(cfg.data.bands), cfg.model.img_size
    masks = MaskGenerator(s, cfg.masking.mask_patch_size, model.patch_size, cfg.masking.mask_ratio)
    batch = {
        "image": torch.randn(b, c, s, s, device=dev, dtype=dtype),
        "mask": torch.stack([masks() for _ in range(b)]).to(dev),
        "valid": torch.ones(b, c, s, s, dtype=torch.bool, device=dev),
    }
    for _ in range(warmup):
        train_micro_step(engine, teacher, batch, dev, dtype)
    synchronize = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        train_micro_step(engine, teacher, batch, dev, dtype)
    synchronize()
    seconds = (time.perf_counter() - start) / steps
    return {
        "method": "gfm" if teacher is not None else "simmim",
        "arch": cfg.model.arch,
        "img_size": s,
        "micro_batch": b,
        "precision": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "step_ms": round(seconds * 1000, 2),
        "images_per_s": round(b * world / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = PretrainConfig.from_file(args.config, args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        if cfg.teacher is not None:
            t = cfg.teacher
            kwargs = backbone_kwargs(in_chans=3, img_size=t.img_size, window_size=t.window_size, timm_kwargs=t.timm_kwargs)
            weights = Path(tmp) / "random_teacher.pth"
            torch.save(create_backbone(t.arch, kwargs).state_dict(), weights)
            cfg = cfg.model_copy(update={"teacher": t.model_copy(update={"checkpoint": weights})})
            results.append(measure(cfg, args.steps, args.warmup))
        results.append(measure(cfg.model_copy(update={"teacher": None}), args.steps, args.warmup))
    for r in results:
        print(json.dumps(r))
    if len(results) == 2:
        print(json.dumps({"gfm_over_simmim_step_time": round(results[0]["step_ms"] / results[1]["step_ms"], 3)}))


if __name__ == "__main__":
    main()
