"""A real deployment on this machine: SuperLink and SuperNodes with TLS and SuperNode authentication."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import toy_federated_program as toy
from safetensors.torch import load_file

from federation.cli import BUILT_IN
from federation.deploy.commands import COMPLETED, register_nodes
from federation.deploy.local import LocalDeployment
from federation.flower.simulation import simulate
from federation.runtime.contract import CONFIG, INSTITUTIONS, PROGRAM, config_entry

pytestmark = pytest.mark.slow


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if os.path.exists(f"/proc/{pid}")}


def test_deployment_with_tls_and_node_auth_runs_rounds_keeps_state_and_refuses_unregistered_nodes(
    tmp_path, toy_run_config, toy_pythonpath
):
    records = tmp_path / "records.jsonl"
    with LocalDeployment(tmp_path / "fed", ["a", "b"], env={"PYTHONPATH": toy_pythonpath}) as deployment:
        run_id = deployment.launch(toy_run_config({"rounds": 2, "min_clients": 2, "expected_clients": 2}))
        deployment.start_supernode("intruder", retry_activation_s=0)
        assert deployment.wait_for_exit("intruder") != 0, "a SuperNode whose key was never registered must not stay up"
        run = deployment.wait(run_id)
        assert run["status"] == COMPLETED, f"run {run_id} ended {run['status']}:\n{deployment.logs(run_id)}"
        seen = deployment.process_ids()
        superlink_log = deployment.processes["superlink"].text()
        intruder_log = deployment.processes["intruder"].text()
        failed = deployment.launch(toy_run_config({"rounds": 1, "round_timeout_s": -1}))
        failed_run = deployment.wait(failed)
        failed_log = deployment.logs(failed)
        started = {process.popen.pid for process in deployment.processes.values()}
    assert "Failed to activate SuperNode" in intruder_log, intruder_log
    assert "No SuperNode found with the given public key" in superlink_log, "the SuperLink refused the unknown key"
    assert "Receiving:" not in intruder_log, "the unregistered SuperNode never received a message"
    *rounds, end = toy.read_records(records)
    assert [r["round"] for r in rounds] == [1, 2] and end["finished"], rounds
    for record in rounds:
        assert set(record["replies"]) == {"a", "b"}, f"round {record['round']} heard {set(record['replies'])}"
        for name, reply in record["replies"].items():
            assert reply["count"] == record["round"], f"{name}'s state did not carry over between ClientApp processes"
            assert reply["bits_dtype"] == "uint8" and reply["bits"] == toy.expected_bits(reply["count"]), reply
    assert failed_run["status"] == "finished:failed", f"a ServerApp error must fail the run: {failed_run}"
    assert "round_timeout_s=-1" in failed_log, f"the program's error is in the run's log:\n{failed_log}"
    assert seen >= started - {deployment.processes["intruder"].popen.pid}, (
        "the process scan finds every started process"
    )
    assert len(seen) > len(started), "and the processes they started (SuperExec, ServerApp...)"
    assert not _alive(seen | started) and not deployment.process_ids(), f"left running: {_alive(seen | started)}"
    startup = sorted(reply["process_age_s"] for record in rounds for reply in record["replies"].values())
    print(f"ClientApp process start-up before train(): {', '.join(f'{s:.2f}' for s in startup)} s")


# SCAFFOLD: two payloads each way, the control variates kept in each node's state between rounds.
SCAFFOLD = {"name": "scaffold", "options": {}}


@pytest.mark.parametrize("algorithm", [{}, SCAFFOLD], ids=["fedsense", "scaffold"])
def test_a_deployed_run_trains_each_institution_on_the_data_its_node_config_names(
    tmp_path, fed_tree, archive, one_torch_thread, algorithm
):
    """The real program on a real deployment: the config travels in the run config, data roots in node configs.

    With one thread per process both ways, the deployed run ends with the very model a simulation of
    the same config gives.
    """
    tree = fed_tree("deployed", federation={"rounds": 2}, algorithm=algorithm)
    tree["data"]["sources"] = [s for s in tree["data"]["sources"] if s["name"] != "uav_rgbn"]
    for source in tree["data"]["sources"][:2]:
        source["root"] = f"/nonexistent/{source['name']}"  # only each SuperNode's data-root knows the way
    run_config = {PROGRAM: BUILT_IN, CONFIG: config_entry(tree)}
    roots = {name: str(archive[name]) for name in ("aerial_rgb", "satellite_4band")}
    threads = {"OMP_NUM_THREADS": "1"}  # as Ray gives each simulated node
    with LocalDeployment(tmp_path / "fed", list(roots), data_roots=roots, env=threads) as deployment:
        run_id = deployment.launch(run_config)
        run = deployment.wait(run_id)
        log = deployment.logs(run_id)
    assert run["status"] == COMPLETED, f"run {run_id} ended {run['status']}:\n{log}"
    assert "round 2/2: loss" in log and "KiB" in log, f"the deployed log shows each round as simulation does:\n{log}"
    rounds = [json.loads(line) for line in (tmp_path / "deployed/rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and all(r["clients"] == sorted(roots) for r in rounds)
    assert json.loads((tmp_path / "deployed/backbone.json").read_text())["federation"]["uplink_bits"] == 1

    simulated = copy.deepcopy(tree)
    simulated["run"]["output_dir"] = str(tmp_path / "simulated")
    for source in simulated["data"]["sources"][:2]:
        source["root"] = roots[source["name"]]
    simulate({PROGRAM: BUILT_IN, CONFIG: config_entry(simulated), INSTITUTIONS: ",".join(sorted(roots))}, num_cpus=2)
    deployed, simulated = (load_file(tmp_path / name / "backbone.safetensors") for name in ("deployed", "simulated"))
    assert all(torch.equal(deployed[k], simulated[k]) for k in deployed), "deployed and simulated: the same model"


def test_a_supernode_killed_mid_round_without_a_timeout_leaves_the_run_to_finish_with_the_others(
    tmp_path, toy_run_config, toy_pythonpath
):
    records = tmp_path / "records.jsonl"
    hung = tmp_path / "records.jsonl.hang.c"
    config = {"rounds": 3, "min_clients": 2, "expected_clients": 3, "round_timeout_s": None, "hang": "c@2"}
    with LocalDeployment(tmp_path / "fed", ["a", "b", "c"], env={"PYTHONPATH": toy_pythonpath}) as deployment:
        run_id = deployment.launch(toy_run_config(config))
        deployment.wait_for_file(hung, "c")  # c is inside round 2
        deployment.kill("c")
        run = deployment.wait(run_id)
        log = deployment.logs(run_id)
        again = register_nodes(deployment.files)
    assert run["status"] == COMPLETED, f"run {run_id} ended {run['status']}:\n{log}"
    *rounds, end = toy.read_records(records)
    assert [r["round"] for r in rounds] == [1, 2, 3] and end["finished"], rounds
    assert set(rounds[0]["replies"]) == {"a", "b", "c"}
    assert set(rounds[1]["replies"]) == {"a", "b"} and set(rounds[1]["failures"]) == {"c"}, rounds[1]
    assert set(rounds[2]["replies"]) == {"a", "b"}, "the dead node is no longer selected"
    assert again == dict.fromkeys("abc", "already registered"), "registering again is harmless"


def test_a_supernode_restarted_right_after_a_kill_keeps_trying_until_the_superlink_takes_it(tmp_path, toy_pythonpath):
    """The SuperLink counts a killed node online for two missed heartbeats and refuses its restart meanwhile;
    `geofm fed supernode` starts it again (ending what each refused start left) until it is taken."""
    with LocalDeployment(tmp_path / "fed", ["a"], env={"PYTHONPATH": toy_pythonpath}) as deployment:
        node_id = deployment.node_ids["a"]
        deployment.kill("a")
        deployment.start_supernode("a")
        deployment.wait_for_log("a", "starting again in")  # refused at first
        deployment.wait_for_log("a", f"SuperNode ID: {node_id}", count=2)  # then taken, as the same node
        text = deployment.processes["a"].text()
        seen = deployment.process_ids()
    assert "Connection attempt failed" not in text, "no SuperExec left retrying for a refused start"
    assert seen, "the restarted SuperNode runs"
