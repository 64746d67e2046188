"""The DINO framework of ``geofm bench fed-benefit``: FedSense's Table 1 at the benchmark's scale.

FedSense's paper compares, on DINO, SSL-FL (FedAvg around DINO), FedEMA, L-DAWA, FedU², FedMKD and
FedSense. Here each is an arm ``dino:<algorithm>`` on the SimMIM arms' institutions, budget, seeds and
downstream protocol, next to ``dino:central`` (the institutions pooled, as ``central``): only the
objective changes. DINO's ``task_options`` are the demo's
(``configs/federated/demo_dino_fedavg_swin_micro__3inst.yaml``), its local crops scaled with the chip
(half the chip's side, as the demo's 32 of 64); each algorithm's section is its demo config's.
"""

from __future__ import annotations

import functools
from typing import Any

from benchmarks.common import repo_path

ALGORITHMS = ("fedavg", "fedema", "ldawa", "fedu2", "fedmkd", "fedsense")
"""SSL-FL (FedAvg around DINO), the four federated self-supervised baselines, FedSense."""
ARMS = ["dino:central", *(f"dino:{name}" for name in ALGORITHMS)]
BASELINES = ("dino:fedema", "dino:ldawa", "dino:fedu2", "dino:fedmkd")
"""The baselines each claimed above SSL-FL (``dino:fedavg``), and FedSense above each of them."""


@functools.cache
def demo_config(algorithm: str) -> dict[str, Any]:
    """The DINO demo config of ``algorithm`` (``configs/federated/demo_dino_<name>_swin_micro__3inst*.yaml``)."""
    import yaml

    suffix = "__1bit_ef" if algorithm == "fedsense" else ""
    return yaml.safe_load(
        repo_path(f"configs/federated/demo_dino_{algorithm}_swin_micro__3inst{suffix}.yaml").read_text()
    )


def algorithm_section(arm: str) -> dict[str, Any]:
    """The ``algorithm`` section of the federated arm ``dino:<name>``: its demo config's."""
    return dict(demo_config(arm.removeprefix("dino:"))["algorithm"])


def task_options(chip_size: int) -> dict[str, Any]:
    """The demo's DINO options, the local crops' side scaled from the demo's input to ``chip_size``."""
    demo = demo_config("fedavg")
    options = dict(demo["task_options"])
    options["local_size"] = options["local_size"] * chip_size // demo["model"]["img_size"]
    return options


def dino(tree: dict[str, Any], chip_size: int) -> dict[str, Any]:
    """A SimMIM arm's config ``tree`` with DINO as its objective instead (DINO's options for SimMIM's masking)."""
    return {**tree, "task": "dino", "task_options": task_options(chip_size)}
