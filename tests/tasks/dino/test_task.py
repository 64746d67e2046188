"""DINO as a pretraining task: its config rules, and federated runs of the shipped configs with FedAvg, FedSense
and the federated self-supervised baselines (FedEMA, L-DAWA, FedU², FedMKD)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from geofm.config import PretrainConfig
from geofm.config.federated import read_federated_config
from geofm.errors import ConfigError

REPO = Path(__file__).parents[3]
CENTRAL = REPO / "configs/pretrain/demo_dino_swin_micro__img64_win4__4band.yaml"
FEDAVG = REPO / "configs/federated/demo_dino_fedavg_swin_micro__3inst.yaml"
FEDSENSE = REPO / "configs/federated/demo_dino_fedsense_swin_micro__3inst__1bit_ef.yaml"
BASELINES = {
    name: REPO / f"configs/federated/demo_dino_{name}_swin_micro__3inst.yaml"
    for name in ("fedema", "ldawa", "fedu2", "fedmkd")
}
"""Each baseline's metric in ``rounds.jsonl`` in round 2, the sign that its own part ran."""
BASELINE_METRICS = {"fedema": "ema_mu", "ldawa": "layer_cosine", "fedu2": "uniformity_loss", "fedmkd": "loss_distill"}
TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}
TINY_HEAD = {"out_dim": 64, "hidden_dim": 32, "bottleneck_dim": 16, "local_views": 2, "local_size": 16}


def shrunk(path: Path, archive: dict[str, Path], out: Path) -> dict:
    """A shipped DINO config at 32 px with a tiny Swin and head, reading this test's archive."""
    tree = yaml.safe_load(path.read_text())
    tree["run"] = {**tree["run"], "output_dir": str(out), "progress": False}
    tree["model"].update(img_size=32, timm_kwargs=TINY_SWIN)
    tree["task_options"] = {**tree["task_options"], **TINY_HEAD}
    for source in tree["data"]["sources"]:
        source["root"] = str(archive[source["name"]])
    tree["train"]["micro_batch_size"] = 4
    return tree


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"task_options": {"out_dims": 8}}, "task_options.out_dims: unknown key (did you mean out_dim?)"),
        ({"task_options": {"global_views": 1, "local_views": 0}}, "global_views + local_views must be at least 2"),
        ({"task_options": {"local_scale": [0.5, 0.1]}}, "local_scale [0.5, 0.1] must be 0 < low <= high <= 1"),
        ({"task_options": {"local_size": 30}}, "must be multiples of the backbone's patch size 4"),
        ({"task_options": {"masking": {"mask_ratio": 0.5}}}, "task_options.masking: unknown key"),
        (
            {"task_options": {"teacher": {"arch": "swin_tiny_patch4_window7_224", "checkpoint": "t.pth"}}},
            "task_options.teacher: unknown key (did you mean teacher_temp",
        ),
        ({"masking": {"mask_ratio": 0.5}}, "masking: unknown key"),
        ({"task": "segmentation"}, "task 'segmentation' is not a pretraining objective"),
        ({"task": "dinov9"}, "dinov9"),
    ],
)
def test_a_dino_config_is_refused_naming_the_field(changes, message):
    tree = {**yaml.safe_load(CENTRAL.read_text()), **changes}
    with pytest.raises(ConfigError) as err:
        PretrainConfig.from_tree(tree, "dino.yaml")
    assert message in str(err.value) and "dino.yaml" in str(err.value)


def test_masked_image_modelling_takes_its_own_options_only():
    tree = yaml.safe_load((REPO / "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml").read_text())
    with pytest.raises(ConfigError, match=r"task_options\.out_dim: unknown key"):
        PretrainConfig.from_tree({**tree, "task_options": {**tree["task_options"], "out_dim": 8}})


@pytest.mark.slow
@pytest.mark.parametrize("config", [FEDAVG, FEDSENSE], ids=["fedavg", "fedsense"])
def test_federated_dino_trains_exports_and_its_backbone_loads_in_timm(config, archive, tmp_path):
    import timm
    from safetensors.torch import load_file

    from federation.runtime.inprocess import run_in_process

    tree = shrunk(config, archive, tmp_path / "run")
    tree["train"].update(local_epochs=None, local_steps=2)
    tree["federation"]["rounds"] = 2
    if "options" in tree["algorithm"]:
        tree["algorithm"]["options"].update(distill_steps=1, distill_batch_size=4)
    run_dir = run_in_process(read_federated_config(tree, config.name))

    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["loss"] > 0 and 0.5 < r["teacher_entropy"] < math.log(64) for r in rounds), "no collapse"
    if "fedsense" in config.name:
        assert all("loss_similarity" in r for r in rounds)  # the server's distillation ran on DINO's encoder
    sidecar = json.loads((run_dir / "backbone.json").read_text())
    assert sidecar["method"] == "dino" and sidecar["teacher"] is None
    model = timm.create_model(sidecar["arch"], pretrained=False, **sidecar["timm_kwargs"])
    model.load_state_dict(load_file(run_dir / "backbone.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BASELINES))
def test_each_federated_self_supervised_baseline_runs_its_dino_demo_for_two_rounds(name, archive, tmp_path):
    from federation.runtime.inprocess import run_in_process

    tree = shrunk(BASELINES[name], archive, tmp_path / "run")
    tree["train"].update(local_epochs=None, local_steps=2)
    tree["federation"]["rounds"] = 2
    if name == "fedmkd":
        tree["algorithm"]["options"].update(distill_steps=1, distill_batch_size=4)
    run_dir = run_in_process(read_federated_config(tree, BASELINES[name].name))

    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rounds)
    assert math.isfinite(rounds[-1][BASELINE_METRICS[name]])
    assert (run_dir / "backbone.safetensors").is_file()


@pytest.fixture
def dino_tree(archive, tmp_path):
    """The shipped central DINO config shrunk: 32 px, a tiny Swin and head, 2 epochs of 4 steps."""

    def make(name: str, **run) -> dict:
        tree = shrunk(CENTRAL, archive, tmp_path / name)
        tree["run"].update(log_every=1, checkpoint_every=4, **run)
        tree["data"].update(num_workers=0, samples_per_epoch=16)
        tree["train"].update(epochs=2, warmup_epochs=0.5)
        return tree

    return make


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.slow
def test_central_dino_resumes_as_an_uninterrupted_run_and_exports_the_teacher_to_timm(dino_tree):
    import timm
    import torch
    from safetensors.torch import load_file

    from pretrain.central import pretrain

    straight = pretrain(PretrainConfig.from_tree(dino_tree("straight")))
    pretrain(PretrainConfig.from_tree(dino_tree("resumed", stop_after_steps=5)))
    resumed = pretrain(PretrainConfig.from_tree(dino_tree("resumed")))
    a, b = _losses(straight), _losses(resumed)
    assert [s for s, _ in b] == list(range(1, 9))
    assert [loss for _, loss in a] == pytest.approx([loss for _, loss in b], rel=1e-5)
    exported = load_file(straight / "backbone.safetensors")
    again = load_file(resumed / "backbone.safetensors")
    assert all(torch.allclose(exported[k], again[k], atol=1e-6) for k in exported)

    sidecar = json.loads((straight / "backbone.json").read_text())
    assert sidecar["method"] == "dino" and sidecar["config"]["task"] == "dino"
    model = timm.create_model(sidecar["arch"], pretrained=False, **sidecar["timm_kwargs"])
    model.load_state_dict(exported)
    state = torch.load(straight / "checkpoints/last/mp_rank_00_model_states.pt", weights_only=False)
    student = {k.removeprefix("encoder."): v for k, v in state["module"].items() if k.startswith("encoder.")}
    teacher = state["task"]["teacher"]
    assert all(torch.equal(exported[k], teacher[f"network.encoder.{k}"]) for k in exported), "the teacher's backbone"
    assert any(not torch.allclose(exported[k], student[k].float()) for k in exported), "not the student's"


@pytest.mark.slow
def test_a_killed_dino_run_resumes_from_its_last_checkpoint(dino_tree, killed_then_resumed):
    # 240 steps: the run cannot end before the kill that follows its first checkpoint, however fast
    tree = dino_tree("killed")
    tree["train"]["epochs"] = 60
    killed_then_resumed(tree, more=3)


@pytest.mark.slow
def test_central_dino_trains_a_vit_on_its_class_token_and_exports_it(dino_tree):
    import timm
    from safetensors.torch import load_file

    from pretrain.central import pretrain

    tree = dino_tree("vit")
    tree["model"] = {
        "arch": "vit_tiny_patch16_224",
        "img_size": 32,
        "timm_kwargs": {"embed_dim": 32, "depth": 2, "num_heads": 2},
    }
    tree["train"]["epochs"] = 1
    run_dir = pretrain(PretrainConfig.from_tree(tree))
    assert [s for s, _ in _losses(run_dir)] == list(range(1, 5))
    sidecar = json.loads((run_dir / "backbone.json").read_text())
    model = timm.create_model(sidecar["arch"], pretrained=False, **sidecar["timm_kwargs"])
    model.load_state_dict(load_file(run_dir / "backbone.safetensors"))
    assert "dynamic_img_size" not in sidecar["timm_kwargs"], "the export records the plain backbone's arguments"


def test_the_centre_starts_as_the_teachers_mean_output_on_the_first_batch(dino_tree):
    import torch

    from geofm.tasks.dino.task import SelfDistillation

    task = SelfDistillation(PretrainConfig.from_tree(dino_tree("centre")))
    model = task.build_model()
    task.prepare(model)
    torch.manual_seed(0)
    batch = {"global": torch.randn(3, 2, 4, 32, 32), "local": torch.randn(3, 2, 4, 16, 16)}
    task.forward(model, batch)
    teacher = task.teacher(list(batch["global"].unbind(1)))
    assert torch.allclose(task.centre, teacher.mean(dim=0), atol=1e-6)
    task.after_step(model, 0.5)  # then m c + (1 - m) mean, the paper's update
    assert torch.allclose(task.centre, teacher.mean(dim=0), atol=1e-6), "the same batch's mean leaves it"
