"""FedNova and FedDC in federated pretraining (GFM on three institutions' archives): 1-bit uplinks with error
feedback on every payload, and a run stopped after round 1 that resumes to the same result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.federation.programs.test_program import _rounds, _run

pytestmark = pytest.mark.slow

# The demo's FedSense fields cleared; its 1-bit uplink with error feedback kept for every payload.
PLAIN = {"options": {}}
ALGORITHMS = {
    "fednova": ({**PLAIN, "name": "fednova"}, "tau_eff", {"feedback.update.error"}),
    "feddc": (
        {**PLAIN, "name": "feddc", "options": {"alpha": 0.01}},
        "drift_norm",
        {"drift", "control", "feedback.update.error", "feedback.delta_c.error"},
    ),
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_pretraining_runs_through_1bit_uplinks_and_resumes_after_a_stop_to_the_same_result(name, fed_tree):
    algorithm, metric, state_keys = ALGORITHMS[name]
    straight = _run(fed_tree("straight", algorithm=algorithm, federation={"rounds": 2}))
    rounds = _rounds(straight)
    assert [r["clients"] for r in rounds] == [["aerial_rgb", "satellite_4band", "uav_rgbn"]] * 2
    assert all(r[metric] > 0 for r in rounds)
    if name == "fednova":  # every institution takes train.local_steps = 2 steps
        assert [r["tau_eff"] for r in rounds] == [2.0, 2.0]
    with np.load(straight / "clients/uav_rgbn/state_round_000002.npz") as state:
        assert state_keys <= set(state.files)

    stopped = _run(fed_tree("resumed", algorithm=algorithm, federation={"rounds": 2, "stop_after_rounds": 1}))
    assert [r["round"] for r in _rounds(stopped)] == [1]
    resumed = _run(fed_tree("resumed", algorithm=algorithm, federation={"rounds": 2}))
    for a, b in zip(rounds, _rounds(resumed), strict=True):
        assert a["loss"] == b["loss"] and a[metric] == b[metric], f"round {a['round']}"
    wa, wb = load_file(straight / "backbone.safetensors"), load_file(resumed / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run ends with the same weights"
