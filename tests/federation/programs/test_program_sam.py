"""SAM-family algorithms in federated pretraining (masked image modelling): FedSAM, FedASAM and FedSense with
SAM local steps for a round each (FedGloSS resumes after a kill in test_program_killed.py)."""

from __future__ import annotations

import math

import pytest

from tests.federation.programs.test_program import _rounds, _run

pytestmark = pytest.mark.slow

NO_FEDSENSE = {"options": {}}


def test_sam_family_algorithms_pretrain(fed_tree):
    for algorithm in (
        {"name": "fedsam", **NO_FEDSENSE},
        {"name": "fedasam", **NO_FEDSENSE},
        {"name": "fedsense", "sam": {"rho": 0.05}},  # drift perturbation outside, SAM inside
    ):
        rounds = _rounds(_run(fed_tree(algorithm["name"], algorithm=algorithm, federation={"rounds": 1})))
        assert rounds[0]["clients"] == ["aerial_rgb", "satellite_4band", "uav_rgbn"]
        assert math.isfinite(rounds[0]["loss"]), algorithm
