"""Federated pretraining end to end, with the runtime's round loop over an in-process transport.

Flower itself is exercised by test_flower.py, test_localdeploy.py and test_simulate_demo.py; here
the server and client programs run in this process so that resume, rejection and compression
can be checked quickly and exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from federation.programs.base import local_config
from federation.programs.client import FederatedClient
from federation.programs.server import FederatedServer, round_lr
from federation.runtime.inprocess import InProcess
from federation.runtime.roundloop import run_server
from geofm.checkpoints import inspect_checkpoint
from geofm.checkpoints.io import DEEPSPEED_MODEL_STATES
from geofm.config.federated import FederatedConfig
from geofm.errors import ConfigError, DatasetNotFoundError, FederatedRunError
from geofm.fl.algorithms.base import DISTILL_OPTIMIZER
from geofm.fl.communication.codec import Codec
from geofm.tasks import TASKS
from geofm.tasks.mim.figures import SHOWN_CHIPS, figure_size
from geofm.tasks.pretraining import client_shares
from tests.federation.conftest import fedsense_options

pytestmark = pytest.mark.slow


def _run(tree: dict, clients: dict[int, FederatedClient] | None = None, stored: bool = False) -> Path:
    cfg = FederatedConfig.from_tree(tree)
    if clients is None:
        clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    server = FederatedServer(cfg)
    run_server(server, InProcess(clients, server.uploads if stored else None), poll_s=0)
    return cfg.run.output_dir


def _rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def test_a_fedsense_run_logs_every_round_and_exports_the_global_backbone(fed_tree):
    run_dir = _run(fed_tree())
    rounds = _rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["clients"] == ["aerial_rgb", "satellite_4band", "uav_rgbn"] for r in rounds)
    assert all(r["examples"] == {"aerial_rgb": 24, "satellite_4band": 24, "uav_rgbn": 24} for r in rounds)
    for key in ("loss", "loss_mim", "loss_distill", "loss_similarity", "uplink_bytes", "downlink_bytes", "seconds"):
        assert all(key in r for r in rounds), f"rounds.jsonl lacks {key}"
    cfg = FederatedConfig.from_tree(fed_tree())
    server = FederatedServer(
        cfg.model_copy(update={"run": cfg.run.model_copy(update={"output_dir": run_dir.parent / "x"})})
    )
    values = server.global_model.numel()
    one_bit = Codec(bits=1).packet_nbytes(values) + 16  # payload, scales and header; 16 bytes of array framing
    assert rounds[0]["uplink_bytes"] <= 3 * one_bit and rounds[0]["downlink_bytes"] == 3 * (4 * values + 32)
    assert rounds[0]["uplink_bytes"] * 28 < rounds[0]["downlink_bytes"], "1-bit uploads are >28x smaller than fp32"
    assert [r["lr"] for r in rounds] == [pytest.approx(round_lr(cfg, n)) for n in (1, 2, 3)]
    assert (run_dir / "rounds.png").stat().st_size > 0
    with Image.open(run_dir / "reconstruction.png") as png:  # the server's public chips, one row each
        width, height = figure_size(SHOWN_CHIPS, 32, 32)
        assert png.format == "PNG" and png.size == (round(width * 120), round(height * 120))

    sidecar = json.loads((run_dir / "backbone.json").read_text())
    assert sidecar["federation"]["clients"] == ["aerial_rgb", "satellite_4band", "uav_rgbn"]
    assert sidecar["federation"]["uplink_bits"] == 1 and sidecar["federation"]["uplink_bytes"] == sum(
        r["uplink_bytes"] for r in rounds
    )
    assert "## Federation" in (run_dir / "MODEL_CARD.md").read_text()
    info = inspect_checkpoint(run_dir)
    assert info["layout"] == "geofm_export" and info["provenance"]["federation"]["algorithm"] == "fedsense"
    assert inspect_checkpoint(run_dir / "checkpoints/last")["layout"] == "geofm_train"


def test_a_stopped_server_resumes_to_the_same_result(fed_tree, caplog):
    """The server checkpoints each round; clients recover their error-feedback and downlink state from disk."""
    compressed = {"downlink": {"bits": 8}}
    straight = _run(fed_tree("straight", algorithm=compressed))
    with caplog.at_level("INFO", logger="geofm.fl"):
        first = _run(fed_tree("resumed", algorithm=compressed, federation={"rounds": 3, "stop_after_rounds": 1}))
    assert "this invocation runs rounds 1-1 of 3" in caplog.text and "round 1/3: loss" in caplog.text
    assert [r["round"] for r in _rounds(first)] == [1] and not (first / "backbone.safetensors").exists()
    resumed = _run(fed_tree("resumed", algorithm=compressed))  # new client programs: empty Flower state
    a, b = _rounds(straight), _rounds(resumed)
    assert [r["round"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "uplink_bytes", "downlink_bytes"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6), f"round {ra['round']} {key}"
    assert b[1]["downlink_bytes"] < a[0]["downlink_bytes"] / 3, "8-bit changes travel down from round 2 on"
    wa, wb = load_file(straight / "backbone.safetensors"), load_file(resumed / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run ends with the same weights"


def test_a_run_written_before_configs_named_a_task_resumes_and_a_changed_task_is_refused(fed_tree, caplog):
    """The checkpoint layout is unchanged; a saved config without ``task`` was masked image modelling."""
    first = _run(fed_tree("old", federation={"rounds": 2, "stop_after_rounds": 1}))
    saved = yaml.safe_load((first / "config.yaml").read_text())
    del saved["task"]  # as the previous version wrote it
    (first / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    TASKS.register("mim_again", "geofm.tasks.mim.task:MaskedImageModelling")
    with pytest.raises(ConfigError, match="task"):
        _run({**fed_tree("old", federation={"rounds": 2}), "task": "mim_again"})
    with caplog.at_level("INFO", logger="geofm.fl"):
        _run(fed_tree("old", federation={"rounds": 2}))
    assert "after round 1" in caplog.text
    assert [r["round"] for r in _rounds(first)] == [1, 2] and (first / "backbone.safetensors").exists()


class _LastFirst(InProcess):
    """Replies arrive in the opposite order, as they may from nodes of different speeds."""

    def exchange(self, kind, rnd, payloads, timeout_s):
        replies, failures = super().exchange(kind, rnd, payloads, timeout_s)
        return replies[::-1], failures


def test_the_global_model_does_not_depend_on_the_order_replies_arrive_in(fed_tree):
    cfg = FederatedConfig.from_tree(fed_tree("last_first"))
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(FederatedServer(cfg), _LastFirst(clients), poll_s=0)
    in_order = _run(fed_tree("in_order"))
    wa, wb = load_file(in_order / "backbone.safetensors"), load_file(cfg.run.output_dir / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the same uploads give the same model in any arrival order"


def test_a_client_recovers_its_last_complete_state_whatever_a_kill_left_beside_it(fed_tree, tmp_path):
    cfg = FederatedConfig.from_tree(fed_tree())
    client = FederatedClient(cfg, {"institution": cfg.client_names[0], "state-dir": str(tmp_path / "state")})
    for rnd in (1, 2, 3):
        client._persist(rnd, {"e": np.full(3, float(rnd))})
    # Killed while writing round 4's state, by this version and by one that named it differently.
    (client.state_dir / "state_round_000004.npz.partial").write_bytes(b"PK\x03")
    (client.state_dir / "state_round_000004.tmp.npz").write_bytes(b"PK\x03")
    assert client._recover(5)["e"].tolist() == [3.0, 3.0, 3.0], "the newest complete state"
    assert client._recover(3)["e"].tolist() == [2.0, 2.0, 2.0] and client._recover(1) == {}
    client._persist(5, {"e": np.zeros(3)})
    kept = sorted(p.name for p in client.state_dir.iterdir() if not p.name.startswith("state_round_000004"))
    assert kept == ["state_round_000003.npz", "state_round_000005.npz"], "the last two complete states are kept"


class _Faulty:
    """A client that uploads what the server must refuse: a NaN update, an overflowing one, a wrong bit width, or raises."""

    def __init__(self, client: FederatedClient, fault: str) -> None:
        self.client, self.fault = client, fault

    def identity(self):
        return self.client.identity()

    def train(self, arrays, config, state):
        upload, metrics, state = self.client.train(arrays, config, state)
        if self.fault == "raise":
            raise RuntimeError("disk full")
        n = int(upload["update.header"][0])
        if self.fault == "inf":  # a well-formed 1-bit packet whose finite scales decode to overflow
            arrays = Codec(bits=1).encode(torch.ones(n)).to_arrays()
            arrays["scales"] = np.full_like(arrays["scales"], np.finfo(np.float32).max)
            return _update(arrays), metrics, state
        vector = torch.full((n,), float("nan")) if self.fault == "nan" else torch.ones(n)
        bits = 32 if self.fault == "nan" else 8
        packet = Codec(bits=bits).encode(torch.zeros(n)) if self.fault == "nan" else Codec(bits=bits).encode(vector)
        arrays = packet.to_arrays()
        if self.fault == "nan":
            arrays["payload"] = vector.numpy().view(np.uint8)
        return _update(arrays), metrics, state


def _update(arrays: dict) -> dict:
    """A packet's arrays as the uplink payload ``update`` travels."""
    return {f"update.{key}": value for key, value in arrays.items()}


def test_malformed_uploads_are_rejected_with_the_client_named_and_the_round_goes_on(fed_tree):
    tree = fed_tree("faulty", algorithm={"uplink": {"bits": 32}}, federation={"rounds": 2})
    cfg = FederatedConfig.from_tree(tree)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    clients[1] = _Faulty(clients[1], "nan")
    clients[2] = _Faulty(clients[2], "raise")
    run_dir = _run(tree, clients)
    rounds = _rounds(run_dir)
    assert [r["clients"] for r in rounds] == [["uav_rgbn"], ["uav_rgbn"]]
    assert "NaN or Inf values" in rounds[0]["rejected"]["aerial_rgb"], rounds[0]["rejected"]
    assert "disk full" in rounds[0]["failed"]["satellite_4band"]
    assert (run_dir / "backbone.safetensors").exists()

    tree = fed_tree("wrong_bits", federation={"rounds": 1})
    cfg = FederatedConfig.from_tree(tree)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    clients[3] = _Faulty(clients[3], "bits")
    rounds = _rounds(_run(tree, clients))
    assert rounds[0]["rejected"] == {"uav_rgbn": "update is encoded with 8 bits; the round expects 1"}
    assert rounds[0]["clients"] == ["aerial_rgb", "satellite_4band"]


def test_a_client_without_its_data_is_an_error_naming_it_and_the_path(fed_tree, tmp_path):
    tree = fed_tree()
    tree["data"]["sources"][2]["root"] = str(tmp_path / "nowhere")
    cfg = FederatedConfig.from_tree(tree)
    with pytest.raises(
        DatasetNotFoundError, match=f"client uav_rgbn: image folder {tmp_path / 'nowhere'} does not exist"
    ):
        FederatedClient(cfg, {"institution": "uav_rgbn"})
    clients = {1: FederatedClient(cfg, {"institution": "aerial_rgb"})}
    server = FederatedServer(
        cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"connect_timeout_s": 0.01})})
    )
    with pytest.raises(FederatedRunError, match="1 of 3 nodes connected"):
        run_server(server, InProcess(clients), poll_s=0)


@pytest.mark.parametrize("seed", [0])
def test_error_feedback_brings_1_bit_uploads_close_to_full_precision(fed_tree, seed):
    """FedSense, 8 rounds of 2 local steps: 1-bit uploads with error feedback end nearer fp32 than without."""
    plain = {"options": fedsense_options(distill_steps=1)}
    rounds = {"rounds": 8}
    final = {}
    for label, uplink in (("fp32", {"bits": 32}), ("ef", {"bits": 1, "error_feedback": True}), ("no_ef", {"bits": 1})):
        run_dir = _run(
            fed_tree(label, algorithm={**plain, "uplink": uplink}, federation=rounds, teacher=None, run={"seed": seed})
        )
        final[label] = np.mean([r["loss"] for r in _rounds(run_dir)[-3:]])
    assert abs(final["ef"] - final["fp32"]) < abs(final["no_ef"] - final["fp32"]), final


@pytest.mark.parametrize("partition", ["by_region", "dirichlet"])
def test_every_private_file_goes_to_exactly_one_client_and_public_files_to_none(fed_tree, partition):
    cfg = FederatedConfig.from_tree(fed_tree(federation={"partition": partition, "clients": 4}))
    shares = [client_shares(cfg, name) for name in cfg.client_names]
    given = [path for client in shares for files in client for path in files]
    assert len(given) == len(set(given)) == 72, "24 files of each of the 3 private sources, once each"
    assert not any("public_rgb" in str(path) for path in given)
    assert all(any(files) for files in shares), "no client is left empty"


def test_an_institution_points_the_config_at_its_own_machine(fed_tree, tmp_path):
    cfg = FederatedConfig.from_tree(fed_tree())
    local = local_config(cfg, {"institution": "uav_rgbn", "data-root": "/srv/drone", "teacher": "/srv/w/teacher.pth"})
    roots = {s.name: str(s.root) for s in local.data.sources}
    assert roots["uav_rgbn"] == "/srv/drone" and roots["aerial_rgb"] == str(cfg.data.sources[0].root)
    assert local.task_options["teacher"]["checkpoint"] == "/srv/w/teacher.pth"
    with pytest.raises(ConfigError, match=r"institution 'esa' is not a client of this federation; its clients are"):
        client_shares(cfg, "esa")


def _strict_rounds(run_dir: Path) -> list[dict]:
    def refuse(constant: str):
        raise AssertionError(f"rounds.jsonl holds a bare {constant}: not valid JSON")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def _finite_backbone(run_dir: Path) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in load_file(run_dir / "backbone.safetensors").values())


def test_a_two_upload_round_with_an_overflowing_1_bit_packet_leaves_a_finite_model(fed_tree):
    tree = fed_tree("overflow", federation={"rounds": 2})
    cfg = FederatedConfig.from_tree(tree)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    clients[1] = _Faulty(clients[1], "inf")
    clients[2] = _Faulty(clients[2], "raise")  # two uploads a round: the round's norm rule is off
    run_dir = _run(tree, clients)
    rounds = _strict_rounds(run_dir)
    assert [r["clients"] for r in rounds] == [["uav_rgbn"], ["uav_rgbn"]]
    assert "(1-bit packet)" in rounds[0]["rejected"]["aerial_rgb"], rounds[0]["rejected"]
    assert _finite_backbone(run_dir)
    _run(tree, clients)  # a rerun resumes from a finite checkpoint and finishes again


def test_a_round_whose_new_model_is_not_finite_is_discarded_and_the_previous_model_kept(fed_tree, monkeypatch):
    tree = fed_tree("discarded", federation={"rounds": 2})
    cfg = FederatedConfig.from_tree(tree)
    server = FederatedServer(cfg)
    update_rule = type(server.algorithm).server_update
    kept = []

    def overflow_in_round_2(self, model, aggregate):
        outcome = update_rule(self, model, aggregate)
        if len(kept) == 1:
            outcome.model[:5] = float("inf")
        kept.append(model.clone())
        return outcome

    monkeypatch.setattr(type(server.algorithm), "server_update", overflow_in_round_2)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(server, InProcess(clients), poll_s=0)
    rounds = _strict_rounds(cfg.run.output_dir)
    assert "clients" in rounds[1] and rounds[1]["clients"] == [] and rounds[1]["loss"] is None
    assert "5 NaN or Inf values" in rounds[1]["discarded"] and "largest accepted update" in rounds[1]["discarded"]
    assert torch.equal(server.global_model, kept[1]), "round 2's model is round 1's"
    assert _finite_backbone(cfg.run.output_dir)


ADAM = {"server_optimizer": {"name": "fedadam", "lr": 0.01}}


def _server_state(run_dir: Path) -> dict:
    (path,) = sorted((run_dir / "checkpoints").rglob(DEEPSPEED_MODEL_STATES))[-1:]
    return torch.load(path, weights_only=True)["server"]


@pytest.mark.parametrize("algorithm", [ADAM, {"aggregator": {"name": "median"}}], ids=["fedadam", "median"])
def test_a_run_with_a_server_optimiser_or_a_robust_aggregator_finishes_and_logs(fed_tree, algorithm):
    run_dir = _run(fed_tree("rule", algorithm=algorithm, federation={"rounds": 2}))
    rounds = _strict_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2] and all(len(r["clients"]) == 3 for r in rounds)
    assert all(r["loss"] is not None and "loss_similarity" in r for r in rounds) and _finite_backbone(run_dir)
    state = _server_state(run_dir)["algorithm"]["server_optimizer"]
    if algorithm is ADAM:
        values = FederatedServer(FederatedConfig.from_tree(fed_tree("size"))).global_model.numel()
        assert state["m"].shape == state["v"].shape == (values,) and bool((state["v"] > 0).all())
    mean = _run(fed_tree("mean", federation={"rounds": 2}))
    wa, wb = load_file(mean / "backbone.safetensors"), load_file(run_dir / "backbone.safetensors")
    assert not all(torch.equal(wa[k], wb[k]) for k in wa), "the rule changes the global model"


def test_uploads_stored_on_disk_as_they_arrive_give_the_same_run_and_are_removed(fed_tree):
    """The server's flat path: replies kept in the run's spill folder, decoded one at a time, spilled for the median."""
    algorithm = {"aggregator": {"name": "median"}}
    (Path(fed_tree("stale")["run"]["output_dir"]) / "spill" / "uploads" / "000000").mkdir(parents=True)
    stored = _run(fed_tree("stale", algorithm=algorithm, federation={"rounds": 1}), stored=True)
    held = _run(fed_tree("held", algorithm=algorithm, federation={"rounds": 1}))
    wa, wb = load_file(stored / "backbone.safetensors"), load_file(held / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "storing the uploads changed the global model"
    assert [r["uplink_bytes"] for r in _rounds(stored)] == [r["uplink_bytes"] for r in _rounds(held)]
    assert not (stored / "spill").exists() or not any((stored / "spill").rglob("*.npy")), (
        "stored uploads outlived the run"
    )


def test_a_resumed_run_restores_the_server_optimiser_and_an_older_checkpoint_starts_it_afresh(fed_tree):
    straight = _run(fed_tree("straight", algorithm=ADAM))
    for name in ("resumed", "older"):
        _run(fed_tree(name, algorithm=ADAM, federation={"rounds": 3, "stop_after_rounds": 1}))
    (path,) = Path(fed_tree("older")["run"]["output_dir"]).joinpath("checkpoints").rglob(DEEPSPEED_MODEL_STATES)
    saved = torch.load(path, weights_only=True)
    algorithm = saved["server"].pop("algorithm")
    assert algorithm.pop("server_optimizer")["m"] is not None
    # As written before the algorithm kept its own state, and before the server optimiser was saved.
    saved["server"].update(reference=None, synced={}, recent_norms=algorithm["recent_norms"]["update"])
    torch.save(saved, path)
    resumed, older = _run(fed_tree("resumed", algorithm=ADAM)), _run(fed_tree("older", algorithm=ADAM))
    weights = {run: load_file(run / "backbone.safetensors") for run in (straight, resumed, older)}
    assert all(torch.equal(weights[straight][k], weights[resumed][k]) for k in weights[straight])
    assert [r["round"] for r in _rounds(older)] == [1, 2, 3] and _finite_backbone(older)
    assert not all(torch.equal(weights[straight][k], weights[older][k]) for k in weights[straight]), (
        "a fresh state steps differently: the saved one is what made the resumed run identical"
    )


def test_a_checkpoint_with_the_distillation_optimiser_beside_the_algorithm_state_resumes_to_the_same_result(
    fed_tree,
):
    """Server checkpoints written before FedSense kept its distillation optimiser in its own state hold it beside
    that state: FedSense reads it back from there, and the run resumes to the unbroken result."""
    straight = _run(fed_tree("straight", federation={"rounds": 2}))
    older = _run(fed_tree("older", federation={"rounds": 2, "stop_after_rounds": 1}))
    (path,) = older.joinpath("checkpoints").rglob(DEEPSPEED_MODEL_STATES)
    saved = torch.load(path, weights_only=True)
    saved["server"][DISTILL_OPTIMIZER] = saved["server"]["algorithm"].pop(DISTILL_OPTIMIZER)
    assert saved["server"][DISTILL_OPTIMIZER]["state"], "AdamW's moments after round 1's distillation"
    torch.save(saved, path)
    resumed = FederatedServer(FederatedConfig.from_tree(fed_tree("older", federation={"rounds": 2})))
    assert resumed.algorithm.distillation.optimizer.state_dict()["state"], "the moments were read back"
    _run(fed_tree("older", federation={"rounds": 2}))
    wa, wb = load_file(straight / "backbone.safetensors"), load_file(older / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run ends with the same weights"


def test_a_discarded_round_leaves_the_server_optimiser_state_as_it_was(fed_tree, monkeypatch):
    cfg = FederatedConfig.from_tree(
        fed_tree("momentum", algorithm={"server_optimizer": {"name": "fedavgm"}}, federation={"rounds": 2})
    )
    server = FederatedServer(cfg)
    update_rule, buffers = type(server.algorithm).server_update, []

    def overflow_in_round_2(self, model, aggregate):
        outcome = update_rule(self, model, aggregate)
        buffers.append(self.server_optimizer.state_dict()["state"][0]["momentum_buffer"].clone())
        if len(buffers) == 2:
            outcome.model[:5] = float("inf")
        return outcome

    monkeypatch.setattr(type(server.algorithm), "server_update", overflow_in_round_2)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(server, InProcess(clients), poll_s=0)
    assert "discarded" in _strict_rounds(cfg.run.output_dir)[1] and not torch.equal(buffers[0], buffers[1])
    assert torch.equal(server.algorithm.server_optimizer.state_dict()["state"][0]["momentum_buffer"], buffers[0])


SCAFFOLD = {
    "name": "scaffold",
    "options": {},
    "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": True},
}


class _KilledInRound(InProcess):
    """The server dies in round ``rnd`` after the clients trained and kept their states, before it aggregates."""

    def __init__(self, clients, rnd: int) -> None:
        super().__init__(clients)
        self.rnd = rnd

    def exchange(self, kind, rnd, payloads, timeout_s):
        replies, failures = super().exchange(kind, rnd, payloads, timeout_s)
        if kind != "query" and rnd == self.rnd:
            raise _Killed
        return replies, failures


class _Killed(Exception):
    pass


def test_scaffold_runs_two_payloads_through_1_bit_uplinks_and_resumes_after_a_kill_to_the_same_result(fed_tree):
    straight = _run(fed_tree("straight", algorithm=SCAFFOLD, federation={"rounds": 2}))
    rounds = _rounds(straight)
    assert [r["clients"] for r in rounds] == [["aerial_rgb", "satellite_4band", "uav_rgbn"]] * 2
    values = FederatedServer(FederatedConfig.from_tree(fed_tree("x", algorithm=SCAFFOLD))).global_model.numel()
    one_bit = Codec(bits=1, bucket_size=512).packet_nbytes(values)
    assert rounds[0]["uplink_bytes"] == 3 * 2 * one_bit, "two 1-bit payloads a client"
    assert rounds[0]["downlink_bytes"] == 3 * 2 * (4 * values + 32), "the model and the control variate, whole"
    assert all(r["control_norm"] > 0 for r in rounds), "the clients' control variates reach the server's"
    with np.load(straight / "clients/uav_rgbn/state_round_000002.npz") as state:
        assert {"control", "feedback.delta_y.error", "feedback.delta_c.error", "round"} <= set(state.files)
        assert state["control"].shape == (values,) and np.abs(state["feedback.delta_c.error"]).sum() > 0

    tree = fed_tree("killed", algorithm=SCAFFOLD, federation={"rounds": 2})
    cfg = FederatedConfig.from_tree(tree)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    with pytest.raises(_Killed):
        run_server(FederatedServer(cfg), _KilledInRound(clients, 2), poll_s=0)
    assert [r["round"] for r in _rounds(cfg.run.output_dir)] == [1]
    resumed = _run(tree)  # new client programs: their states of round 2 are newer than the server's
    for a, b in zip(rounds, _rounds(resumed), strict=True):
        assert a["loss"] == b["loss"] and a["control_norm"] == b["control_norm"], f"round {a['round']}"
    wa, wb = load_file(straight / "backbone.safetensors"), load_file(resumed / "backbone.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run ends with the same weights"


def test_a_satlas_swin_v2_starts_the_federated_student_and_is_its_teacher(fed_tree, satlas_file):
    swinv2 = {"arch": "swinv2_tiny_window8_256", "window_size": 2}
    tree = fed_tree(
        "satlas",
        model={**swinv2, "init_checkpoint": str(satlas_file)},
        teacher={**swinv2, "checkpoint": str(satlas_file)},
        federation={"rounds": 1},
    )

    run_dir = _run(tree)

    assert [r["round"] for r in _rounds(run_dir)] == [1] and _rounds(run_dir)[0]["loss_distill"] != 0
    sidecar = json.loads((run_dir / "backbone.json").read_text())
    assert sidecar["arch"] == "swinv2_tiny_window8_256"
    assert set(sidecar["releases"]) == {"model.init_checkpoint", "task_options.teacher.checkpoint"}
