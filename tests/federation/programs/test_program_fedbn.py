"""FedBN in federated pretraining: the Swin's LayerNorms stay on each institution under a 1-bit uplink."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from federation.programs.server import FederatedServer
from geofm.checkpoints.io import DEEPSPEED_MODEL_STATES
from geofm.config.federated import FederatedConfig
from geofm.errors import ConfigError
from tests.federation.programs.test_program import _rounds, _run

pytestmark = pytest.mark.slow

FEDBN = {
    "name": "fedbn",
    "options": {},
    "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": True},
}
INSTITUTIONS = ("aerial_rgb", "satellite_4band", "uav_rgbn")


def test_fedbn_pretrains_with_local_layer_norms_through_a_1_bit_uplink(fed_tree):
    run_dir = _run(fed_tree("fedbn", algorithm=FEDBN, federation={"rounds": 2}))
    rounds = _rounds(run_dir)
    assert [r["clients"] for r in rounds] == [list(INSTITUTIONS)] * 2
    assert all(np.isfinite(r["loss"]) for r in rounds)
    states = {}
    for name in INSTITUTIONS:
        with np.load(run_dir / f"clients/{name}/state_round_000002.npz") as state:
            states[name] = {key: state[key] for key in state.files}
        assert {"local", "feedback.update.error", "feedback.norms.error"} <= set(states[name])
        assert "local_statistics" not in states[name], "a Swin holds no batch norm"
    norms = [states[name]["local"] for name in INSTITUTIONS]
    assert not np.allclose(norms[0], norms[1]) and not np.allclose(norms[1], norms[2])
    last = sorted((run_dir / "checkpoints").glob(f"*/{DEEPSPEED_MODEL_STATES}"))[-1]
    server = torch.load(last, map_location="cpu", weights_only=False)["server"]
    kept = server["algorithm"]["state"]["norms"]
    assert kept.numel() == norms[0].size, "the server keeps the clients' mean norms for its own model"


def test_fedbn_refuses_layers_batchnorm_for_a_model_without_batch_norm(fed_tree):
    cfg = FederatedConfig.from_tree(fed_tree("x", algorithm={**FEDBN, "options": {"layers": "batchnorm"}}))
    with pytest.raises(ConfigError, match="no such normalisation parameters"):
        FederatedServer(cfg)
