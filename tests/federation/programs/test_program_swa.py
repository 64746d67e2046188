"""SWA and WiMA in federated pretraining: the exported backbone is the average of the server's encoders."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from geofm.checkpoints.io import DEEPSPEED_MODEL_STATES
from tests.federation.programs.test_program import _rounds, _run

pytestmark = pytest.mark.slow

PLAIN = {"options": {}}
SWA = {"name": "swa", **PLAIN, "options": {"start": 1, "cycle": 1, "lr_max": 1.0, "lr_min": 0.5}}
WIMA = {"name": "wima", **PLAIN, "options": {"window": 2, "blocks": 2}}


@pytest.mark.parametrize("algorithm", [SWA, WIMA], ids=["swa", "wima"])
def test_pretraining_exports_the_mean_of_the_rounds_encoders(fed_tree, algorithm):
    run_dir = _run(fed_tree(algorithm["name"], algorithm=algorithm, federation={"rounds": 2}))
    rounds = _rounds(run_dir)
    if algorithm is SWA:
        assert [(r["server_lr"], r["swa_models"]) for r in rounds] == [(0.5, 1.0), (0.5, 2.0)]
    else:
        assert [r["wima_models"] for r in rounds] == [1.0, 2.0]
    # The training encoder after each round, as checkpointed; the export is their mean (x1 + x2) / 2.
    paths = sorted((run_dir / "checkpoints").glob(f"round_*/{DEEPSPEED_MODEL_STATES}"))
    x1, x2 = (torch.load(path, weights_only=True)["module"] for path in paths)
    exported = load_file(run_dir / "backbone.safetensors")
    trained = [k for k in exported if k in {n.removeprefix("encoder.") for n in x1 if not torch.equal(x1[n], x2[n])}]
    assert trained, "the rounds moved the encoder"
    for key in trained:
        torch.testing.assert_close(exported[key], (x1[f"encoder.{key}"] + x2[f"encoder.{key}"]) / 2)
