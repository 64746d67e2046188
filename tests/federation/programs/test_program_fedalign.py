"""FedAlign in federated pretraining: masked image modelling matches the encoder's final stage at two widths."""

from __future__ import annotations

import math

import pytest

from tests.federation.programs.test_program import _rounds, _run

pytestmark = pytest.mark.slow

FEDALIGN = {"name": "fedalign", "options": {}}


def test_fedalign_pretrains_a_swin_encoder(fed_tree):
    rounds = _rounds(_run(fed_tree("fedalign", algorithm=FEDALIGN, federation={"rounds": 2})))
    assert [r["clients"] for r in rounds] == [["aerial_rgb", "satellite_4band", "uav_rgbn"]] * 2
    assert all(math.isfinite(r["loss"]) and 0 < r["lipschitz_loss"] < math.inf for r in rounds)
