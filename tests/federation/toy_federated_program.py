"""A toy federated program for the runtime tests.

Each client counts its rounds in its per-client state and uploads a uint8 array (bit patterns
including 0, 127, 128 and 255, XOR-ed with the count) plus a float32 array; the server sums what
arrives and appends a record per round to the JSON-lines file ``out`` of its config, so a test
can check what crossed the wire even when the server runs in another process.

The config is the run config's ``config`` entry (JSON); its keys:
rounds, min_clients, fraction, round_timeout_s, expected_clients, connect_timeout_s,
round_retries, out, ``fail`` (``institution@round,...``: that client raises a RuntimeError in that
round), ``bad_input`` (the same, raising a GeoFMError as unreadable data would) and ``hang`` (the
same, the client writing ``out.hang.INSTITUTION`` and then never answering, as a node killed
mid-round).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from federation.runtime.contract import Program, program_config
from geofm.errors import GeoFMError

BITS = np.array([0, 1, 127, 128, 254, 255], dtype=np.uint8)
DEFAULTS = {
    "rounds": 2,
    "min_clients": 1,
    "fraction": 1.0,
    "round_timeout_s": 120.0,
    "expected_clients": 1,
    "connect_timeout_s": 120.0,
    "round_retries": 0,
    "out": "",
    "fail": "",
    "bad_input": "",
    "hang": "",
}


def load_toy_config(run_config: dict) -> dict:
    return {**DEFAULTS, **program_config(run_config)}


def process_age_s() -> float:
    """Seconds since this process started (Linux): in a deployment, the ClientApp process's start-up."""
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def expected_bits(count: int) -> list[int]:
    """The uint8 array a client uploads after its ``count``-th round."""
    return (BITS ^ np.uint8(count)).tolist()


class ToyServer:
    def __init__(self, run_config: dict) -> None:
        config = load_toy_config(run_config)
        self.num_rounds = config["rounds"]
        self.min_clients = config["min_clients"]
        self.fraction = config["fraction"]
        self.round_timeout_s = config["round_timeout_s"]
        self.expected_clients = config["expected_clients"]
        self.connect_timeout_s = config["connect_timeout_s"]
        self.round_retries = config["round_retries"]
        self.out = Path(config["out"])
        self.names: dict[int, str] = {}
        self.total = np.zeros(len(BITS), dtype=np.int64)

    def start_round(self) -> int:
        return 1

    def register(self, node_id: int, identity: dict) -> None:
        self.names[node_id] = identity["client"]

    def configure(self, rnd: int, node_ids: list[int]) -> dict:
        header = np.array([rnd, len(node_ids)], dtype=np.int64)
        return {node: ({"header": header}, {"round": rnd}) for node in node_ids}

    def aggregate(self, rnd: int, replies: list, failures: list) -> None:
        record = {"round": rnd, "replies": {}, "failures": {}}
        for reply in replies:
            bits, value = reply.arrays["bits"], reply.arrays["value"]
            self.total += bits
            record["replies"][self.names[reply.node_id]] = {
                "bits": bits.tolist(),
                "bits_dtype": str(bits.dtype),
                "value": value.tolist(),
                "value_dtype": str(value.dtype),
                "count": reply.metrics["count"],
                "header": reply.metrics["header"],
                "process_age_s": reply.metrics["process_age_s"],
            }
        for failure in failures:
            record["failures"][self.names[failure.node_id]] = failure.reason
        record["total"] = self.total.tolist()
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def finish(self) -> None:
        with self.out.open("a") as f:
            f.write(json.dumps({"finished": True, "total": self.total.tolist()}) + "\n")


def _rounds_of(entry: str) -> set[tuple[str, str]]:
    """``institution@round,...`` as a set of (institution, round) pairs."""
    return {tuple(item.split("@")) for item in str(entry).split(",") if item}


class ToyClient:
    def __init__(self, run_config: dict, node_config: dict) -> None:
        config = load_toy_config(run_config)
        self.name = node_config["institution"]
        self.fail, self.bad_input, self.hang = (_rounds_of(config[key]) for key in ("fail", "bad_input", "hang"))
        self.out = Path(config["out"])

    def identity(self) -> dict:
        return {"client": self.name, "num_examples": 10}

    def train(self, arrays: dict, config: dict, state: dict) -> tuple:
        if (self.name, str(config["round"])) in self.fail:
            raise RuntimeError(f"toy failure of {self.name} in round {config['round']}")
        if (self.name, str(config["round"])) in self.bad_input:
            raise GeoFMError(f"data/{self.name}/scene_000.tif: cannot read raster")
        if (self.name, str(config["round"])) in self.hang:
            Path(f"{self.out}.hang.{self.name}").write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        count = int(state["count"][0]) + 1 if "count" in state else 1
        upload = {"bits": BITS ^ np.uint8(count), "value": np.full(3, 0.5 * count, dtype=np.float32)}
        metrics = {
            "count": count,
            "header": str(arrays["header"].tolist()),
            "process_age_s": process_age_s(),
            "pid": os.getpid(),
        }
        return upload, metrics, {"count": np.array([count], dtype=np.int64)}


def make_server(run_config: dict) -> ToyServer:
    return ToyServer(run_config)


def make_client(run_config: dict, node_config: dict) -> ToyClient:
    return ToyClient(run_config, node_config)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


PROGRAM = Program(make_server, make_client)
"""The toy federated program: counts rounds and uploads bits, for the runtime's tests."""
