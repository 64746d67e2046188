"""SAM-family algorithms in federated pretraining (masked image modelling): FedSAM, FedASAM and FedSense with
SAM local steps for a round each, and a FedGloSS run stopped after round 1 that resumes to the same result."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.federation.test_program import _rounds, _run

NO_FEDSENSE = {"perturbation_radius": 0.0, "clusters": None, "distill_steps": 0}
FEDGLOSS = {"name": "fedgloss", **NO_FEDSENSE}


def test_sam_family_algorithms_pretrain(fed_tree):
    for algorithm in (
        {"name": "fedsam", **NO_FEDSENSE},
        {"name": "fedasam", **NO_FEDSENSE},
        {"name": "fedsense", "sam": {"rho": 0.05}},  # drift perturbation outside, SAM inside
    ):
        rounds = _rounds(_run(fed_tree(algorithm["name"], algorithm=algorithm, federation={"rounds": 1})))
        assert rounds[0]["clients"] == ["aerial_rgb", "satellite_4band", "uav_rgbn"]
        assert math.isfinite(rounds[0]["loss"]), algorithm


def test_a_fedgloss_pretraining_run_stopped_after_round_1_resumes_to_the_same_result(fed_tree):
    """The server's dual and pseudo-gradient come back from its checkpoint, the clients' duals from their states."""
    straight_dir = _run(fed_tree("straight", algorithm=FEDGLOSS, federation={"rounds": 2}))
    _run(fed_tree("resumed", algorithm=FEDGLOSS, federation={"rounds": 2, "stop_after_rounds": 1}))
    resumed_dir = _run(fed_tree("resumed", algorithm=FEDGLOSS, federation={"rounds": 2}))
    straight, resumed = _rounds(straight_dir), _rounds(resumed_dir)
    assert [r["round"] for r in resumed] == [1, 2]
    for a, b in zip(straight, resumed, strict=True):
        assert math.isfinite(a["loss"]) and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["sigma_norm"] > 0 and a["sigma_norm"] == pytest.approx(b["sigma_norm"], rel=1e-5)
    state = "clients/uav_rgbn/state_round_000002.npz"
    with np.load(straight_dir / state) as a, np.load(resumed_dir / state) as b:
        np.testing.assert_allclose(a["dual"], b["dual"], rtol=1e-5, atol=1e-7)
