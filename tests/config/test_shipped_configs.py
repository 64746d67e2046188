"""Every config shipped under configs/ resolves against its program's schema, and its torchgeo class takes it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from federation.sweep import read_sweep
from geofm.config.base import read_config_tree
from geofm.config.ensemble import EnsembleConfig
from geofm.config.feddiff import FedDiffConfig
from geofm.config.federated import read_federated_config
from geofm.config.finetune import FinetuneConfig
from geofm.config.oscar import OscarConfig
from geofm.config.pretrain import PretrainConfig
from geofm.data.finetune.torchgeo import check_torchgeo_arguments
from geofm.errors import ConfigError
from geofm.integrations.terratorch import geofm_backbone

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _terratorch_config(path: Path) -> dict:
    """A TerraTorch config (TerraTorch has its own venv): its geofm backbone's arguments bind to geofm_backbone."""
    cfg = yaml.safe_load(path.read_text())
    model_args = cfg["model"]["init_args"]["model_args"]
    assert model_args["backbone"] == "geofm_export" and cfg["custom_modules_path"] == "geofm_terratorch"
    backbone = {k.removeprefix("backbone_"): v for k, v in model_args.items() if k.startswith("backbone_")}
    inspect.signature(geofm_backbone).bind(**backbone)
    return cfg


SCHEMAS = {
    "pretrain": PretrainConfig.from_file,
    "federated": lambda path: read_federated_config(read_config_tree(path), str(path)),  # the task's config class
    "finetune": FinetuneConfig.from_file,
    "feddiff": FedDiffConfig.from_file,
    "oscar": OscarConfig.from_file,
    "ensemble": EnsembleConfig.from_file,
    "terratorch": _terratorch_config,
}
SWEEPS = "sweeps"  # sweep files: every cell's config resolves against the federated schema
SHIPPED = sorted(path for path in CONFIGS.glob("*/*.yaml") if path.parent.name != SWEEPS)


def test_every_config_folder_has_a_schema():
    assert SHIPPED and {path.parent.name for path in SHIPPED} <= set(SCHEMAS)
    assert {path.parent.name for path in CONFIGS.glob("*/*.yaml")} <= {*SCHEMAS, SWEEPS}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob(f"{SWEEPS}/*.yaml")), ids=lambda path: path.name)
def test_a_shipped_sweep_resolves_every_cell(path):
    _, cells = read_sweep(path)
    assert cells


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_shipped_config_resolves(path):
    cfg = SCHEMAS[path.parent.name](path)
    if isinstance(cfg, FinetuneConfig) and cfg.data.torchgeo:
        check_torchgeo_arguments(cfg.data, cfg.task)


def test_a_split_the_class_lacks_is_named_with_the_splits_it_has(task_config):
    cfg = task_config("segmentation", data={"torchgeo": "Vaihingen2D", "splits": {"val": "val"}})
    with pytest.raises(
        ConfigError, match=r"data.splits.val: Vaihingen2D has no split 'val'; its splits are \['train', 'test'\]"
    ):
        check_torchgeo_arguments(cfg.data, cfg.task)
    cfg = task_config(
        "segmentation", data={"torchgeo": "Vaihingen2D", "splits": {"val": "test"}, "kwargs": {"scene": 1}}
    )
    with pytest.raises(ConfigError, match=r"data.kwargs \{'scene': 1\}: .*unexpected keyword argument 'scene'"):
        check_torchgeo_arguments(cfg.data, cfg.task)
