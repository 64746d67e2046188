"""A sweep file's cells over several seeds, each run in this process: mean and spread per algorithm and scenario.

``python -m benchmarks.sweep_seeds SWEEP.yaml --seeds 0 1 2 [--out DIR] [key=value ...]`` runs every
cell of the sweep (:mod:`federation.sweep`) once per seed (``run.seed``: the partition, the clients'
batches and the heads' initialisation) with its clients in this process (:func:`~federation.runtime.inprocess.run_in_process`,
no Ray: the same program, a fraction of the start-up), writes each run to ``DIR/seed<S>/<scenario>/<algorithm>``
(a finished run is kept and read back; ``--set key=value`` changes every cell's config, e.g. its
``train.optimizer``), and ``DIR/seeds.md`` and ``DIR/seeds.json``: per cell the final
round's validation accuracy and the test split's (``eval.json``), as mean and standard deviation
over the seeds, the last round's training loss (the clients' mean; a SAM step logs it at the perturbed
point), and the local optimiser the run recorded. The classification task validates accuracy only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from geofm.config.base import set_dotted


def _last_round(run_dir: Path) -> dict[str, Any]:
    lines = (run_dir / "rounds.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def _figures(run_dir: Path) -> dict[str, Any]:
    last = _last_round(run_dir)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    test = evaluation.get("metrics", evaluation)
    return {
        "val_accuracy": last["val"].get("accuracy"),
        "test_accuracy": test.get("accuracy"),
        "train_loss": last.get("loss"),
        "local_optimizer": last.get("local_optimizer"),
        "control_norm": last.get("control_norm"),
    }


def _spread(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None, help="default: the sweep's output_dir + '_seeds'")
    parser.add_argument("--algorithms", nargs="+", default=None, help="only these algorithm labels of the sweep")
    parser.add_argument(
        "--set", dest="cell_overrides", action="append", default=[], help="key=value set in every cell's config"
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the sweep file")
    args = parser.parse_args(argv)

    from federation.runtime.inprocess import run_in_process
    from federation.sweep import read_sweep
    from geofm.config.base import parse_overrides
    from geofm.config.federated import read_federated_config

    sweep, cells = read_sweep(args.sweep, args.overrides)
    cells = [cell for cell in cells if args.algorithms is None or cell.algorithm in args.algorithms]
    out = args.out or Path(f"{sweep.output_dir}_seeds")
    results: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        for cell in cells:
            run_dir = out / f"seed{seed}" / cell.scenario / cell.algorithm
            key = f"{cell.scenario}/{cell.algorithm}"
            if not (run_dir / "eval.json").exists():
                tree = json.loads(json.dumps(cell.tree))
                set_dotted(tree, "run.output_dir", str(run_dir))
                set_dotted(tree, "run.seed", seed)
                for dotted, value in parse_overrides(args.cell_overrides):
                    set_dotted(tree, dotted, value)
                started = time.perf_counter()
                run_in_process(read_federated_config(tree, f"{args.sweep} cell {cell.name} seed {seed}"))
                print(f"{key} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
            results.setdefault(key, {})[str(seed)] = _figures(run_dir)
    (out / "seeds.json").write_text(json.dumps(results, indent=1))
    rows = [
        "| scenario | algorithm | local optimiser | val accuracy | test accuracy | last round's training loss |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, runs in results.items():
        scenario, algorithm = key.split("/")
        opt = next(iter(runs.values()))["local_optimizer"] or {}
        name = opt.get("name", "?") + (f" {opt['base_lr']:g}" if "base_lr" in opt else "")
        cols = []
        for metric in ("val_accuracy", "test_accuracy", "train_loss"):
            mean, std = _spread([r[metric] for r in runs.values()])
            cols.append(f"{mean:.3f} ± {std:.3f}")
        rows.append(f"| {scenario} | {algorithm} | {name} | {' | '.join(cols)} |")
    table = "\n".join(rows)
    settings = " ".join([*args.overrides, *(f"--set {o}" for o in args.cell_overrides)])
    (out / "seeds.md").write_text(f"seeds {args.seeds}, {args.sweep} {settings}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
