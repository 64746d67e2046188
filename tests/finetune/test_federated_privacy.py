"""Client-level differential privacy in federated finetuning: central and local, 1-bit uploads, resume, refusals."""

from __future__ import annotations

import pytest
from opacus.accountants import RDPAccountant

from geofm.config.federated import read_federated_config
from geofm.errors import ConfigError
from tests.finetune.test_federated import _federated, _resumes_like_unbroken, _rounds, _run

pytestmark = pytest.mark.slow

ONE_BIT = {"bits": 1, "error_feedback": True}


def _epsilon(z: float, q: float, steps: int, delta: float = 1e-5) -> float:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=z, sample_rate=q)
    return accountant.get_epsilon(delta)


def test_a_stopped_central_dp_finetune_with_1bit_uploads_resumes_to_the_same_losses_and_epsilon(
    class_folders, finetune_tree, tmp_path
):
    """The seeded server noise and the accountant come back after the stop; epsilon is Opacus's at q = 1."""
    privacy = {"mode": "central", "clip": 0.05, "noise_multiplier": 1.0, "seed": 3}

    def tree(name: str, **federation) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {
            **_federated(base, **federation),
            "algorithm": {"name": "fedavg", "uplink": ONE_BIT, "privacy": privacy},
        }

    _, straight, resumed = _resumes_like_unbroken(tree)
    for k, (a, b) in enumerate(zip(straight, resumed, strict=True), 1):
        assert a["epsilon"] == b["epsilon"] == pytest.approx(_epsilon(1.0, 1.0, k), rel=1e-9)
        assert a["delta"] == 1e-5


def test_local_dp_finetune_logs_the_most_spent_clients_epsilon(class_folders, finetune_tree, tmp_path):
    """One of two clients per round: each composes over the rounds it uploaded in, at sample rate 1."""
    base = finetune_tree("classification", tmp_path / "local", data={"root": str(class_folders)})
    privacy = {"mode": "local", "clip": 0.05, "noise_multiplier": 2.0, "delta": 1e-6}
    tree = {
        **_federated(base, rounds=3, fraction=0.5),
        "algorithm": {"name": "fedprox", "options": {"proximal_beta": 0.01}},
    }
    rounds = _rounds(_run({**tree, "algorithm": {**tree["algorithm"], "uplink": ONE_BIT, "privacy": privacy}}))
    uploads: dict[str, int] = {}
    for record in rounds:
        assert len(record["clients"]) == 1
        uploads[record["clients"][0]] = uploads.get(record["clients"][0], 0) + 1
        assert record["epsilon"] == pytest.approx(_epsilon(2.0, 1.0, max(uploads.values()), 1e-6), rel=1e-9)


def test_central_dp_refuses_a_robust_aggregator_in_a_finetuning_config(class_folders, finetune_tree, tmp_path):
    base = finetune_tree("classification", tmp_path / "r", data={"root": str(class_folders)})
    algorithm = {
        "name": "fedavg",
        "aggregator": {"name": "median"},
        "privacy": {"mode": "central", "clip": 1.0, "noise_multiplier": 1.0},
    }
    with pytest.raises(ConfigError, match=r"algorithm\.aggregator: central privacy calibrates its noise"):
        read_federated_config({**_federated(base), "algorithm": algorithm})


def test_privacy_refuses_a_segmenter_whose_batch_norm_statistics_would_travel(random_datasets, finetune_tree, tmp_path):
    tree = _federated(finetune_tree("segmentation", tmp_path / "seg"))
    privacy = {"mode": "local", "clip": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(ConfigError, match=r"algorithm\.privacy: the model has batch-norm layers"):
        _run({**tree, "algorithm": {"name": "fedavg", "privacy": privacy}})
