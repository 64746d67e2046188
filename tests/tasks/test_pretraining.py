"""What every pretraining objective shares: a federated client's share and its weight."""

from __future__ import annotations

import numpy as np
import yaml

from federation.programs.client import FederatedClient
from geofm.config.federated import FederatedConfig
from geofm.data.chipstore import write_synthetic_store
from geofm.data.writers import write_geotiff
from geofm.tasks import federated_task
from tests.pretrain.conftest import REPO, TINY_SWIN

DEMO_FED = REPO / "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml"
TRANSFORM = (10.0, 0.0, 500_000.0, 0.0, -10.0, 5_000_000.0)


def _source(name: str, root, **extra) -> dict:
    rgb = {"bands": ["red", "green", "blue"], "mean": [0.5] * 3, "std": [0.2] * 3}
    return {"name": name, "root": str(root), "scale": 1 / 255, **rgb, **extra}


def test_a_client_weighs_the_samples_of_its_share_not_its_files(tmp_path, teacher_file):
    write_geotiff(tmp_path / "scenes/scene.tif", np.ones((3, 1024, 1024), np.uint8), transform=TRANSFORM, crs=32632)
    for i in range(4):
        write_geotiff(tmp_path / f"tiles/{i}.tif", np.ones((3, 64, 64), np.uint8), transform=TRANSFORM, crs=32632)
    write_synthetic_store(tmp_path / "store", 300, ["red", "green", "blue"], 32)  # two shards: 256 and 44 chips
    tree = yaml.safe_load(DEMO_FED.read_text())
    tree["run"] = {"output_dir": str(tmp_path / "run"), "seed": 0}
    tree["model"].update(img_size=32, timm_kwargs=TINY_SWIN)
    tree["task_options"]["masking"]["mask_patch_size"] = 8
    tree["task_options"]["teacher"].update(checkpoint=str(teacher_file), img_size=32, timm_kwargs=TINY_SWIN)
    tree["data"].update(bands=["red", "green", "blue"], sources=[_source("scenes", tmp_path / "scenes", chip_size=64)])
    tree["data"]["sources"].append(_source("tiles", tmp_path / "tiles"))
    tree["data"]["sources"].append({**_source("store", tmp_path / "store", layout="chips"), "scale": 1.0})
    tree["train"].update(micro_batch_size=4, local_epochs=1)
    tree["federation"].update(public_sources=[], min_clients=1)
    tree["algorithm"] = {"name": "fedavg"}
    cfg = FederatedConfig.from_tree(tree)

    task = federated_task(cfg)
    weights = {name: task.client_share(name, own_data=False).num_examples for name in cfg.client_names}
    # A 1024 px scene cut into 64 px chips is 256 samples, a file one, a chip store's shards their chips.
    assert weights == {"scenes": 256, "tiles": 4, "store": 300}
    # A local epoch is the client's samples: 256 / 4 a step, as the pile's epoch is.
    assert FederatedClient(cfg, {"institution": "scenes"})._num_steps() == 64
