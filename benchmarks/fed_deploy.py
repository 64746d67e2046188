"""``geofm bench fed-deploy``: seconds per round of one federated config simulated and deployed on loopback.

The same config (the demo's FedSense by default, on a fresh synthetic archive with random teacher
weights) runs three ways, one after the other: in Flower's simulation engine (``geofm fed simulate``,
whose node processes live for the run), deployed on 127.0.0.1 with TLS and SuperNode authentication
(:class:`~federation.deploy.local.LocalDeployment`) as shipped, where each node's long-lived
worker answers every message (the SuperNodes with ``geofm fed supernode --poll-s 0.2``), and deployed with a ClientApp that builds the client program in each
message's own process (``client_app_without_worker``, how deployed nodes ran before the worker).
The figure is the server's ``seconds`` per round from ``rounds.jsonl`` (configure to aggregate,
both included); the first round, which starts the nodes' processes, is reported apart. The
exported backbones are compared too: every mode runs with one thread per client
(``OMP_NUM_THREADS=1``, as Ray gives each simulated node), so they should agree exactly.
A deployed round's time above the simulated one is the deployment's fixed cost (Flower's
messaging and each message's ClientApp process); it is reported in seconds and as a share of
the round. ``institutions=N`` keeps a config's first N client sources (and its public ones), so
that the paper's setting runs on the synthetic archive, whose RGB images stand in for any source
the archive does not have.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import Report, Target, child_env, repo_path

DEFAULTS: dict[str, Any] = {
    "config": "configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml",
    "overrides": [],
    "rounds": 8,
    "num_cpus": 2,
    "modes": ["simulated", "deployed", "deployed_without_worker"],
    "institutions": None,  # N: the config's first N client sources (and its public ones) on the synthetic archive
}
QUICK: dict[str, Any] = {
    "rounds": 2,
    "modes": ["simulated", "deployed"],
    "overrides": ["train.local_steps=1", "train.local_epochs=null"],
    "institutions": 2,
}
MODES = ("simulated", "deployed", "deployed_without_worker")


def _prepare(settings: dict[str, Any], folder: Path, mode: str) -> tuple[Path, dict]:
    """A config file of the run for ``mode``: its own output folder, the synthetic archive, random teacher weights."""
    from geofm.config import read_config_tree

    tree = read_config_tree(repo_path(settings["config"]), settings["overrides"])
    tree["run"] = {**tree.get("run", {}), "output_dir": str(folder / mode)}
    tree["federation"] = {**tree["federation"], "rounds": settings["rounds"], "stop_after_rounds": None}
    if settings["institutions"] is not None:
        _shrink(tree, settings["institutions"])
    for source in tree["data"]["sources"]:
        if (folder / "archive" / source["name"]).is_dir():
            source["root"] = str(folder / "archive" / source["name"])
        else:  # another config's source (RGB, as the paper's): the synthetic archive's RGB images stand in
            public = source["name"] in tree["federation"].get("public_sources", [])
            source["root"] = str(folder / "archive" / ("public_rgb" if public else "aerial_rgb"))
            source["pattern"] = "*.tif"
    teacher = tree.get("task_options", {}).get("teacher")
    if teacher:
        teacher["checkpoint"] = str(folder / "teacher.pth")
    path = folder / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path, tree


def _shrink(tree: dict, institutions: int) -> None:
    """Keep the config's first ``institutions`` client sources and its public ones, all of them required."""
    public = tree["federation"].get("public_sources", [])
    clients = [source for source in tree["data"]["sources"] if source["name"] not in public]
    if not 1 <= institutions <= len(clients):
        raise ValueError(f"institutions={institutions}: the config has {len(clients)} client sources")
    kept = clients[:institutions] + [source for source in tree["data"]["sources"] if source["name"] in public]
    tree["data"]["sources"] = kept
    tree["federation"]["min_clients"] = institutions


def _teacher(tree: dict, path: Path) -> None:
    import torch

    from geofm.config.federated import FederatedConfig
    from geofm.models.backbones import backbone_kwargs, create_backbone
    from geofm.tasks.mim.task import mim_options

    t = mim_options(FederatedConfig.from_tree(tree)).teacher
    kwargs = backbone_kwargs(in_chans=3, img_size=t.img_size, window_size=t.window_size, timm_kwargs=t.timm_kwargs)
    torch.save(create_backbone(t.arch, kwargs).state_dict(), path)


def _simulate(config: Path, num_cpus: int) -> None:
    command = [
        sys.executable,
        "-m",
        "geofm.cli",
        "fed",
        "simulate",
        "--config",
        str(config),
        "--num-cpus",
        str(num_cpus),
    ]
    done = subprocess.run(command, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"simulation failed:\n{done.stderr[-3000:]}")


def _deploy(config: Path, tree: dict, folder: Path, with_worker: bool) -> None:
    from federation.cli import BUILT_IN
    from federation.deploy.commands import APP_DIR, COMPLETED, NODE_POLL_S
    from federation.deploy.local import LocalDeployment
    from federation.runtime.contract import CONFIG, PROGRAM, config_entry
    from geofm.config.federated import FederatedConfig

    app_dir = APP_DIR
    if not with_worker:
        app_dir = folder / "app_without_worker"
        app_dir.mkdir(exist_ok=True)
        text = (APP_DIR / "pyproject.toml").read_text()
        (app_dir / "pyproject.toml").write_text(text.replace(":client_app", ":client_app_without_worker"))
    names = FederatedConfig.from_tree(tree).client_names
    roots = {source["name"]: source["root"] for source in tree["data"]["sources"] if source["name"] in names}
    home = folder / ("fed" if with_worker else "fed_without_worker")
    env = {"OMP_NUM_THREADS": "1"}
    with LocalDeployment(home, names, data_roots=roots, env=env, poll_s=NODE_POLL_S) as deployment:
        run_id = deployment.launch({PROGRAM: BUILT_IN, CONFIG: config_entry(tree)}, app_dir)
        run = deployment.wait(run_id)
        if run["status"] != COMPLETED:
            raise RuntimeError(f"deployed run ended {run['status']}:\n{deployment.logs(run_id)[-3000:]}")


def _round_seconds(run_dir: Path) -> list[float]:
    import json

    return [json.loads(line)["seconds"] for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def _weight_differences(folder: Path, modes: dict[str, list[float]]) -> dict[str, float]:
    """Largest absolute difference of each deployed run's exported backbone from the simulated run's."""
    from safetensors.torch import load_file

    if "simulated" not in modes:
        return {}
    reference = load_file(folder / "simulated" / "backbone.safetensors")
    differences = {}
    for mode in modes:
        if mode != "simulated":
            weights = load_file(folder / mode / "backbone.safetensors")
            differences[mode] = max(float((weights[k] - v).abs().max()) for k, v in reference.items())
    return differences


def run(settings: dict[str, Any]) -> Report:
    from geofm.data.demo import make_demo_archive

    unknown = sorted(set(settings["modes"]) - set(MODES))
    if unknown:
        raise ValueError(f"modes {unknown}: expected some of {list(MODES)}")
    seconds: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_demo_archive(folder / "archive", seed=0)
        for mode in settings["modes"]:
            config, tree = _prepare(settings, folder, mode)
            if tree.get("task_options", {}).get("teacher") and not (folder / "teacher.pth").exists():
                _teacher(tree, folder / "teacher.pth")
            if mode == "simulated":
                _simulate(config, settings["num_cpus"])
            else:
                _deploy(config, tree, folder, with_worker=mode == "deployed")
            seconds[mode] = _round_seconds(folder / mode)
        differences = _weight_differences(folder, seconds)

    later = {mode: statistics.median(s[1:]) for mode, s in seconds.items() if len(s) > 1}
    results: dict[str, Any] = {
        "round_s": seconds,
        "first_round_s": {mode: s[0] for mode, s in seconds.items()},
        "median_later_round_s": later,
        "max_abs_weight_difference_vs_simulated": differences,
    }
    targets = []
    above: dict[str, float] = {}
    if "simulated" in later:
        for mode in ("deployed", "deployed_without_worker"):
            if mode in later:
                results[f"{mode}_over_simulated"] = later[mode] / later["simulated"]
                above[mode] = later[mode] - later["simulated"]
        # The deployment's fixed cost per round (Flower's messaging and process starts) and its share of the round.
        results["deployed_above_simulated_s"] = above
        results["fixed_cost_share"] = {mode: extra / later[mode] for mode, extra in above.items()}
        if "deployed" in above:
            targets.append(
                Target("deployed round above simulated", above["deployed"], "<=", 2.0, "s", "rounds 2 on, medians")
            )
    rows = [
        {
            "mode": mode,
            "first round s": s[0],
            "median later round s": later.get(mode),
            "above simulated s": above.get(mode),
            "fixed share": results.get("fixed_cost_share", {}).get(mode),
            "rounds": len(s),
        }
        for mode, s in seconds.items()
    ]
    notes = [
        "modes run one after the other on the same archive and config; per-round seconds are the server's",
        "(configure to aggregate), so they include each node's ClientApp start, transfer and local training",
    ]
    return Report(results=results, targets=targets, rows=rows, notes=notes)
