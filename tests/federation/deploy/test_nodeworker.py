"""A deployed node's worker process: one client program for every message of a run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from federation.deploy.nodeworker import NodeWorker

pytestmark = pytest.mark.slow


def test_a_node_worker_keeps_the_client_program_between_messages_and_ends_with_its_supernode(
    toy_run_config, toy_pythonpath, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", toy_pythonpath)
    supernode = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])  # stands in for it
    try:
        worker = NodeWorker(1, toy_run_config({"fail": "a@3"}), {"institution": "a"}, supernode_pid=supernode.pid)
        assert worker.identity() == {"client": "a", "num_examples": 10}
        header = {"header": np.array([1, 1], dtype=np.int64)}
        _, first, state = worker.train(header, {"round": 1}, {})
        upload, second, state = worker.train(header, {"round": 2}, state)
        assert second["count"] == 2 and upload["bits"].dtype == np.uint8, "state and arrays travel both ways"
        assert first["pid"] == second["pid"] != os.getpid(), "one worker process answers every message"
        with pytest.raises(RuntimeError, match="toy failure of a in round 3") as raised:
            worker.train(header, {"round": 3}, state)
        assert "in the node's worker process" in "".join(raised.value.__notes__)
        other = NodeWorker(2, toy_run_config(), {"institution": "a"}, supernode_pid=supernode.pid)
        assert other.train(header, {"round": 1}, {})[1]["pid"] != first["pid"], "another run, another worker"
    finally:
        supernode.kill()
        supernode.wait()
    while worker.address.exists() or other.address.exists():  # the workers see their SuperNode gone and exit
        time.sleep(0.1)


def test_a_supernode_stopped_with_sigterm_leaves_no_worker_files(tmp_path, toy_run_config, toy_pythonpath):
    """`geofm fed supernode` ends what its SuperNode started when it is sent SIGTERM; the node's worker
    still removes its socket, key and lock file."""
    fake = tmp_path / "bin" / "flower-supernode"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, time\n"
        "from federation.deploy.nodeworker import NodeWorker\n"
        "subprocess.Popen(['sleep', '600'])  # a SuperExec: it outlives its SuperNode, holding the output\n"
        f"worker = NodeWorker(1, {toy_run_config()!r}, {{'institution': 'a'}}, supernode_pid=os.getpid())\n"
        "worker.identity()\n"
        "print(worker.address, flush=True)\n"
        "time.sleep(900)\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "PYTHONPATH": toy_pythonpath}
    command = [sys.executable, "-m", "geofm.cli", "fed", "supernode", "--retry-activation-s", "0", "--"]
    node = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        address = Path(node.stdout.readline().strip())  # the worker answered: it listens
        assert address.suffix == ".sock" and address.exists()
        node.send_signal(signal.SIGTERM)
    finally:
        node.wait()
        node.stdout.close()
    left = [path for path in (address, address.with_suffix(".key"), address.with_suffix(".lock")) if path.exists()]
    assert not left, f"the worker's files outlived its SuperNode: {left}"
