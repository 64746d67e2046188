"""Federated finetuning with SCAFFOLD (control variates on both sides) on two processes per client, against
one process at the same global batch."""

from __future__ import annotations

import pytest

from tests.federation.programs.test_local_group import same_run
from tests.finetune.test_federated import _federated, _run

pytestmark = pytest.mark.slow


def test_scaffold_finetuning_on_two_processes_per_client_equals_one_process(class_folders, finetune_tree, tmp_path):
    def tree(name: str, processes: int) -> dict:
        # No random crop, flip or drop path: each sample's view is the same whichever process reads it.
        data = {"root": str(class_folders), "crop_scale": [1.0, 1.0], "hflip": False, "vflip": False}
        base = finetune_tree("classification", tmp_path / name, data=data, model={"drop_path_rate": 0.0})
        tree = {**_federated(base, local_processes=processes), "algorithm": {"name": "scaffold"}}
        tree["train"]["micro_batch_size"] = 4 // processes
        return tree

    one, two = _run(tree("one", 1)), _run(tree("two", 2))
    same_run(one, two, "best/model.safetensors", "clients/client01/state_round_000002.npz", 1e-3)
