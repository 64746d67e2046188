"""Issue 18's algorithms in federated pretraining: a server killed mid-round resumes to the unbroken result.

The server dies in round 2 after every client trained and kept its round-2 state, before it
aggregates; the rerun must use the clients' round-1 states and the server's round-1 checkpoint
(FedGloSS's duals and pseudo-gradient, the privacy accountant and the 1-bit residuals). The
algorithms whose clients keep no state of their own resume from the server's checkpoint alone, as
their stop-after-round-1 tests show.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from federation.programs.client import FederatedClient
from federation.programs.server import FederatedServer
from federation.runtime.roundloop import run_server
from geofm.config.federated import FederatedConfig
from tests.federation.programs.test_program import _Killed, _KilledInRound, _rounds, _run

pytestmark = pytest.mark.slow

PLAIN = {"options": {}}
ONE_BIT = {"bits": 1, "bucket_size": 512, "error_feedback": True}
ALGORITHMS = {
    "fedgloss": {"name": "fedgloss", **PLAIN, "options": {"rho": 0.05, "beta": 5.0}, "sam": {"rho": 0.05}},
    "central_privacy_1bit": {
        "name": "fedavg",
        **PLAIN,
        "uplink": ONE_BIT,
        "privacy": {"mode": "central", "clip": 0.5, "noise_multiplier": 0.1, "seed": 3},
    },
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_server_killed_in_round_2_resumes_to_the_unbroken_runs_losses_and_weights(fed_tree, name):
    algorithm = ALGORITHMS[name]
    straight = _rounds(unbroken := _run(fed_tree(f"{name}_straight", algorithm=algorithm, federation={"rounds": 2})))
    tree = fed_tree(f"{name}_killed", algorithm=algorithm, federation={"rounds": 2})
    cfg = FederatedConfig.from_tree(tree)
    clients = {i + 1: FederatedClient(cfg, {"institution": client}) for i, client in enumerate(cfg.client_names)}
    with pytest.raises(_Killed):
        run_server(FederatedServer(cfg), _KilledInRound(clients, 2), poll_s=0)
    assert [r["round"] for r in _rounds(cfg.run.output_dir)] == [1]
    resumed = _run(tree)  # fresh client programs: their round-2 states are newer than the server's checkpoint
    logged = [key for key in ("loss", "sigma_norm", "epsilon") if key in straight[0]]
    assert "loss" in logged and len(logged) > 1, f"{name} logs its own figures"
    for a, b in zip(straight, _rounds(resumed), strict=True):
        assert {k: a[k] for k in logged} == {k: b[k] for k in logged}, f"round {a['round']}"
    wa, wb = load_file(unbroken / "backbone.safetensors"), load_file(resumed / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run exports the same weights"
    state = "clients/uav_rgbn/state_round_000002.npz"
    with np.load(unbroken / state) as a, np.load(resumed / state) as b:
        assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
