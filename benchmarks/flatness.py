"""``geofm bench flatness``: federated algorithms side by side on heterogeneous clients, with how flat their global model is.

On the synthetic demo archive, every method (an ``algorithm`` section: a registered name, or a
mapping with ``name`` and its settings, ``label`` optional) trains from the same seed under two
heterogeneous partitions:

* ``dirichlet``: federated scene classification (the shipped demo config
  ``configs/federated/demo_fedavg_classification__swin_micro__3clients.yaml``) with each class dealt
  to the clients in Dir(``dirichlet_alpha``) proportions (label skew). The metric is the global
  model's validation accuracy after the last round (``rounds.jsonl``).
* ``by_sensor``: the demo's labelled data come from one sensor, so clients that are sensors train
  masked image modelling: the shipped FedSense demo config's sources (aerial RGB, 4-band satellite,
  drone RGB+NIR) with ``partition: by_source``, as plain SimMIM (no teacher, no public source), each
  sensor's scenes ``scene_000``-``scene_019`` for training and ``scene_020``-``scene_023`` held out.
  The metric is the global model's MIM loss on the held-out scenes (lower is better).

For each global model the flatness measure (:mod:`geofm.fl.landscape`) is the mean increase of
the same validation loss under ``draws`` random perturbations of norm ``radius``, with its spread
over the draws. Differential privacy: FedAvg with ``algorithm.privacy`` (``privacy`` settings) at each
of ``noise_multipliers`` on the ``dirichlet`` partition, reporting the metric against the epsilon of
its last round. Results go to ``output_dir`` as ``flatness.json`` and ``flatness.md`` (the tables,
the command that reproduces them, the settings); each run's folder is kept below ``runs/``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Report

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "federated"
CLASSIFICATION = CONFIGS / "demo_fedavg_classification__swin_micro__3clients.yaml"
SENSORS = CONFIGS / "demo_fedsense_swin_micro__3inst__1bit_ef.yaml"
PARTITIONS = ("dirichlet", "by_sensor")
TRAIN_SCENES, HELD_OUT_SCENES = "scene_0[01]?.tif", "scene_02?.tif"  # 20 and 4 of the demo's 24 per sensor

DEFAULTS: dict[str, Any] = {
    "archive": None,  # a demo archive folder; None writes one to a temporary folder
    "output_dir": "runs/bench/flatness",
    "methods": ["fedavg", "fedsam", "fedasam", "swa", "wima", "fedgloss", "fedalign"],
    "partitions": list(PARTITIONS),
    "seeds": [0],
    "clients": 3,  # dirichlet: clients (by_sensor: one per sensor, 3)
    "dirichlet_alpha": 0.1,
    "rounds": 8,  # dirichlet (classification) rounds, the demo config's; by 15 FedAvg scores all 12 val scenes
    "local_steps": 4,
    "sensor_rounds": 20,  # by_sensor (masked image modelling) rounds
    "sensor_local_steps": 4,
    "img_size": 64,
    "embed_dim": 24,
    "radius": 10.0,  # norm of each perturbation over all trainable parameters (their norm: about 50)
    "draws": 64,
    "views": 2,  # by_sensor: crops and masks drawn per held-out scene
    "noise_multipliers": [0.3, 1.0, 3.0],  # DP runs (FedAvg, dirichlet); [] runs none
    "privacy": {"mode": "central", "clip": 1.0, "delta": 1.0e-5},
}
QUICK: dict[str, Any] = {
    "methods": ["fedavg", {"name": "fedprox", "options": {"proximal_beta": 0.01}}],
    "rounds": 1,
    "local_steps": 1,
    "sensor_rounds": 1,
    "sensor_local_steps": 1,
    "img_size": 32,
    "embed_dim": 16,
    "draws": 2,
    "views": 1,
    "noise_multipliers": [],
}


def method_sections(methods: list[Any], setting: str = "methods") -> dict[str, dict[str, Any]]:
    """Each method's label and ``algorithm`` section (``setting``: the benchmark setting that lists them, for errors).

    Raises:
        ConfigError: a method that is neither a name nor a mapping with ``name``, a label given twice,
            or algorithms that are not registered (all of them named).
    """
    from geofm.errors import ConfigError
    from geofm.fl.algorithms import ALGORITHMS

    sections: dict[str, dict[str, Any]] = {}
    for method in methods:
        if isinstance(method, str):
            method = {"name": method}
        if not isinstance(method, dict) or not isinstance(method.get("name"), str):
            raise ConfigError(f"{setting}: {method!r} is neither an algorithm name nor a mapping with a 'name'")
        section = {k: v for k, v in method.items() if k != "label"}
        label = str(method.get("label", method["name"]))
        if label in sections:
            raise ConfigError(f"{setting}: {label!r} appears twice; give one a 'label'")
        sections[label] = section
    missing = sorted({s["name"] for s in sections.values()} - set(ALGORITHMS.names()))
    if missing:
        raise ConfigError(
            f"{setting}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a registered algorithm "
            f"(registered: {', '.join(ALGORITHMS.names())}); pick others with {setting}=[...]"
        )
    return sections


def _model(tree: dict, settings: dict[str, Any]) -> None:
    kwargs = tree["model"]["timm_kwargs"]
    tree["model"].update(img_size=settings["img_size"], timm_kwargs={**kwargs, "embed_dim": settings["embed_dim"]})


def classification_config(settings: dict, archive: Path, algorithm: dict, seed: int, out: Path):
    """The shipped federated classification demo under Dirichlet label skew, from random initialisation."""
    from geofm.config import read_config_tree
    from geofm.config.federated import read_federated_config

    tree = read_config_tree(CLASSIFICATION, [])
    _model(tree, settings)
    tree.update(checkpoint=None, algorithm=algorithm)
    tree["run"] = {"output_dir": str(out), "seed": seed, "progress": False}
    tree["data"].update(root=str(archive / "finetune" / "classification"), num_workers=0)
    tree["train"].update(local_epochs=None, local_steps=settings["local_steps"])
    tree["federation"].update(
        rounds=settings["rounds"],
        clients=settings["clients"],
        partition="dirichlet",
        dirichlet_alpha=settings["dirichlet_alpha"],
    )
    return read_federated_config(tree, "geofm bench flatness (dirichlet)")


def sensor_config(settings: dict, archive: Path, algorithm: dict, seed: int, out: Path, pattern: str = TRAIN_SCENES):
    """The shipped FedSense demo's sensors as clients (``by_source``), plain SimMIM on their ``pattern`` scenes."""
    from geofm.config import read_config_tree
    from geofm.config.federated import read_federated_config

    tree = read_config_tree(SENSORS, [])
    _model(tree, settings)
    public = set(tree["federation"]["public_sources"])
    sources = [s for s in tree["data"]["sources"] if s["name"] not in public]
    for source in sources:
        source.update(root=str(archive / source["name"]), pattern=pattern)
    tree.update(task_options={**tree["task_options"], "teacher": None}, algorithm=algorithm)
    tree["run"] = {"output_dir": str(out), "seed": seed, "progress": False}
    tree["data"]["sources"] = sources
    tree["train"].update(local_epochs=None, local_steps=settings["sensor_local_steps"])
    tree["federation"].update(rounds=settings["sensor_rounds"], partition="by_source", public_sources=[])
    return read_federated_config(tree, "geofm bench flatness (by_sensor)")


def held_out_batches(settings: dict, archive: Path) -> list[dict]:
    """The by_sensor validation batches: ``views`` seeded crops and masks of every held-out scene."""
    from torch.utils.data import DataLoader

    from geofm.data.pile import PileIndex, PretrainPile
    from geofm.tasks.mim.task import MaskedImageModelling

    cfg = sensor_config(settings, archive, {"name": "fedavg"}, 0, archive / "unused", HELD_OUT_SCENES)
    task = MaskedImageModelling(cfg)
    pile = PretrainPile(cfg.data, cfg.model.img_size, mask_fn=task._masks())
    indices = [
        PileIndex(source, file, 1000 * view + 100 * source + file)
        for source, size in enumerate(pile.source_sizes)
        for file in range(size)
        for view in range(settings["views"])
    ]
    return list(DataLoader(pile, batch_size=cfg.train.micro_batch_size, sampler=indices))


def global_model(server):
    """The global model as the server validated it last: the algorithm's evaluated model, its local
    parameters and the averaged batch-norm statistics (finetuning's export left the best round's in)."""
    from geofm.fl.parameter_vectors import load_running_statistics

    server.layout.assign(server.model, server.algorithm.evaluated_model(server.global_model))
    local = server.algorithm.server_local()
    if local is not None:
        server.algorithm.local.assign(server.model, local)
    if server.statistics is not None:
        load_running_statistics(server.model, server.statistics)
    return server.model


def run_method(cfg, settings: dict, sensor_batches: list[dict] | None) -> dict[str, Any]:
    """Train one federated run in this process, then measure its global model."""
    from federation.programs.client import FederatedClient
    from federation.programs.server import FederatedServer
    from federation.runtime.inprocess import InProcess
    from federation.runtime.roundloop import run_server
    from finetune.evaluate import eval_loader
    from geofm.fl.landscape import flatness
    from geofm.runlog import ROUNDS_LOG

    shutil.rmtree(cfg.run.output_dir, ignore_errors=True)  # a kept run folder would be resumed, not rerun
    started, cpu = time.perf_counter(), time.process_time()
    server = FederatedServer(cfg)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    run_server(server, InProcess(clients), poll_s=0)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    rounds = [json.loads(line) for line in (cfg.run.output_dir / ROUNDS_LOG).read_text().splitlines()]
    task, model = server.task, global_model(server)
    if sensor_batches is None:  # finetuning: the task's loss on the validation split, unmixed
        batches = list(eval_loader(task.val_set, cfg, task.device))

        def loss(m, batch):
            return task.task.forward(m, batch, task.device, task.dtype, mix=False).losses["loss"]
    else:
        batches = sensor_batches

        def loss(m, batch):
            return task.forward(m, batch).losses["loss"]

    started = time.perf_counter()
    measured = flatness(model, batches, loss, settings["radius"], settings["draws"], seed=cfg.run.seed)
    metric = rounds[-1]["val"][cfg.primary_metric] if sensor_batches is None else measured.loss
    privacy = {k: rounds[-1][k] for k in ("epsilon", "delta") if k in rounds[-1]}
    return {
        "metric": metric,
        "flatness": measured.record(),
        "train_seconds": seconds,
        "train_cpu_seconds": cpu,
        "measure_seconds": time.perf_counter() - started,
        **privacy,
    }


def _spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's runs over the seeds: the metric's mean and std over seeds, the flatness mean over
    seeds with the std over every draw (pooled), the mean seconds."""
    metric, metric_std = _spread([r["metric"] for r in runs])
    draws = [r["flatness"] for r in runs]
    pooled = statistics.fmean(d["increase_std"] ** 2 for d in draws) ** 0.5
    return {
        "metric": metric,
        "metric_std": metric_std,
        "flatness": statistics.fmean(d["increase_mean"] for d in draws),
        "flatness_std": pooled,
        "loss": statistics.fmean(d["loss"] for d in draws),
        "seconds": statistics.fmean(r["train_seconds"] for r in runs),
        "cpu_seconds": statistics.fmean(r["train_cpu_seconds"] for r in runs),
        **({"epsilon": statistics.fmean(r["epsilon"] for r in runs)} if all("epsilon" in r for r in runs) else {}),
        "seeds": runs,
    }


METRICS = {"dirichlet": "val accuracy (higher is better)", "by_sensor": "held-out MIM loss (lower is better)"}


def verdicts(results: dict[str, dict[str, Any]]) -> list[str]:
    """Per partition, which methods beat FedAvg's metric by more than the seeds' spread, and which did not."""
    notes = []
    for partition, methods in results.items():
        base = methods.get("fedavg")
        if base is None:
            continue
        sign = -1.0 if partition == "by_sensor" else 1.0
        better, not_better = [], []
        for label, row in methods.items():
            if label == "fedavg":
                continue
            gain = sign * (row["metric"] - base["metric"])
            (better if gain > max(row["metric_std"], base["metric_std"]) else not_better).append(
                f"{label} ({gain:+.3f})"
            )
        if not_better:
            notes.append(
                f"{partition}: no gain over FedAvg beyond the seeds' spread for {', '.join(not_better)} "
                "(the metric's change, positive when better)"
            )
        if better:
            notes.append(f"{partition}: better than FedAvg beyond the seeds' spread: {', '.join(better)}")
    return notes


def _cells(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "metric": f"{row['metric']:.4f}" + (f" +- {row['metric_std']:.4f}" if row["metric_std"] else ""),
        "flatness": f"{row['flatness']:.4g} +- {row['flatness_std']:.2g}",
        "val loss": round(row["loss"], 4),
        "train s": round(row["seconds"], 1),
        "cpu s": round(row["cpu_seconds"], 1),
    }


def command_of(settings: dict[str, Any]) -> str:
    """The command that reruns these settings: every setting that differs from the defaults."""
    pairs = [
        f"{k}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}"
        for k, v in settings.items()
        if v != DEFAULTS[k]
    ]
    return " ".join(["geofm bench flatness", *(f"'{p}'" if any(c in p for c in ' {}[]"') else p for p in pairs)])


def markdown(settings: dict[str, Any], results: dict[str, Any], rows: list[dict], dp: list[dict], notes: list[str]):
    """The tables of a run as Markdown, with the command that produced them."""

    def table(records: list[dict]) -> list[str]:
        head = list(records[0])
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        return [*lines, *("| " + " | ".join(str(r[k]) for k in head) + " |" for r in records), ""]

    lines = [f"Command: `{command_of(settings)}`", ""]
    lines += [f"Flatness: mean loss increase under {settings['draws']} draws of norm {settings['radius']}", ""]
    lines += table(rows) if rows else []
    lines += table(dp) if dp else []
    return "\n".join([*lines, *(f"- {n}" for n in notes)]) + "\n"


def run(settings: dict[str, Any]) -> Report:
    from geofm.data.demo import make_demo_archive
    from geofm.errors import ConfigError

    sections = method_sections(settings["methods"])
    unknown = sorted(set(settings["partitions"]) - set(PARTITIONS))
    if unknown:
        raise ConfigError(f"partitions: {unknown} are not among {list(PARTITIONS)}")
    out = Path(settings["output_dir"])
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(settings["archive"]) if settings["archive"] else Path(tmp) / "demo"
        make_demo_archive(archive, seed=0)
        sensor_batches = held_out_batches(settings, archive) if "by_sensor" in settings["partitions"] else None
        arms = [(p, label, section) for p in settings["partitions"] for label, section in sections.items()]
        base = {"name": "fedavg", **next((s for s in sections.values() if s["name"] == "fedavg"), {})}
        arms += [
            ("dp", f"noise {z:g}", {**base, "privacy": {**settings["privacy"], "noise_multiplier": z}})
            for z in settings["noise_multipliers"]
        ]
        for partition, label, section in arms:
            runs = []
            for seed in settings["seeds"]:
                folder = out / "runs" / partition / f"{label.replace(' ', '_')}_seed{seed}"
                if partition == "by_sensor":
                    cfg = sensor_config(settings, archive, section, seed, folder)
                    runs.append(run_method(cfg, settings, sensor_batches))
                else:
                    cfg = classification_config(settings, archive, section, seed, folder)
                    runs.append(run_method(cfg, settings, None))
            results.setdefault(partition, {})[label] = summarise(runs)
    rows = [
        {"partition": p, "method": label, **_cells(row)}
        for p, methods in results.items()
        if p != "dp"
        for label, row in methods.items()
    ]
    dp = [
        {"noise multiplier": z, "epsilon": f"{row.get('epsilon', float('nan')):.4g}", **_cells(row)}
        for z, row in zip(settings["noise_multipliers"], results.get("dp", {}).values(), strict=True)
    ]
    if dp and "fedavg" in results.get("dirichlet", {}):
        dp.insert(0, {"noise multiplier": "none", "epsilon": "inf", **_cells(results["dirichlet"]["fedavg"])})
    notes = [f"{p} metric: {METRICS[p]}" for p in results if p != "dp"]
    if dp:
        notes.append(f"dp: FedAvg with algorithm.privacy {settings['privacy']} on dirichlet; epsilon of the last round")
    notes += verdicts({p: m for p, m in results.items() if p != "dp"})
    if len(settings["seeds"]) == 1:
        notes.append("one seed: the metric has no spread over seeds, so any difference may be run-to-run noise")
    out.mkdir(parents=True, exist_ok=True)
    (out / "flatness.json").write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    (out / "flatness.md").write_text(markdown(settings, results, rows, dp, notes))
    notes.append(f"wrote {out / 'flatness.md'} and {out / 'flatness.json'}")
    return Report(results={"command": command_of(settings), **results}, rows=rows + dp, notes=notes)
