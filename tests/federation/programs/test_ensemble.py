"""Ensemble distillation as a federated program: one round of finetuned clients, the student, the rerun."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.numpy import load_file

from federation.programs.ensemble import EnsembleServer
from federation.runtime.inprocess import run_in_process
from geofm.config.ensemble import EnsembleConfig
from geofm.errors import ConfigError

pytestmark = pytest.mark.slow  # a whole round and a distillation in process


def test_one_round_of_finetuned_clients_then_the_distilled_student(ensemble_tree, tmp_path, one_torch_thread):
    run_dir = tmp_path / "ensemble"
    tree = ensemble_tree(run_dir)
    cfg = EnsembleConfig.from_tree(tree)
    run_in_process(cfg, "ensemble")

    (record,) = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert record["clients"] == ["client00", "client01"] and sum(record["num_examples"].values()) == 24
    partition = json.loads((run_dir / "partition.json").read_text())["clients"]
    for name in record["clients"]:
        upload = load_file(run_dir / "uploads" / f"{name}.safetensors")
        assert record["uplink_bytes"][name] == sum(a.nbytes for a in upload.values())
        share = sorted(
            p.relative_to(run_dir / "clients" / name / "share").as_posix()
            for p in (run_dir / "clients" / name / "share").rglob("*.tif")
        )
        assert share == sorted("/".join(s.split("/")[1:]) for s in partition[name]["samples"]), "its share alone"
        local = json.loads((run_dir / "clients" / name / "run" / "eval.json").read_text())
        assert local["selected"]["split"] is None, "a client keeps its final weights"

    out = run_dir / "classifier"
    evaluation = json.loads((out / "eval.json").read_text())
    assert (
        evaluation["split"] == "test"
        and evaluation["public_images"] == 12
        and evaluation["teachers"] == ["client00", "client01"]
    )
    assert (out / "best" / "model.safetensors").exists()
    assert yaml.safe_load((out / "config.yaml").read_text())["run"]["output_dir"] == str(out)
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in epochs if "loss" in r] == [1, 2]

    uploads_before = {p.name: p.read_bytes() for p in (run_dir / "uploads").iterdir()}
    other = EnsembleConfig.from_tree({**tree, "ensemble": {**tree["ensemble"], "temperature": 1.0}})
    run_in_process(other, "ensemble")  # the uploads are kept: no round, the student distilled again
    assert {p.name: p.read_bytes() for p in (run_dir / "uploads").iterdir()} == uploads_before
    assert len((run_dir / "rounds.jsonl").read_text().splitlines()) == 1
    with pytest.raises(ConfigError, match="other train settings"):
        EnsembleServer(EnsembleConfig.from_tree({**tree, "train": {**tree["train"], "epochs": 2}}))
