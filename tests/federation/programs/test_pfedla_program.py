"""pFedLA in federated pretraining: three institutions pretrain under 1-bit uploads with error feedback,
the server exports the clients' data-weighted mean model, and a stopped run resumes to the same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.federation.programs.test_program import _rounds, _run

pytestmark = pytest.mark.slow

PFEDLA = {
    "name": "pfedla",
    "options": {"embedding_dim": 8, "hidden_dim": 8, "layers": "stage"},
    "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": True},
}


def test_pfedla_pretrains_federated_and_resumes_to_the_same_weights(fed_tree):
    straight = _run(fed_tree("straight", algorithm=PFEDLA, federation={"rounds": 2}))
    rounds = _rounds(straight)
    assert [r["clients"] for r in rounds] == [["aerial_rgb", "satellite_4band", "uav_rgbn"]] * 2
    # "stage" layers: the patch embedding's projection and norm, 4 stages, the final norm, the mask token,
    # the decoder and the distillation projector
    assert all(r["layers"] == 10 and 0 < r["self_weight"] < 1 for r in rounds)

    _run(fed_tree("resumed", algorithm=PFEDLA, federation={"rounds": 2, "stop_after_rounds": 1}))
    assert [r["round"] for r in _rounds(straight.parent / "resumed")] == [1]
    resumed = _run(fed_tree("resumed", algorithm=PFEDLA, federation={"rounds": 2}))
    for a, b in zip(rounds, _rounds(resumed), strict=True):
        assert a["loss"] == b["loss"] and a["self_weight"] == b["self_weight"], f"round {a['round']}"
    wa, wb = load_file(straight / "backbone.safetensors"), load_file(resumed / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run ends with the same weights"
