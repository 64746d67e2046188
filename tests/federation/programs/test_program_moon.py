"""MOON in federated pretraining: masked image modelling contrasts the encoder's representations."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from federation.programs.server import FederatedServer
from geofm.config.federated import FederatedConfig
from tests.federation.programs.test_program import _rounds, _run

pytestmark = pytest.mark.slow

MOON = {"name": "moon", "options": {}}


def test_moon_pretrains_and_keeps_each_clients_previous_encoder(fed_tree):
    tree = fed_tree("moon", algorithm=MOON, federation={"rounds": 2})
    run_dir = _run(tree)
    rounds = _rounds(run_dir)
    assert [r["clients"] for r in rounds] == [["aerial_rgb", "satellite_4band", "uav_rgbn"]] * 2
    assert all(math.isfinite(r["loss"]) for r in rounds)
    # Round 1: no previous encoders, the global one stands in and l_con = log 2. Round 2: each client's own.
    assert rounds[0]["contrastive_loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert rounds[1]["contrastive_loss"] != pytest.approx(math.log(2), rel=1e-5)
    layout = FederatedServer(FederatedConfig.from_tree(fed_tree("x", algorithm=MOON))).layout
    encoder = sum(size for name, size in zip(layout.names, layout.sizes, strict=True) if name.startswith("encoder."))
    with np.load(Path(run_dir) / "clients/uav_rgbn/state_round_000002.npz") as state:
        assert state["moon.previous"].shape == (encoder,)


def test_a_moon_pretraining_run_stopped_after_round_1_resumes_to_the_same_result(fed_tree):
    straight = _rounds(_run(fed_tree("straight", algorithm=MOON, federation={"rounds": 2})))
    _run(fed_tree("resumed", algorithm=MOON, federation={"rounds": 2, "stop_after_rounds": 1}))
    resumed = _rounds(_run(fed_tree("resumed", algorithm=MOON, federation={"rounds": 2})))
    assert [r["round"] for r in resumed] == [1, 2]
    for a, b in zip(straight, resumed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["contrastive_loss"] == pytest.approx(b["contrastive_loss"], rel=1e-5)
