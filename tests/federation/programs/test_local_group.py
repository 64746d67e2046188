"""Clients trained data-parallel over two processes of their node (gloo on a CPU), against one process
at the same global batch: FedSense pretraining with its error feedback, and a server killed mid-round."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file

from federation.deploy.nodeworker import NodeWorker
from federation.programs.client import FederatedClient
from federation.programs.localgroup import LocalGroup
from federation.programs.server import FederatedServer
from federation.runtime.contract import config_entry
from federation.runtime.inprocess import InProcess
from federation.runtime.roundloop import run_server
from geofm.config.federated import FederatedConfig
from geofm.errors import ConfigError
from tests.federation.programs.test_program import _Killed, _KilledInRound, _rounds, _run

pytestmark = pytest.mark.slow

# 8-bit uplinks with error feedback: a residual to compare, without 1-bit signs that float rounding flips.
EIGHT_BIT = {"uplink": {"bits": 8, "bucket_size": 512, "error_feedback": True, "stochastic": False}}
TWO = {"federation": {"rounds": 2, "local_processes": 2}, "train": {"micro_batch_size": 2}}


def _institutions(tree: dict, *names: str) -> dict:
    """``tree`` with only these institutions beside the server's public source (one: no K-means groups)."""
    tree["data"]["sources"] = [s for s in tree["data"]["sources"] if s["name"] in (*names, "public_rgb")]
    tree["federation"]["min_clients"] = len(names)
    if len(names) == 1:
        tree["algorithm"]["options"]["clusters"] = None
    return tree


def same_run(one, two, weights: str, state: str, rel: float, same_lr: bool = True) -> None:
    """Two runs' rounds, exported weights and a client's state agree within ``rel``; the second ran on 2 processes."""
    a, b = _rounds(one), _rounds(two)
    assert [r["local_world_size"] for r in b] == [dict.fromkeys(r["clients"], 2) for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert rb["lr"] == ra["lr"] or not same_lr, "the learning rate scales with the global batch, which is the same"
        assert rb["loss"] == pytest.approx(ra["loss"], rel=rel), f"round {ra['round']}"
    wa, wb = load_file(one / weights), load_file(two / weights)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=rel, atol=rel, msg=key)
    with np.load(one / state) as sa, np.load(two / state) as sb:
        assert sorted(sa.files) == sorted(sb.files)
        for key in sa.files:
            # AdamW turns a gradient that is float noise (a parameter the batch hardly touches) into a whole
            # step of either sign; SCAFFOLD's control variate divides that by K x lr. A few such elements aside,
            # the state is the same.
            apart = ~np.isclose(sb[key], sa[key], rtol=rel, atol=rel)
            assert apart.mean() < 1e-3, f"{key}: {apart.sum()} of {apart.size} elements differ"


def test_fedsense_pretraining_on_two_processes_per_client_equals_one_process(fed_tree):
    """1 process x 4 images a step against 2 x 2, two institutions; the second round starts every rank
    from the global model."""
    pair = ("satellite_4band", "uav_rgbn")
    one = _run(_institutions(fed_tree("one", federation={"rounds": 2}, algorithm=EIGHT_BIT), *pair))
    assert [r["local_world_size"] for r in _rounds(one)] == [dict.fromkeys(r["clients"], 1) for r in _rounds(one)]
    two = _run(_institutions(fed_tree("two", algorithm=EIGHT_BIT, **TWO), *pair))
    same_run(one, two, "backbone.safetensors", "clients/uav_rgbn/state_round_000002.npz", 1e-3)


def test_a_server_killed_in_round_2_resumes_two_process_clients_to_the_unbroken_result(fed_tree):
    unbroken = _run(fed_tree("straight", **TWO))
    tree = fed_tree("killed", **TWO)
    cfg = FederatedConfig.from_tree(tree)
    clients = {i + 1: FederatedClient(cfg, {"institution": client}) for i, client in enumerate(cfg.client_names)}
    with pytest.raises(_Killed):
        run_server(FederatedServer(cfg), _KilledInRound(clients, 2), poll_s=0)
    resumed = _run(tree)  # the clients' round-1 states, kept by rank 0 of each
    for a, b in zip(_rounds(unbroken), _rounds(resumed), strict=True):
        assert a["loss"] == b["loss"], f"round {a['round']}"
    wa, wb = load_file(unbroken / "backbone.safetensors"), load_file(resumed / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


class _Watched(InProcess):
    """Nodes answered by their workers; after each round, the training processes each worker holds."""

    def __init__(self, workers: dict[int, NodeWorker]) -> None:
        super().__init__(workers)
        self.groups: list[dict[int, list[int]]] = []

    def exchange(self, kind, rnd, payloads, timeout_s):
        answered = super().exchange(kind, rnd, payloads, timeout_s)
        if kind == "train":
            self.groups.append({node: _ranks(worker) for node, worker in self.clients.items()})
        return answered


def _ranks(worker: NodeWorker) -> list[int]:
    """The pids of the training processes a node's worker started."""
    (process,) = (p for p in psutil.process_iter(["cmdline"]) if str(worker.address) in (p.info["cmdline"] or []))
    return sorted(child.pid for child in process.children() if "federation.programs.localgroup" in child.cmdline())


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_deployed_nodes_worker_trains_on_its_local_processes_and_keeps_them_across_rounds(fed_tree):
    tree = _institutions(fed_tree("deployed", **TWO), "uav_rgbn")
    tree["federation"]["local_processes"] = 1  # the node's own local-processes says 2, and scales its rate
    cfg = FederatedConfig.from_tree(tree)
    supernode = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])  # stands in for it
    try:
        run_config = {"program": "geofm", "config": config_entry(tree)}
        workers = {
            i + 1: NodeWorker(7, run_config, {"institution": name, "local-processes": 2}, supernode_pid=supernode.pid)
            for i, name in enumerate(cfg.client_names)
        }
        transport = _Watched(workers)
        run_server(FederatedServer(cfg), transport, poll_s=0)
        first, second = transport.groups
        assert all(len(ranks) == 2 for ranks in first.values()) and second == first, "one group a node, kept"
    finally:
        supernode.kill()
        supernode.wait()
    simulated = _run(_institutions(fed_tree("simulated", **TWO), "uav_rgbn"))
    state = "clients/uav_rgbn/state_round_000002.npz"
    same_run(simulated, cfg.run.output_dir, "backbone.safetensors", state, 1e-6, same_lr=False)
    ranks = [pid for group in first.values() for pid in group]
    while any(map(_running, ranks)):
        time.sleep(0.1)  # the workers see their SuperNode gone and exit; their ranks see their sockets close


def test_an_error_in_a_rank_reaches_the_client_and_ends_the_group(fed_tree):
    group = LocalGroup(2)
    cfg = FederatedConfig.from_tree(fed_tree("error"))
    with pytest.raises(ConfigError, match="'nobody' is not a client of this federation") as raised:
        group.train(FederatedClient, cfg, {"institution": "nobody"}, {}, {"round": 1, "lr": 1e-3}, {})
    assert "of the node's training processes" in "".join(raised.value.__notes__)
    assert all(process.poll() is not None for process, _ in group.members), "every rank was ended"


@pytest.mark.parametrize("value", [0, "two"])
def test_a_nodes_local_processes_must_be_a_positive_whole_number(fed_tree, value):
    cfg = FederatedConfig.from_tree(fed_tree("bad"))
    with pytest.raises(ConfigError, match=f"node config local-processes={value!r}: expected a positive whole number"):
        FederatedClient(cfg, {"institution": "uav_rgbn", "local-processes": value})
