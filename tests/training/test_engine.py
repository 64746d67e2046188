import os

import pytest

from geofm.config import TrainConfig
from geofm.tasks.mim.model import MaskedImageModel
from geofm.training.engine import fused_adamw, make_schedule, parameter_groups, use_bf16
from geofm.training.engine_config import deepspeed_config, scaled_lr


def _train(**kw):
    return TrainConfig(**{"epochs": 10, "micro_batch_size": 8, "warmup_epochs": 1, **kw})


def test_lr_scales_with_global_batch():
    assert scaled_lr(_train(micro_batch_size=128, grad_accum_steps=2, base_lr=2e-4), world_size=4) == pytest.approx(
        4e-4
    )


def test_schedule_drops_incomplete_batches_and_counts_warmup():
    s = make_schedule(_train(micro_batch_size=4, grad_accum_steps=2), samples_per_epoch=100, world_size=2)
    assert (s.steps_per_epoch, s.total_steps, s.warmup_steps) == (6, 60, 6)
    with pytest.raises(ValueError, match="no complete global batch"):
        make_schedule(_train(micro_batch_size=64), samples_per_epoch=10, world_size=1)


def test_deepspeed_config_carries_the_recipe():
    train = _train(grad_accum_steps=4, zero_stage=2, precision="fp32")
    cfg = deepspeed_config(train, 2, make_schedule(_train(), 80, 1), bf16=use_bf16(train), fused=True)
    assert cfg["train_batch_size"] == 8 * 4 * 2 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["gradient_clipping"] == 5.0 and cfg["zero_optimization"]["stage"] == 2
    assert cfg["bf16"]["enabled"] is False
    assert cfg["scheduler"]["type"] == "WarmupCosineLR" and cfg["scheduler"]["params"]["warmup_num_steps"] == 10
    assert cfg["optimizer"]["params"]["weight_decay"] == 0.05


def test_one_process_runs_zero_stage_0_whatever_the_config_says():
    schedule = make_schedule(_train(), 80, 1)
    stages = [
        deepspeed_config(_train(zero_stage=1), world, schedule, bf16=False, fused=True)["zero_optimization"]["stage"]
        for world in (1, 2)
    ]
    assert stages == [0, 1]


def test_no_weight_decay_on_norms_biases_mask_token_and_position_tables(tiny_swin):
    model = MaskedImageModel(tiny_swin(3), in_chans=3)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in parameter_groups(model, 0.05)}
    assert "mask_token" in groups[0.0]
    assert any("relative_position_bias_table" in n for n in groups[0.0])
    assert all(not n.endswith(".bias") and "norm" not in n for n in groups[0.05])
    assert "encoder.patch_embed.proj.weight" in groups[0.05]


def test_per_group_lr_scales_hold_through_warmup_cosine_and_resume(tmp_path):
    import torch

    from geofm.training.engine import init_distributed, initialize, load_checkpoint, save_checkpoint

    init_distributed()
    train = _train(epochs=4, micro_batch_size=2, base_lr=1e-3, lr_reference_batch=2, warmup_epochs=1, min_lr_ratio=0.1)
    schedule = make_schedule(train, samples_per_epoch=6, world_size=1)

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        groups = [
            {"params": list(model[0].parameters()), "weight_decay": 0.0, "lr_scale": 0.25},
            {"params": list(model[1].parameters()), "weight_decay": 0.05},
        ]
        return initialize(model, train, 1, schedule, param_groups=groups)

    first = engine()
    peaks = []
    for step in range(schedule.total_steps):
        loss = first(torch.randn(2, 3)).sum()
        first.backward(loss)
        first.step()
        low, high = first.get_lr()
        assert low == pytest.approx(0.25 * high), f"step {step + 1}: the group scale is lost ({low} vs {high})"
        assert high == pytest.approx(1e-3 * first.lr_scheduler.get_lr_ratio()), (
            "the unscaled group follows the schedule"
        )
        peaks.append(high)
        if step + 1 == 6:
            save_checkpoint(first, tmp_path, "mid", {"step": 6})
    assert peaks[0] < peaks[1] < peaks[2] and peaks[-1] == pytest.approx(1e-4), "warmup, then cosine to min_lr_ratio"

    resumed = engine()
    load_checkpoint(resumed, tmp_path, "mid")
    low, high = resumed.get_lr()
    assert (low, high) == pytest.approx((0.25 * peaks[5], peaks[5])), "a resumed scheduler keeps each group's own lr"


def test_one_process_engine_uses_fused_adamw_and_skips_the_gradient_all_reduce(tiny_swin):
    from geofm.training.engine import initialize

    assert fused_adamw() is True
    engine = initialize(MaskedImageModel(tiny_swin(3), in_chans=3), _train(), 1, None, 1e-3)
    assert all(group["fused"] for group in engine.optimizer.param_groups), "AdamW is not the fused kernel"
    assert engine.enable_backward_allreduce is False, "one process still flattens and all-reduces every gradient"


@pytest.mark.slow
def test_compiled_engine_computes_the_same_losses_and_saves_plain_keys(tiny_swin, monkeypatch, tmp_path):
    import torch

    from geofm.tasks.mim.masking import MaskGenerator
    from geofm.training import engine as ds

    monkeypatch.setattr(ds, "COMPILE_BACKEND", "eager")  # dynamo's tracing without code generation: fast on CPU
    torch.manual_seed(0)
    state = MaskedImageModel(tiny_swin(3), in_chans=3).state_dict()
    masks = MaskGenerator(64, 16, 4, 0.6)
    images, mask = torch.randn(2, 3, 64, 64), torch.stack([masks() for _ in range(2)])
    losses = []
    for compile_model in (False, True):
        model = MaskedImageModel(tiny_swin(3), in_chans=3)
        model.load_state_dict(state)
        engine = ds.initialize(model, _train(compile=compile_model), 1, None, 1e-3)
        assert engine.is_compiled == compile_model, "train.compile did not decide whether the engine compiles"
        for _ in range(2):
            loss = engine(images, mask)["loss"]
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    assert abs(losses[0] - losses[1]) < 1e-5, f"compiled {losses[1]} vs eager {losses[0]}"
    ds.save_checkpoint(engine, tmp_path, "t", {})
    saved = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert not any("_orig_mod" in key for key in saved), "a compiled run's checkpoint keys are not the module's"


def test_bf16_engine_trains_a_swin_with_its_buffers_in_bf16(tiny_swin):
    """bf16 as GPUs run it (forced here on a CPU): Swin's attention mask must follow the weights into bf16."""
    import torch

    from geofm.tasks.mim.masking import MaskGenerator
    from geofm.training import engine as ds

    model = MaskedImageModel(tiny_swin(3, img_size=128), in_chans=3)  # stage 3 (8 x 8) has shifted windows
    engine = ds.initialize(model, _train(precision="bf16"), 1, None, 1e-3)
    masks = [b for name, b in engine.module.named_buffers() if name.endswith("attn_mask") and b is not None]
    assert masks and all(b.dtype == torch.bfloat16 for b in masks), "the shifted windows' masks stayed fp32"
    generator = MaskGenerator(128, 16, 4, 0.6)
    loss = engine(torch.randn(2, 3, 128, 128, dtype=torch.bfloat16), torch.stack([generator() for _ in range(2)]))[
        "loss"
    ]
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)


def test_a_group_of_one_gives_deepspeed_its_local_rank_again_after_a_federated_run_hid_it(monkeypatch):
    """A simulation hides the process group's variables from its processes while it runs in this one;
    its server's finetuning (FedDiff's classifier) then builds an engine in the group formed before."""
    from geofm.training.engine import init_distributed

    assert init_distributed()[1] == 1
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert init_distributed() == (0, 1)
    assert os.environ["LOCAL_RANK"] == "0"
