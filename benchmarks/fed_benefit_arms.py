"""The config trees of ``geofm bench fed-benefit``'s pretraining arms (:func:`arm_tree`): central, federated
(FedAvg and FedSense as the demo runs them), GFM's continual pretraining, and the DINO framework's arms."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import fed_benefit_dino as fed_dino
from benchmarks import pretrain_benefit as benefit

FEDERATED_ARMS: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "fedavg", "uplink": {"bits": 32}},
    "fedavg_1bit": {"name": "fedavg", "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": False}},
    "fedsense": {},
    "fedsense_no_scg": {"options": {"perturbation_radius": 0.0}},
    "fedsense_no_csg": {
        "options": {"clusters": None, "distill_steps": 0},
        "uplink": {"bits": 32, "error_feedback": False},
    },
    "fedsense_no_distill": {"options": {"distill_steps": 0}},
}
"""Each federated arm's ``algorithm`` section, over :data:`FEDSENSE` (FedAvg arms replace it)."""
FEDSENSE: dict[str, Any] = {
    "name": "fedsense",
    "options": {
        "perturbation_radius": 0.05,
        "clusters": 2,
        "distill_steps": 2,
        "distill_lr": 1.0e-4,
        "distill_batch_size": 8,
    },
    "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": True},
}
"""The demo's FedSense (configs/federated/demo_fedsense_swin_micro__s2_l8_real__1bit_ef.yaml)."""
MIXES = ("pooled", "federated")


def central_tree(
    settings: dict[str, Any], sources: list[dict[str, Any]], budget: int, out: Path, mix: str = "pooled"
) -> dict[str, Any]:
    """Central SimMIM on ``sources`` pooled, ``budget`` steps: 10 epochs (fewer for a tiny budget) whose
    chips make ``budget`` batches in all, the first epoch a warm-up. ``mix``: ``pooled`` keeps the
    sources' weights (their chips), ``federated`` draws each source equally often."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; the mixes are {', '.join(MIXES)}")
    if mix == "federated":
        sources = [{**s, "weight": 1.0} for s in sources]
    epochs = min(10, budget)
    run = {**settings, "pretrain_epochs": epochs, "pretrain_samples": budget * settings["pretrain_batch"] // epochs}
    tree = benefit.pretrain_tree(run, sources, out)
    tree["train"]["warmup_epochs"] = 1.0
    return tree


def federated_tree(
    settings: dict[str, Any], sources: list[dict[str, Any]], public: dict[str, Any], arm: str, budget: int, out: Path
) -> dict[str, Any]:
    """The federated arm ``arm`` over ``sources`` (one institution each), ``budget`` local steps in all."""
    clients = len(sources)
    rounds = max(1, budget // (clients * settings["local_steps"]))
    tree = central_tree(settings, [*sources, public], budget, out)
    del tree["data"]["samples_per_epoch"]
    algorithm = algorithm_section(arm)
    tree["train"] = {
        "micro_batch_size": settings["pretrain_batch"],
        "base_lr": settings["pretrain_lr"],
        "lr_reference_batch": settings["pretrain_batch"],
        "weight_decay": 0.05,
        "local_epochs": None,
        "local_steps": settings["local_steps"],
        "lr_schedule": "cosine",
        "warmup_rounds": rounds // 10,
    }
    tree["federation"] = {
        "rounds": rounds,
        "partition": "by_source",
        "public_sources": [public["name"]],
        "min_clients": clients,
    }
    tree["algorithm"] = algorithm
    return tree


def algorithm_section(arm: str) -> dict[str, Any]:
    """The ``algorithm`` section of the federated arm ``arm``: a DINO arm's demo config's, else
    :data:`FEDERATED_ARMS`'s over :data:`FEDSENSE` (FedAvg arms replace it)."""
    if arm.startswith("dino:"):
        return fed_dino.algorithm_section(arm)
    overrides = FEDERATED_ARMS[arm]
    if overrides.get("name") == "fedavg":
        return overrides
    return {**FEDSENSE, **overrides, "options": {**FEDSENSE["options"], **overrides.get("options", {})}}


def continual(tree: dict[str, Any], settings: dict[str, Any], released: Path) -> dict[str, Any]:
    """``tree`` as GFM's continual pretraining: the student starts from ``released``, its frozen teacher
    (stage 3 with its patch merging, GFM's tap), whose features the student distils."""
    teacher = {**benefit.backbone_tree(settings, settings["chip_size"]), "checkpoint": str(released), "stage": 3}
    return {
        **tree,
        "model": {**tree["model"], "init_checkpoint": str(released)},
        "task_options": {**tree.get("task_options", {}), "teacher": teacher},
    }


def arm_tree(settings, sources, public, arm: str, budget: int, out: Path, seed: int, released: Path | None):
    """The config tree of pretraining arm ``arm`` (not ``random`` nor ``released``) with ``seed``."""
    base, _, variant = arm.removesuffix("_continual").partition(":")
    if base == "dino":  # pooled (dino:central) or federated, DINO the objective
        if variant == "central":
            tree = central_tree(settings, sources, budget, out)
        else:
            tree = federated_tree(settings, sources, public, arm, budget, out)
        tree = fed_dino.dino(tree, settings["chip_size"])
    elif base in FEDERATED_ARMS:
        tree = federated_tree(settings, sources, public, base, budget, out)
    else:  # central (its variant the mix) or an institution alone (its variant the institution)
        tree = central_tree(settings, sources, budget, out, variant if base == "central" and variant else "pooled")
    tree["run"]["seed"] = seed
    return continual(tree, settings, released) if arm.endswith("_continual") else tree
