"""FedDiff as a federated program: one round of diffusion models, resumable sampling, FMF, the classifier."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from federation.cli import program_run_config
from federation.programs.feddiff import FedDiffClient, FedDiffServer
from federation.runtime.contract import INSTITUTIONS
from federation.runtime.inprocess import InProcess
from federation.runtime.roundloop import run_server
from geofm.config.feddiff import FedDiffConfig
from geofm.errors import ConfigError

pytestmark = pytest.mark.slow  # whole FedDiff rounds in process

CLASSES = ["field", "forest", "water"]  # the class folders of tests/finetune/conftest.py


def _run(cfg: FedDiffConfig, clients: bool = True) -> None:
    nodes = {i + 1: FedDiffClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(FedDiffServer(cfg), InProcess(nodes if clients else {}), poll_s=0)


def test_one_round_uploads_once_samples_filters_and_trains_the_classifier_resumably(
    feddiff_tree, tmp_path, one_torch_thread
):
    run_dir = tmp_path / "feddiff"
    tree = feddiff_tree(run_dir)
    cfg = FedDiffConfig.from_tree(tree)
    _run(cfg)

    (record,) = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert record["clients"] == ["client00", "client01"] and sum(record["num_examples"].values()) == 24
    planned = {}
    for name in record["clients"]:
        upload = load_file(run_dir / "uploads" / f"{name}.safetensors")
        assert record["uplink_bytes"][name] == sum(a.nbytes for a in upload.values())
        assert upload["class_counts"].sum() == record["num_examples"][name] and upload["fmf_mean"].shape == (4, 32, 32)
        planned[name] = upload["class_counts"]

    samples = sorted(p.relative_to(run_dir / "samples").as_posix() for p in (run_dir / "samples").rglob("*.tif"))
    for name, counts in planned.items():
        for k, count in enumerate(counts):
            mine = [s for s in samples if s.startswith(f"{CLASSES[k]}/{name}_")]
            assert len(mine) == count, f"as many samples of {CLASSES[k]} as {name} holds"
    fmf = json.loads((run_dir / "fmf.json").read_text())["clients"]
    batches = [json.loads(line) for line in (run_dir / "samples" / "samples.jsonl").read_text().splitlines()]
    for name, summary in fmf.items():
        scores = {f: s for b in batches if b["client"] == name for f, s in zip(b["files"], b["scores"], strict=True)}
        assert len(summary["dropped"]) == int(0.2 * summary["samples"])
        assert min((scores[f] for f in summary["dropped"]), default=np.inf) >= summary["threshold"]
    kept = sorted(p.relative_to(run_dir / "synthetic").as_posix() for p in (run_dir / "synthetic").rglob("*.tif"))
    assert kept == sorted(set(samples) - {f for s in fmf.values() for f in s["dropped"]})

    evaluation = json.loads((run_dir / "classifier" / "eval.json").read_text())
    assert evaluation["split"] == "test" and "accuracy" in evaluation["metrics"]
    trained = yaml.safe_load((run_dir / "classifier" / "config.yaml").read_text())
    assert trained["data"]["splits"] == {"train": str((run_dir / "synthetic").resolve()), "val": "val", "test": "test"}

    last = batches[-1]  # a run killed while sampling its last batch: a rerun draws it again, the same
    before = {f: (run_dir / "samples" / f).read_bytes() for f in last["files"]}
    lines = (run_dir / "samples" / "samples.jsonl").read_text().splitlines()
    (run_dir / "samples" / "samples.jsonl").write_text("".join(line + "\n" for line in lines[:-1]))
    for f in last["files"]:
        (run_dir / "samples" / f).unlink()
    _run(cfg, clients=False)  # the uploads are kept: no round, no client needed
    assert {f: (run_dir / "samples" / f).read_bytes() for f in last["files"]} == before
    changed = FedDiffConfig.from_tree({**tree, "diffusion": {**tree["diffusion"], "sampling_steps": 3}})
    with pytest.raises(ConfigError, match="other diffusion settings"):
        FedDiffServer(changed)


def test_geofm_fed_simulate_takes_feddiffs_institutions_from_its_config(feddiff_tree, tmp_path):
    config = tmp_path / "feddiff.json"  # JSON is YAML
    config.write_text(json.dumps(feddiff_tree(tmp_path / "run")))
    args = argparse.Namespace(config=config, overrides=["federation.clients=3"], program="feddiff", institutions=None)
    assert program_run_config(args)[INSTITUTIONS] == "client00,client01,client02"


def test_a_feddiff_round_runs_in_flowers_simulation_engine(feddiff_tree, tmp_path):
    """The same program through Flower's simulation engine (Ray): each client a ClientApp, one round, the classifier."""
    from federation.flower.simulation import simulate

    run_dir = tmp_path / "simulated"
    config = tmp_path / "feddiff.json"  # JSON is YAML
    config.write_text(json.dumps(feddiff_tree(run_dir)))
    args = argparse.Namespace(config=config, overrides=[], program="feddiff", institutions=None)
    simulate(program_run_config(args), num_cpus=2)
    (record,) = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert record["clients"] == ["client00", "client01"] and sum(record["num_examples"].values()) == 24
    assert all(record["uplink_bytes"][name] > 0 for name in record["clients"])
    assert "accuracy" in json.loads((run_dir / "classifier" / "eval.json").read_text())["metrics"]
