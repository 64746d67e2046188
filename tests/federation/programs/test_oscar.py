"""OSCAR as a federated program: one round of class embeddings, the server model, guided samples, the classifier."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.numpy import load_file, save_file

from federation.cli import program_run_config
from federation.programs.oscar import OscarClient, OscarServer
from federation.runtime.contract import INSTITUTIONS
from federation.runtime.inprocess import InProcess
from federation.runtime.roundloop import run_server
from geofm.config.oscar import OscarConfig
from geofm.errors import ConfigError
from geofm.fl.oneshot import oscar
from geofm.models.diffusion import build_embedding_unet, model_arrays

CLASSES = ["field", "forest", "water"]  # the class folders of tests/finetune/conftest.py
EMBED_DIM = 128  # the pooled features of the tiny Swin of tests/conftest.py (embed_dim 16, 4 stages)


def _run(cfg: OscarConfig, clients: bool = True) -> None:
    nodes = {i + 1: OscarClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(OscarServer(cfg), InProcess(nodes if clients else {}), poll_s=0)


@pytest.mark.slow
def test_one_round_uploads_embeddings_trains_the_server_once_samples_and_trains_the_classifier(
    oscar_tree, tmp_path, one_torch_thread, monkeypatch
):
    run_dir = tmp_path / "oscar"
    tree = oscar_tree(run_dir)
    cfg = OscarConfig.from_tree(tree)
    _run(cfg)

    (record,) = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert record["clients"] == ["client00", "client01"] and sum(record["num_examples"].values()) == 24
    for name in record["clients"]:
        upload = load_file(run_dir / "uploads" / f"{name}.safetensors")
        counts, held = upload["class_counts"], int((upload["class_counts"] > 0).sum())
        assert upload["class_embeddings"].shape == (held, EMBED_DIM)
        assert record["uplink_bytes"][name] == held * EMBED_DIM * 4 + 3 * 8, "per class held: one float32 embedding"
        assert counts.sum() == record["num_examples"][name]
        files = sorted(p.relative_to(run_dir / "synthetic").as_posix() for p in (run_dir / "synthetic").rglob("*.tif"))
        for k, count in enumerate(counts):
            assert len([f for f in files if f.startswith(f"{CLASSES[k]}/{name}_")]) == count
    server = json.loads((run_dir / oscar.SERVER_METRICS).read_text())
    assert server["public_images"] == 9 and server["steps"] == 2, "the val split's 9 scenes, one epoch of batch 8"
    assert (run_dir / oscar.SERVER_MODEL).exists()
    evaluation = json.loads((run_dir / "classifier" / "eval.json").read_text())
    assert evaluation["split"] == "test" and "accuracy" in evaluation["metrics"]

    log = run_dir / "synthetic" / "samples.jsonl"
    batches = log.read_text().splitlines()
    last = json.loads(batches[-1])  # a run killed while sampling its last batch: a rerun draws it again, the same
    before = {f: (run_dir / "synthetic" / f).read_bytes() for f in last["files"]}
    log.write_text("".join(line + "\n" for line in batches[:-1]))
    for f in last["files"]:
        (run_dir / "synthetic" / f).unlink()
    monkeypatch.setattr(oscar, "train_server_model", lambda *a, **k: pytest.fail("the saved server model is reused"))
    _run(cfg, clients=False)  # the uploads are kept: no round, no client needed
    assert {f: (run_dir / "synthetic" / f).read_bytes() for f in last["files"]} == before
    changed = OscarConfig.from_tree({**tree, "oscar": {**tree["oscar"], "guidance_scale": 1.0}})
    with pytest.raises(ConfigError, match="other oscar settings"):
        OscarServer(changed)


def test_geofm_fed_simulate_takes_oscars_institutions_from_its_config(oscar_tree, tmp_path):
    config = tmp_path / "oscar.json"  # JSON is YAML
    config.write_text(json.dumps(oscar_tree(tmp_path / "run")))
    args = argparse.Namespace(config=config, overrides=["federation.clients=3"], program="oscar", institutions=None)
    assert program_run_config(args)[INSTITUTIONS] == "client00,client01,client02"


def test_the_server_names_a_missing_public_folder_and_a_server_model_of_other_width(oscar_tree, tmp_path):
    tree = oscar_tree(tmp_path / "run")
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=rf"oscar.public: no folder {missing}"):
        OscarServer(OscarConfig.from_tree({**tree, "oscar": {**tree["oscar"], "public": str(missing)}}))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"oscar.public: .* holds no image"):
        OscarServer(OscarConfig.from_tree({**tree, "oscar": {**tree["oscar"], "public": str(empty)}}))
    cfg = OscarConfig.from_tree(tree)
    other = tmp_path / "server_model.safetensors"
    save_file(model_arrays(build_embedding_unet(cfg.diffusion, 4, 8, 32)), other)
    with pytest.raises(
        ConfigError, match=r"oscar.diffusion_checkpoint .* 8-dimensional embeddings, the encoder gives 128"
    ):
        oscar.load_server_model(cfg, other, EMBED_DIM, "oscar.diffusion_checkpoint")


def test_an_encoder_checkpoint_of_other_widths_is_refused(oscar_tree, rgb_export, tmp_path):
    tree = oscar_tree(tmp_path / "run")
    wider = {**tree["model"], "timm_kwargs": {**tree["model"]["timm_kwargs"], "embed_dim": 32}}
    encoder = {"checkpoint": str(rgb_export), "model": wider}
    with pytest.raises(ConfigError, match=r"oscar.encoder.checkpoint .* has embed dims"):
        OscarConfig.from_tree({**tree, "oscar": {**tree["oscar"], "encoder": encoder}})
    same = {**encoder, "model": tree["model"]}
    cfg = OscarConfig.from_tree({**tree, "oscar": {**tree["oscar"], "encoder": same}})
    assert cfg.encoder.checkpoint == rgb_export
    pooled = oscar.build_encoder(cfg)(torch.zeros(2, 4, 32, 32))
    assert pooled.shape == (2, EMBED_DIM)
