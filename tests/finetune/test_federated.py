"""Federated finetuning: every task family trains across clients, validates the global model each round,
and ends with central finetuning's eval.json and best/ weights."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from federation.cli import BUILT_IN
from federation.deploy.commands import COMPLETED
from federation.deploy.local import LocalDeployment
from federation.programs.base import check_simulation_inputs
from federation.programs.client import FederatedClient
from federation.programs.server import FederatedServer
from federation.runtime.contract import CONFIG, DATA_ROOT, INSTITUTION, PROGRAM, config_entry
from federation.runtime.inprocess import InProcess, run_in_process
from federation.runtime.roundloop import run_server
from finetune.cli import register
from finetune.predictor import load_predictor
from geofm.config import read_config_tree
from geofm.config.federated import read_federated_config
from geofm.errors import ConfigError, DatasetNotFoundError
from geofm.fl.algorithms import ALGORITHMS
from geofm.fl.algorithms.fedavg import FedAvg
from geofm.fl.algorithms.local_optimizer import LocalOptimizerWarning
from geofm.fl.algorithms.scaffold import SGD_BASE_LR
from tests.conftest import head_overrides

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).parents[2] / "configs" / "federated"


def _federated(tree: dict, **federation) -> dict:
    """A finetuning tree made federated: 2 clients, 2 rounds of 2 local steps, FedAvg."""
    tree = dict(tree)
    train = {k: v for k, v in tree["train"].items() if k not in ("epochs", "warmup_epochs")}
    tree["train"] = {**train, "local_epochs": None, "local_steps": 2}
    tree["federation"] = {"rounds": 2, "clients": 2, **federation}
    tree["algorithm"] = {"name": "fedavg"}
    tree["run"] = {k: v for k, v in tree["run"].items() if k in ("output_dir", "seed")}
    return tree


def _run(tree: dict) -> Path:
    return run_in_process(read_federated_config(tree))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geofm")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def _rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def test_classification_trains_across_clients_validates_each_round_and_writes_eval(
    finetune_tree, class_folders, tmp_path
):
    tree = _federated(finetune_tree("classification", tmp_path / "fed", data={"root": str(class_folders)}))
    run_dir = _run(tree)
    rounds = _rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2]
    assert all("accuracy" in r["val"] and r["clients"] == ["client00", "client01"] for r in rounds)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["primary_metric"] == "accuracy" and evaluation["split"] == "test"
    assert evaluation["federation"]["algorithm"] == "fedavg" and evaluation["federation"]["rounds"] == 2
    best = json.loads((run_dir / "best/best.json").read_text())
    assert best["value"] == max(r["val"]["accuracy"] for r in rounds)
    partition = json.loads((run_dir / "partition.json").read_text())
    held = [s for client in partition["clients"].values() for s in client["samples"]]
    assert partition["partitioner"] == "iid" and len(held) == len(set(held)) == 24  # 3 classes x 8 train images


def test_a_federated_finetuning_config_is_checked_like_a_finetuning_one(finetune_tree, tmp_path):
    tree = _federated(finetune_tree("classification", tmp_path / "x"))
    with pytest.raises(ConfigError, match="did you mean 'iid'"):
        read_federated_config({**tree, "federation": {**tree["federation"], "partition": "idd"}})
    with pytest.raises(ConfigError, match=r"options\.distill_steps: .*federated finetuning has none"):
        read_federated_config({**tree, "algorithm": {"name": "fedsense", "options": {"distill_steps": 2}}})
    with pytest.raises(ConfigError, match=r"needs federation\.clients"):
        read_federated_config({**tree, "federation": {"rounds": 2}})
    with pytest.raises(
        ConfigError, match=r"federation\.partition_field and federation\.where need federation\.metadata"
    ):
        read_federated_config({**tree, "federation": {**tree["federation"], "partition_field": "majority"}})
    with pytest.raises(ConfigError, match="task: unknown task 'classifcation'; did you mean 'classification'"):
        read_federated_config({**tree, "task": "classifcation"})


def test_a_simulation_checks_the_clients_train_split_before_it_starts(finetune_tree, class_folders, tmp_path):
    tree = _federated(finetune_tree("classification", tmp_path / "fed", data={"root": str(class_folders)}))
    tree["data"]["splits"] = {"train": "no_train", "val": "val", "test": "test"}
    with pytest.raises(DatasetNotFoundError, match=f"the train split folder {class_folders}/no_train does not exist"):
        check_simulation_inputs(read_federated_config(tree), "fed.yaml")


@pytest.mark.parametrize("task", ["multilabel", "segmentation", "change", "superres"])
def test_every_task_family_finetunes_federated_and_is_read_back_as_a_finetuning_run(
    task, random_datasets, finetune_tree, tmp_path
):
    run_dir = _run(_federated(finetune_tree(task, tmp_path / task)))
    rounds = _rounds(run_dir)
    metric = json.loads((run_dir / "eval.json").read_text())["primary_metric"]
    assert [r["round"] for r in rounds] == [1, 2] and all(metric in r["val"] for r in rounds)
    assert (run_dir / "val_curve.png").is_file()
    predictor = load_predictor(run_dir)  # geofm predict's route: the run's config.yaml and best/
    assert predictor.task == task
    if task == "segmentation":  # the decoder's batch norm: the clients' running statistics, averaged
        weights = load_file(run_dir / "best/model.safetensors")
        means = [v for k, v in weights.items() if k.endswith("running_mean")]
        assert means and any(bool(v.abs().sum() > 0) for v in means)


def test_geofm_eval_reevaluates_a_federated_run(class_folders, finetune_tree, tmp_path, capsys):
    run_dir = _run(_federated(finetune_tree("classification", tmp_path / "fed", data={"root": str(class_folders)})))
    args = _parser().parse_args(["eval", f"checkpoint={run_dir}", "split=val"])
    args.handler(args)
    written = json.loads((run_dir / "eval_val.json").read_text())
    best = json.loads((run_dir / "best/best.json").read_text())
    assert written["metrics"]["accuracy"] == pytest.approx(best["metrics"]["accuracy"])


def _resumes_like_unbroken(tree_of: Callable[..., dict]) -> tuple[Path, list[dict], list[dict]]:
    """Run ``tree_of("straight")`` unbroken, and ``tree_of("resumed", stop_after_rounds=1)`` then
    ``tree_of("resumed")``: check the stop and that the resumed run's per-round losses and validation,
    test metrics and kept round are the unbroken run's. Returns the unbroken run and both runs' rounds."""
    straight = _run(tree_of("straight"))
    stopped = _run(tree_of("resumed", stop_after_rounds=1))
    assert [r["round"] for r in _rounds(stopped)] == [1]
    resumed = _run(tree_of("resumed"))
    a, b = _rounds(straight), _rounds(resumed)
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5) and ra["val"] == pytest.approx(rb["val"], rel=1e-5)
    ea, eb = (json.loads((run / "eval.json").read_text()) for run in (straight, resumed))
    assert ea["metrics"] == pytest.approx(eb["metrics"], rel=1e-5) and ea["selected"] == eb["selected"]
    return straight, a, b


def test_a_stopped_federated_finetune_resumes_to_the_same_result(class_folders, finetune_tree, tmp_path):
    """SCAFFOLD keeps state on both sides; the server validates and keeps best/ across the stop."""

    def tree(name: str, **federation) -> dict:
        base = finetune_tree("classification", tmp_path / name, data={"root": str(class_folders)})
        return {**_federated(base, rounds=3, **federation), "algorithm": {"name": "scaffold"}}

    _, _, resumed = _resumes_like_unbroken(tree)
    assert [r["round"] for r in resumed] == [1, 2, 3]


def test_a_metadata_scenario_deals_whole_countries_of_the_kept_season(class_folders, finetune_tree, tmp_path):
    """BigEarthNet's DS2 in miniature: summer samples only, one country per client."""
    metadata = tmp_path / "meta.csv"
    rows = [
        f"{split}/{name}/{i}.tif,{'AT' if i % 2 else 'PT'},{'summer' if i < 6 else 'winter'}"
        for split, count in (("train", 8), ("val", 3))
        for name in ("field", "forest", "water")
        for i in range(count)
    ]
    metadata.write_text("sample,country,season\n" + "\n".join(rows) + "\n")
    scenario = {"partition": "by_field", "partition_field": "country", "metadata": str(metadata)}
    tree = _federated(
        finetune_tree("classification", tmp_path / "ds2", data={"root": str(class_folders)}),
        **scenario,
        where={"season": ["summer"]},
    )
    partition = json.loads((_run(tree) / "partition.json").read_text())
    held = {name: client["samples"] for name, client in partition["clients"].items()}
    assert sorted(len(samples) for samples in held.values()) == [9, 9]  # 18 summer samples, 2 countries
    countries = [{int(s.split("/")[2][0]) % 2 for s in samples} for samples in held.values()]
    assert all(len(c) == 1 for c in countries) and all(int(s.split("/")[2][0]) < 6 for v in held.values() for s in v)
    assert partition["options"]["where"] == {"season": ["summer"]}
    with pytest.raises(ConfigError, match=r"needs federation\.partition_field"):
        read_federated_config(_federated(finetune_tree("classification", tmp_path / "x"), partition="by_field"))


@pytest.fixture(scope="module")
def demo_archive(tmp_path_factory) -> Path:
    from geofm.data.demo import make_demo_archive

    root = tmp_path_factory.mktemp("demo")
    make_demo_archive(root)
    return root


@pytest.mark.parametrize("task", ["classification", "segmentation", "change"])
def test_a_shipped_demo_federated_finetune_runs_on_the_demo_archive(task, demo_archive, tmp_path):
    config = CONFIGS / f"demo_fedavg_{task}__swin_micro__3clients.yaml"
    overrides = [
        "checkpoint=null",
        f"run.output_dir={tmp_path / task}",
        f"data.root={demo_archive / 'finetune' / task}",
        "data.num_workers=0",
        *head_overrides(task),
        "train.micro_batch_size=4",
        "federation.rounds=2",
        "train.local_epochs=1",
    ]
    run_dir = _run(read_config_tree(config, overrides))
    assert [r["round"] for r in _rounds(run_dir)] == [1, 2]
    assert json.loads((run_dir / "eval.json").read_text())["federation"]["clients"] == [
        "client00",
        "client01",
        "client02",
    ]


class _PersonalisedFedAvg(FedAvg):
    """FedAvg declaring its clients' own models its product, to exercise the clients' own validation."""

    name = "personalised_fedavg"
    personalised = True


def test_a_personalised_algorithm_logs_each_clients_own_validation(class_folders, finetune_tree, tmp_path):
    ALGORITHMS.register(_PersonalisedFedAvg.name, _PersonalisedFedAvg)
    tree = _federated(finetune_tree("classification", tmp_path / "own", data={"root": str(class_folders)}))
    run_dir = _run({**tree, "algorithm": {"name": _PersonalisedFedAvg.name}})
    for record in _rounds(run_dir):
        own = record["clients_val"]["accuracy"]
        values = list(own["clients"].values())
        assert sorted(own["clients"]) == ["client00", "client01"]
        assert own["mean"] == pytest.approx(sum(values) / 2) and own["std"] == pytest.approx(
            abs(values[0] - values[1]) / 2
        )
    val = json.loads((run_dir / "partition_val.json").read_text())
    held = sorted(s for client in val["clients"].values() for s in client["samples"])
    assert len(held) == 9 and all(s.startswith("val/") for s in held)  # 3 classes x 3 val images, each once
    assert (
        "clients_val"
        not in _rounds(
            _run(_federated(finetune_tree("classification", tmp_path / "avg", data={"root": str(class_folders)})))
        )[0]
    )


def test_a_federated_finetune_deployed_with_tls_ends_as_the_same_run_in_one_process(
    class_folders, finetune_tree, tmp_path, one_torch_thread
):
    """SuperLink and SuperNodes on this machine (TLS, node authentication) run the finetuning config,
    each node on the whole train split its data-root holds; with one thread per process both ways it
    keeps the very weights the same nodes keep in one process. A server without the held-out splits
    stops before the first round, naming them."""
    # The server holds the held-out splits it validates and tests on; each node trains on its own data-root.
    tree = _federated(finetune_tree("classification", tmp_path / "deployed", data={"root": str(class_folders)}))
    names = read_federated_config(tree).client_names
    roots = dict.fromkeys(names, str(class_folders))
    with LocalDeployment(tmp_path / "fed", names, data_roots=roots, env={"OMP_NUM_THREADS": "1"}) as deployment:
        run_id = deployment.launch({PROGRAM: BUILT_IN, CONFIG: config_entry(tree)})
        run = deployment.wait(run_id)
        log = deployment.logs(run_id)
    assert run["status"] == COMPLETED, f"run {run_id} ended {run['status']}:\n{log}"
    assert "round 2: val" in log, log
    assert [r["round"] for r in _rounds(tmp_path / "deployed")] == [1, 2]

    local = read_federated_config({**tree, "run": {**tree["run"], "output_dir": str(tmp_path / "local")}})
    nodes = {i + 1: FederatedClient(local, {INSTITUTION: n, DATA_ROOT: roots[n]}) for i, n in enumerate(names)}
    run_server(FederatedServer(local), InProcess(nodes), poll_s=0)
    deployed, alone = (load_file(tmp_path / name / "best/model.safetensors") for name in ("deployed", "local"))
    assert all(torch.equal(deployed[k], alone[k]) for k in deployed), "deployed and in one process: the same model"
    evaluations = [json.loads((tmp_path / name / "eval.json").read_text()) for name in ("deployed", "local")]
    assert evaluations[0]["metrics"] == evaluations[1]["metrics"]
    with pytest.raises(DatasetNotFoundError, match="the val split folder /nonexistent/val does not exist"):
        FederatedServer(read_federated_config({**tree, "data": {**tree["data"], "root": "/nonexistent"}}))


def test_a_client_holding_fewer_samples_than_a_batch_trains_on_them_repeated(class_folders, finetune_tree, tmp_path):
    """Under strong label skew a client may hold a handful of samples: it still takes its local steps."""
    tree = _federated(finetune_tree("classification", tmp_path / "skew", data={"root": str(class_folders)}))
    tree["train"]["micro_batch_size"] = 16  # more than either client's 12 samples
    rounds = _rounds(_run(tree))
    assert all(r["clients"] == ["client00", "client01"] and not r["failed"] for r in rounds)


def test_the_rounds_record_the_local_optimiser_the_algorithm_declares_or_the_config_overrides(
    finetune_tree, class_folders, tmp_path
):
    tree = _federated(finetune_tree("classification", tmp_path / "sgd", data={"root": str(class_folders)}))
    tree["algorithm"] = {"name": "scaffold"}
    train = read_federated_config(tree).train
    rounds = _rounds(_run(tree))
    peak = SGD_BASE_LR * train.micro_batch_size * train.grad_accum_steps / train.lr_reference_batch
    assert all(
        r["local_optimizer"] == {"name": "sgd", "base_lr": SGD_BASE_LR, "momentum": 0.0, "weight_decay": 0.0}
        for r in rounds
    )
    assert [r["lr"] for r in rounds] == pytest.approx([peak, peak])

    tree = {**tree, "train": {**tree["train"], "optimizer": {"name": "adamw"}}}
    tree["run"] = {**tree["run"], "output_dir": str(tmp_path / "adamw")}
    with pytest.warns(LocalOptimizerWarning, match="algorithm scaffold: its analysis assumes local sgd"):
        rounds = _rounds(_run(tree))
    assert rounds[-1]["local_optimizer"] == {
        "name": "adamw",
        "base_lr": train.base_lr,
        "weight_decay": train.weight_decay,
    }
    assert rounds[-1]["lr"] == pytest.approx(peak / SGD_BASE_LR * train.base_lr)


@pytest.mark.slow
def test_sweep_seeds_runs_a_sweeps_cells_once_per_seed_and_reads_finished_runs_back(
    finetune_tree, class_folders, tmp_path, capsys
):
    from benchmarks import sweep_seeds

    base = _federated(finetune_tree("classification", tmp_path / "base", data={"root": str(class_folders)}))
    (tmp_path / "base.json").write_text(json.dumps(base))  # JSON is YAML; a sweep's config is relative to it
    sweep = {
        "config": "base.json",
        "output_dir": str(tmp_path / "sweep"),
        "algorithms": {"fedavg": {}, "fedprox": {"options": {"proximal_beta": 0.01}}},
        "scenarios": {"iid": {"partition": "iid"}},
    }
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    argv = [str(tmp_path / "sweep.json"), "--seeds", "0", "1", "--algorithms", "fedavg", "--out", str(tmp_path / "s")]
    sweep_seeds.main(argv)
    results = json.loads((tmp_path / "s" / "seeds.json").read_text())
    assert list(results) == ["iid/fedavg"] and sorted(results["iid/fedavg"]) == ["0", "1"]
    assert all(
        0 <= run["test_accuracy"] <= 1 and run["local_optimizer"]["name"] == "adamw"
        for run in results["iid/fedavg"].values()
    )
    assert "| iid | fedavg | adamw" in (tmp_path / "s" / "seeds.md").read_text()
    finished = (tmp_path / "s" / "seed0" / "iid" / "fedavg" / "eval.json").stat().st_mtime_ns
    capsys.readouterr()
    sweep_seeds.main(argv)  # both runs are finished: read back, not run again
    assert " s\n" not in capsys.readouterr().out
    assert (tmp_path / "s" / "seed0" / "iid" / "fedavg" / "eval.json").stat().st_mtime_ns == finished
