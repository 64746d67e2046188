"""A federated client trains on a chip store of its archive, dealt to it by the partition as files are."""

from __future__ import annotations

import json
import math

import pytest

from federation.programs.client import FederatedClient
from federation.programs.server import FederatedServer
from federation.runtime.inprocess import InProcess
from federation.runtime.roundloop import run_server
from geofm.config import SourceConfig
from geofm.config.federated import FederatedConfig
from geofm.data.chipstore import ChipStore
from geofm.data.prepare import prepare_store
from geofm.tasks.pretraining import client_shares

pytestmark = pytest.mark.slow


def test_a_client_trains_on_a_chip_store_of_its_archive(fed_tree, tmp_path):
    tree = fed_tree(federation={"rounds": 1})
    sources = tree["data"]["sources"]
    at = next(i for i, s in enumerate(sources) if s["name"] == "satellite_4band")
    live = SourceConfig.model_validate(sources[at])
    prepare_store(live, tmp_path / "store", size=32, chips_per_shard=8, progress=False)
    sources[at] = {"name": live.name, "layout": "chips", "root": str(tmp_path / "store")} | {
        key: getattr(live, key) for key in ("bands", "mean", "std")
    }
    cfg = FederatedConfig.from_tree(tree)
    shares = client_shares(cfg, "satellite_4band")
    assert shares[at] == ChipStore(tmp_path / "store").shard_paths() and not any(shares[:at] + shares[at + 1 :])

    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(FederatedServer(cfg), InProcess(clients), poll_s=0)
    rounds = [json.loads(line) for line in (cfg.run.output_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1]
    assert all("satellite_4band" in r["clients"] and math.isfinite(r["loss"]) for r in rounds)
