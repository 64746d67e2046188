"""FedAlign in federated finetuning: classification with a resume after round 1, and segmentation."""

from __future__ import annotations

import math

import pytest

from tests.finetune.test_federated import _federated, _resumes_like_unbroken, _rounds, _run

pytestmark = pytest.mark.slow


def test_a_fedalign_classifier_stopped_after_round_1_resumes_to_the_same_result(class_folders, finetune_tree, tmp_path):
    """Each round logs the clients' mean L_reg; FedAlign keeps no state, so the resumed run is the unbroken one."""

    def tree(name: str, **federation) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {**_federated(base, **federation), "algorithm": {"name": "fedalign"}}

    _, a, b = _resumes_like_unbroken(tree)
    assert [r["round"] for r in b] == [1, 2]
    for ra, rb in zip(a, b, strict=True):
        assert 0 < ra["lipschitz_loss"] < math.inf and ra["lipschitz_loss"] == rb["lipschitz_loss"]


def test_fedalign_finetunes_a_segmenter(random_datasets, finetune_tree, tmp_path):
    """A dense head reads the backbone through forward_intermediates: the hooks see its final stage all the same."""
    base = finetune_tree("segmentation", tmp_path / "seg")
    rounds = _rounds(_run({**_federated(base), "algorithm": {"name": "fedalign", "options": {"mu": 1.0}}}))
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(math.isfinite(r["loss"]) and 0 < r["lipschitz_loss"] < math.inf for r in rounds)
