"""The Flower adapter: payload records, the shipped Flower App, and whole runs in Flower's simulation engine."""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import toy_federated_program as toy
import yaml

from federation.deploy.commands import APP_DIR
from federation.flower.adapter import GridTransport, from_array_record, to_array_record, to_config_record
from federation.flower.simulation import simulate
from federation.runtime.contract import INSTITUTION, PROGRAMS, RUN_CONFIG_DEFAULTS
from geofm.errors import ConfigError, FederatedRunError
from tests.federation.conftest import geofm_stderr_lines

pytestmark = pytest.mark.slow


def test_array_records_keep_dtype_shape_and_bits_exactly():
    arrays = {
        "bits": np.array([[0, 1, 127], [128, 254, 255]], dtype=np.uint8),
        "weights": np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)[::2],
        "header": np.array(7, dtype=np.int64),
    }
    back = from_array_record(to_array_record(arrays, "test"))
    assert back.keys() == arrays.keys()
    for key, value in arrays.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        assert np.array_equal(back[key], value), f"{key} changed on the way: {back[key]} != {value}"
    with pytest.raises(FederatedRunError, match=r"upload\['x'\]: expected a numpy array, got list"):
        to_array_record({"x": [1, 2]}, "upload")
    metrics = to_config_record({"loss": np.float32(0.5), "n": np.int64(3), "ok": True}, "metrics")
    assert metrics == {"loss": 0.5, "n": 3, "ok": True} and type(metrics["n"]) is int, (
        "numpy scalars become Python ones"
    )
    with pytest.raises(FederatedRunError, match="metrics: values must be bool, int, float, str"):
        to_config_record({"x": {"nested": 1}}, "metrics")


def test_flower_app_names_the_adapter_components_and_declares_every_run_config_key():
    app = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["config"] == RUN_CONFIG_DEFAULTS, "flwr run refuses overrides of keys the App does not declare"
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    for name, kind in (("serverapp", ServerApp), ("clientapp", ClientApp)):
        module, attribute = app["components"][name].split(":")
        assert isinstance(getattr(importlib.import_module(module), attribute), kind)
    assert "geofm" in PROGRAMS


def test_simulation_rounds_keep_bits_and_client_state_and_go_on_past_a_failing_client(tmp_path, toy_run_config):
    run_config = toy_run_config(
        {"rounds": 3, "min_clients": 2, "expected_clients": 3, "fail": "b@2"}, institutions="a,b,c"
    )
    simulate(run_config, num_cpus=2)
    *rounds, end = toy.read_records(tmp_path / "records.jsonl")
    assert [r["round"] for r in rounds] == [1, 2, 3] and end["finished"], f"3 rounds then finish: {[*rounds, end]}"
    assert set(rounds[0]["replies"]) == set(rounds[2]["replies"]) == {"a", "b", "c"}, "rounds 1 and 3 hear every node"
    assert set(rounds[1]["replies"]) == {"a", "c"}, "round 2 goes on without the failing client"
    assert "b: RuntimeError: toy failure of b in round 2" in rounds[1]["failures"]["b"], rounds[1]["failures"]
    counts = {r["round"]: {name: reply["count"] for name, reply in r["replies"].items()} for r in rounds}
    assert counts == {1: dict(a=1, b=1, c=1), 2: dict(a=2, c=2), 3: dict(a=3, b=2, c=3)}, (
        f"per-client state counts the rounds a client completed: {counts}"
    )
    for record in rounds:
        for name, reply in record["replies"].items():
            assert reply["bits_dtype"] == "uint8" and reply["bits"] == toy.expected_bits(reply["count"]), (name, reply)
            assert reply["value_dtype"] == "float32" and reply["value"] == [0.5 * reply["count"]] * 3, (name, reply)
            assert reply["header"] == f"[{record['round']}, 3]", "the server's int64 header reached the client"


def test_simulation_below_min_clients_fails_with_a_clear_error(tmp_path, toy_run_config):
    run_config = toy_run_config(
        {"rounds": 2, "min_clients": 3, "expected_clients": 3, "round_retries": 1, "fail": "c@2"}, institutions="a,b,c"
    )
    expected = r"round 2: fewer than min_clients=3 replies in each of 2 attempts .*c: RuntimeError: toy failure"
    with pytest.raises(FederatedRunError, match=expected):
        simulate(run_config, num_cpus=2)
    assert [r["round"] for r in toy.read_records(tmp_path / "records.jsonl")] == [1], "nothing aggregated after round 1"


def test_simulation_checks_its_arguments_before_starting(toy_run_config):
    with pytest.raises(ConfigError, match="give one node per institution"):
        simulate(toy_run_config(institutions="a,b"), num_nodes=3)
    with pytest.raises(ConfigError, match=r"unknown keys \['rounds'\]"):
        simulate({**toy_run_config(), "rounds": 2}, num_nodes=1)
    with pytest.raises(ConfigError, match="unknown federated program 'nope'"):
        simulate({**toy_run_config(), "program": "nope"}, num_nodes=1)
    with pytest.raises(ConfigError, match="run config 'client-factory': nodes no longer import factories by path"):
        simulate({**toy_run_config(), "client-factory": "toy_federated_program:make_client"}, num_nodes=1)


@pytest.mark.parametrize(
    "failure, one_line",
    [("bad_input", True), ("fail", False)],
    ids=["bad input: one line naming the file", "a bug: with its traceback"],
)
@pytest.mark.parametrize("node_worker", [False, True], ids=["in process", "in the node's worker"])
def test_a_failing_client_replies_with_an_error_and_logs_bad_input_in_one_line(
    toy_run_config, toy_pythonpath, caplog, monkeypatch, failure, one_line, node_worker
):
    from flwr.app import ConfigRecord, Context, Message, MessageType, Metadata, RecordDict

    from federation.flower.adapter import ARRAYS, SCALARS, _client_reply

    run_config = toy_run_config({failure: "b@1"})
    context = Context(run_id=1, node_id=7, node_config={INSTITUTION: "b"}, state=RecordDict(), run_config=run_config)
    arrays, scalars = to_array_record({"header": np.zeros(2, np.int64)}, "arrays"), ConfigRecord({"round": 1})
    metadata = Metadata(  # as a SuperNode receives it (built by hand: Message() alone needs a running app)
        run_id=1,
        message_id="m1",
        src_node_id=0,
        dst_node_id=7,
        reply_to_message_id="",
        group_id="",
        created_at=0.0,
        ttl=60.0,
        message_type=MessageType.TRAIN,
    )
    message = Message(RecordDict({ARRAYS: arrays, SCALARS: scalars}), metadata=metadata)
    supernode = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])  # the worker's watch
    monkeypatch.setenv("PYTHONPATH", toy_pythonpath)
    monkeypatch.setattr("federation.flower.adapter.os.getppid", lambda: supernode.pid)
    try:
        with caplog.at_level("INFO", logger="federation"):
            reply = _client_reply(message, context, {}, node_worker)
    finally:
        supernode.kill()
        supernode.wait()
    assert reply.has_error(), "the failure travels back as an error reply"
    expected = "b: GeoFMError: data/b/scene_000.tif" if one_line else "b: RuntimeError: toy failure of b in round 1"
    assert reply.error.reason.startswith(expected), reply.error.reason
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert ("scene_000.tif" in record.getMessage()) == one_line, record.getMessage()
    assert (not record.exc_info) == one_line, "a traceback only for what is not bad input"


class _GridWithADeadNode:
    """Answers node 2, reports node 3 gone as the SuperLink does (its own id as the sender), never answers node 4."""

    SUPERLINK = 1

    def push_messages(self, messages):
        self.sent = {f"m{number}": message for number, message in enumerate(messages)}
        return list(self.sent)

    def pull_messages(self, message_ids):
        def reply(message_id, src, error=None, content=None):
            metadata = SimpleNamespace(src_node_id=src, reply_to_message_id=message_id)
            return SimpleNamespace(metadata=metadata, error=error, content=content, has_error=lambda: error is not None)

        by_node = {m.metadata.dst_node_id: message_id for message_id, m in self.sent.items()}
        gone = SimpleNamespace(code=5, reason="node unavailable")
        content = {
            "arrays": to_array_record({"w": np.ones(2, np.float32)}, "reply"),
            "scalars": to_config_record({}, "reply"),
        }
        replies = [reply(by_node[3], self.SUPERLINK, error=gone), reply(by_node[2], 2, content=content)]
        return [r for r in replies if r.metadata.reply_to_message_id in message_ids]


def test_a_node_the_superlink_reports_gone_fails_alone_and_a_silent_one_after_the_wait(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity  # what a ServerApp process sets before it sends

    for key, value in {"_run_id": 7, "_task_id": 1, "_node_id": 1}.items():
        monkeypatch.setattr(TaskIdentity, key, value)
    transport = GridTransport(_GridWithADeadNode())
    payloads = {node: ({"w": np.zeros(2, np.float32)}, {"round": 1}) for node in (2, 3, 4)}
    replies, failures = transport.exchange("train", 1, payloads, 0.5)
    assert [r.node_id for r in replies] == [2]
    reasons = {f.node_id: f.reason for f in failures}
    assert reasons[3] == "node unavailable (node unavailable)", "matched to node 3 by the message it replies to"
    assert reasons[4].startswith("no reply (waited at most 0.5 s"), reasons


def _hung_toy_simulation(tmp_path: Path, toy_pythonpath: str, **popen) -> tuple[subprocess.Popen, Path, Path, dict]:
    """``geofm fed simulate`` of the toy program with b hanging in round 2, once round 2 runs: the process,
    its records file, its own temporary folder and Ray's processes (pid -> start time)."""
    import tempfile
    import time

    from federation.flower.simulation import SIMULATION_MARKER
    from federation.runtime.processes import start_time

    short_tmp = Path(tempfile.mkdtemp(prefix="gt", dir="/tmp"))  # Ray's socket paths must stay short
    out = tmp_path / "records.jsonl"
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({"rounds": 3, "out": str(out), "hang": "b@2", "round_timeout_s": 600.0}))
    command = [sys.executable, "-m", "geofm.cli", "fed", "simulate", "--config", str(config), "--program", "toy"]
    env = {**os.environ, "PYTHONPATH": toy_pythonpath, "TMPDIR": str(short_tmp)}
    main = subprocess.Popen([*command, "--institutions", "a,b", "--num-cpus", "2"], env=env, **popen)
    hung = Path(f"{out}.hang.b")
    while not hung.exists():  # round 1 is logged and round 2 is running: b never answers
        if main.poll() is not None:
            main.communicate()
            pytest.fail("the simulation ended before its second round")
        time.sleep(0.2)
    ray = {pid: start_time(pid) for pid in _marked_by_any(SIMULATION_MARKER, short_tmp)}
    return main, out, short_tmp, ray


def _await_gone(ray: dict, short_tmp: Path) -> None:
    """Wait until Ray's processes and session folder are gone, then remove the simulation's temporary folder."""
    import time

    from federation.runtime.processes import start_time

    while any(start_time(pid) == started for pid, started in ray.items()) or list(short_tmp.glob("geofm-ray-*")):
        time.sleep(0.2)
    shutil.rmtree(short_tmp)  # what the test itself made: the folder of the simulation's temporary files


def test_a_simulation_killed_with_sigkill_leaves_no_ray_process_and_no_ray_folder(tmp_path, toy_pythonpath):
    """The watchdog ends Ray's processes (agents outlive their raylet by minutes) and removes its session folder."""
    import signal

    main, _, short_tmp, ray = _hung_toy_simulation(tmp_path, toy_pythonpath)
    try:
        assert len(ray) >= 3, "Ray's processes carry the simulation's marker"
        assert list(short_tmp.glob("geofm-ray-*")), "Ray keeps its session below the simulation's own folder"
    finally:
        main.send_signal(signal.SIGKILL)
        main.wait()
    _await_gone(ray, short_tmp)


@pytest.mark.parametrize("verbose", [[], ["--verbose"]], ids=["plain", "verbose"])
def test_a_simulations_log_holds_no_colour_codes_and_no_actor_termination_notices(tmp_path, toy_pythonpath, verbose):
    """Its stderr is no terminal here: Ray's and Flower's colours stay out, as do Flower's notices."""
    out = tmp_path / "records.jsonl"
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({"rounds": 2, "out": str(out), "bad_input": "b@1"}))
    command = [
        sys.executable,
        "-m",
        "geofm.cli",
        *verbose,
        "fed",
        "simulate",
        "--config",
        str(config),
        "--program",
        "toy",
    ]
    env = {**os.environ, "PYTHONPATH": toy_pythonpath}
    done = subprocess.run(
        [*command, "--institutions", "a,b", "--num-cpus", "2"], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "train of b failed: data/b/scene_000.tif" in done.stderr, "a Ray worker's line reached the log"
    assert "\x1b[" not in done.stderr + done.stdout, done.stderr[-4000:]
    assert "Manually terminating" not in done.stderr


def test_ray_workers_drop_flowers_notices_and_leave_out_its_colours_off_a_terminal(monkeypatch):
    from flwr.common.logger import console_handler

    from federation.flower.simulation import COLOUR_PREFIX, _setup_ray_worker

    flower = logging.getLogger("flwr")
    monkeypatch.setattr(flower, "filters", list(flower.filters))  # restored afterwards, as the handler's colours
    monkeypatch.setattr(console_handler, "colored", True)
    monkeypatch.setenv(COLOUR_PREFIX, "0")
    _setup_ray_worker()
    notice = logging.LogRecord("flwr", logging.WARNING, "", 0, "Manually terminating %s", ("ClientAppActor",), None)
    warning = logging.LogRecord("flwr", logging.WARNING, "", 0, "something else", None, None)
    assert not flower.filter(notice) and flower.filter(warning)
    assert "\x1b" not in console_handler.format(warning)


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_ends_a_simulation_in_one_line_naming_its_last_round_and_leaves_no_ray_process(
    tmp_path, toy_pythonpath, stop
):
    """As central pretraining does: one error line, a non-zero exit, no process of the simulation left."""
    import signal

    main, out, short_tmp, ray = _hung_toy_simulation(tmp_path, toy_pythonpath, stderr=subprocess.PIPE, text=True)
    assert len(ray) >= 3, "Ray's processes carry the simulation's marker"
    main.send_signal(getattr(signal, stop))
    _, stderr = main.communicate()
    assert main.returncode == 2, stderr[-4000:]
    expected = f"geofm: error: stopped by {stop} after round 1; rerun the same command to resume"
    assert geofm_stderr_lines(stderr) == [expected], stderr[-4000:]
    assert [r["round"] for r in toy.read_records(out)] == [1]
    _await_gone(ray, short_tmp)  # the processes the simulation SIGKILLed on its way out


def _marked_by_any(marker: str, tmp: Path) -> set[int]:
    """Processes carrying ``marker`` with any token, of the simulation whose temporary folder is ``tmp``."""
    found = set()
    for path in Path("/proc").iterdir():
        try:
            environ = (path / "environ").read_bytes() if path.name.isdigit() else b""
            if f"{marker}=".encode() in environ and f"TMPDIR={tmp}\0".encode() in environ:
                found.add(int(path.name))
        except OSError:
            continue
    return found


def test_train_replies_go_to_the_upload_store_as_they_arrive(monkeypatch, tmp_path):
    from flwr.supercore.task_identity import TaskIdentity

    from geofm.fl.communication.spill import StoredArrays, UploadStore

    for key, value in {"_run_id": 7, "_task_id": 1, "_node_id": 1}.items():
        monkeypatch.setattr(TaskIdentity, key, value)
    store = UploadStore(tmp_path / "uploads")
    transport = GridTransport(_GridWithADeadNode(), uploads=store)
    payloads = {node: ({"w": np.zeros(2, np.float32)}, {"round": 1}) for node in (2, 3)}
    (reply,), _ = transport.exchange("train", 1, payloads, 0.5)
    assert isinstance(reply.arrays, StoredArrays) and np.array_equal(reply.arrays["w"], np.ones(2, np.float32))
    assert reply.arrays["w"].nbytes == 8 and list((tmp_path / "uploads").rglob("w.npy"))
    (query,), _ = transport.exchange("query", 1, payloads, 0.5)
    assert isinstance(query.arrays, dict), "only train replies are stored"
    store.clear()
    assert not (tmp_path / "uploads").exists()
