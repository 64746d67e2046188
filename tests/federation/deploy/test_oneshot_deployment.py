"""The one-shot programs (FedDiff, OSCAR, ensemble distillation) on a real deployment on this machine: SuperLink and SuperNodes with
TLS and node authentication.

Deployment start-up dominates (about 100 s on two loaded cores).
"""

from __future__ import annotations

import json

import pytest

from federation.deploy.commands import COMPLETED
from federation.deploy.local import LocalDeployment
from federation.runtime.contract import CONFIG, PROGRAM, config_entry
from geofm.config.ensemble import EnsembleConfig
from geofm.config.feddiff import FedDiffConfig
from geofm.config.oscar import OscarConfig

pytestmark = pytest.mark.slow  # a loopback deployment with TLS: over a minute

PROGRAMS = {
    "feddiff": ("feddiff_tree", FedDiffConfig),
    "oscar": ("oscar_tree", OscarConfig),
    "ensemble": ("ensemble_tree", EnsembleConfig),
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_deployed_one_shot_round_takes_each_institution_on_its_own_data_root(
    program, request, class_folders, tmp_path
):
    """SuperLink and SuperNodes on this machine (TLS, node authentication): each node uploads from the whole
    train split of its data-root, and the server ends with the classifier on the real test split."""
    fixture, config = PROGRAMS[program]
    tree = request.getfixturevalue(fixture)(tmp_path / "deployed")
    names = config.from_tree(tree).client_names
    roots = dict.fromkeys(names, str(class_folders))
    with LocalDeployment(tmp_path / "fed", names, data_roots=roots, env={"OMP_NUM_THREADS": "1"}) as deployment:
        run_id = deployment.launch({PROGRAM: program, CONFIG: config_entry(tree)})
        run = deployment.wait(run_id)
        log = deployment.logs(run_id)
    assert run["status"] == COMPLETED, f"run {run_id} ended {run['status']}:\n{log}"
    (record,) = [json.loads(line) for line in (tmp_path / "deployed/rounds.jsonl").read_text().splitlines()]
    assert record["num_examples"] == dict.fromkeys(names, 24), "each node: all of its own train split"
    assert "uploaded" in log and json.loads((tmp_path / "deployed/classifier/eval.json").read_text())["split"] == "test"
