"""Client-level differential privacy in federated pretraining (FedSense program, masked image modelling)."""

from __future__ import annotations

import math

import pytest
from opacus.accountants import RDPAccountant

from federation.programs.client import FederatedClient
from federation.programs.server import FederatedServer
from federation.runtime.inprocess import InProcess
from federation.runtime.roundloop import run_server
from geofm.config.federated import FederatedConfig
from tests.federation.conftest import fedsense_options
from tests.federation.programs.test_program import _rounds, _run

pytestmark = pytest.mark.slow


def _epsilon(z: float, steps: int) -> float:
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=z, sample_rate=1.0)
    return accountant.get_epsilon(1e-5)


def test_central_dp_moves_the_global_model_by_the_noise_of_the_clipped_mean(fed_tree):
    """2 rounds, 3 clients, S = 1e-3, z = 1: each round moves the model by a clipped mean (norm <= S) plus
    noise of std z S / 3 on each of d values, whose norm is about z S sqrt(d) / 3; two rounds: sqrt(2) times it."""
    privacy = {"mode": "central", "clip": 1e-3, "noise_multiplier": 1.0, "seed": 5}
    options = fedsense_options(distill_steps=0, clusters=None)
    algorithm = {"options": options, "privacy": privacy}  # FedSense, 1-bit uploads with feedback
    tree = fed_tree("central", algorithm=algorithm, federation={"rounds": 2})
    cfg = FederatedConfig.from_tree(tree)
    server = FederatedServer(cfg)
    start = server.global_model.clone()
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(server, InProcess(clients), poll_s=0)
    rounds = _rounds(cfg.run.output_dir)
    assert [r["epsilon"] for r in rounds] == pytest.approx([_epsilon(1.0, 1), _epsilon(1.0, 2)], rel=1e-9)
    assert all(len(r["clients"]) == 3 and math.isfinite(r["loss"]) for r in rounds)
    moved = float((server.global_model - start).norm())
    noise = math.sqrt(2) * 1e-3 * math.sqrt(start.numel()) / 3
    assert moved == pytest.approx(noise, rel=0.05)


def test_local_dp_pretrains_with_fedsense_clustering_and_distillation(fed_tree):
    """The demo's FedSense (perturbed steps, 1-bit uploads with feedback, K-means, distillation) on noisy updates."""
    privacy = {"mode": "local", "clip": 1e-3, "noise_multiplier": 0.5}
    tree = fed_tree(
        "local", algorithm={"options": fedsense_options(distill_steps=1), "privacy": privacy}, federation={"rounds": 1}
    )
    (record,) = _rounds(_run(tree))
    assert record["epsilon"] == pytest.approx(_epsilon(0.5, 1), rel=1e-9) and record["delta"] == 1e-5
    assert len(record["clients"]) == 3 and math.isfinite(record["loss"]) and math.isfinite(record["loss_similarity"])
