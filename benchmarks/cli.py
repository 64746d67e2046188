"""``geofm bench NAME [--quick] [--json] [key=value ...]``: the benchmark suite on the command line.

Registered with the geofm command line through the ``geofm.commands`` entry point; also runs as
``python -m benchmarks.cli NAME ...``. Each benchmark module (listed in :data:`BENCHMARKS` with a
one-line summary) defines ``DEFAULTS`` (its settings), ``QUICK`` (what ``--quick`` changes: under
a minute on a CPU) and ``run(settings) -> Report``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from geofm.config.base import parse_overrides
from geofm.errors import ConfigError, GeoFMError
from geofm.paths import check_writable

BENCHMARKS = {
    "pretrain-step": (
        "benchmarks.pretrain_step",
        "images/s of one GFM training step: optimised path vs plain eager fp32, teacher share, memory, MFU",
    ),
    "device-check": (
        "benchmarks.device_check",
        "GPU device check: bf16 GFM step eager/fused/compiled, MFU, memory, chip-store loader, tests marked cuda",
    ),
    "startup": ("benchmarks.startup", "seconds from `geofm pretrain` to the first optimizer step, by phase"),
    "data": ("benchmarks.data", "images/s per loader worker vs the step's consumption; large scenes read by window"),
    "predict": (
        "benchmarks.predict",
        "geofm predict on scenes of two sizes: peak memory (flat in the scene's size) and tiles/s",
    ),
    "onnx": (
        "benchmarks.onnx_export",
        "geofm predict of one scene on PyTorch and on ONNX Runtime (geofm export onnx): agreement, CPU seconds",
    ),
    "codec": (
        "benchmarks.codec",
        "upload encode (error feedback + quantise + pack) and decode vs clone; bytes on the wire",
    ),
    "fed-round": ("benchmarks.fed_round", "server time per round vs clients, client overhead, bytes per round"),
    "fed-stop": ("benchmarks.fed_stop", "seconds from SIGTERM or SIGINT to the exit of `geofm fed simulate`"),
    "fed-deploy": (
        "benchmarks.fed_deploy",
        "seconds per round simulated vs deployed on loopback (with and without the node worker)",
    ),
    "pretrain-benefit": (
        "benchmarks.pretrain_benefit",
        "test mIoU of a real labelled task: SimMIM-pretrained backbone vs random initialisation, over seeds",
    ),
    "fed-benefit": (
        "benchmarks.fed_benefit",
        "test mIoU of a real labelled task after federated, central and single-institution pretraining, over seeds",
    ),
    "fed-finetune": (
        "benchmarks.fed_finetune",
        "test mIoU of a real labelled task finetuned federated by region and under label skew: FedAvg vs the zoo",
    ),
    "one-shot": (
        "benchmarks.one_shot",
        "one-shot federated classification (FedDiff, OSCAR, ensemble distillation, FedAvg 1 round) vs FedAvg, label skew",
    ),
    "flatness": (
        "benchmarks.flatness",
        "federated algorithms on label-skewed and by-sensor clients: global model's metric, flatness, DP epsilon",
    ),
}

OUTPUT_SETTINGS = {"work_dir", "output_dir"}
"""Settings of a benchmark that name a folder it writes (checked before it runs, as ``--out`` is)."""

EPILOG = """\
examples:
  geofm bench pretrain-step                       # Swin-B 192 px GFM step: optimised vs eager fp32
  geofm bench pretrain-step --quick               # a micro Swin, under a minute on a CPU
  geofm bench codec bits=[1,8] numel=28000000     # settings as key=value (YAML values)
  geofm bench fed-round --json > fed.json         # the JSON result on stdout instead of the table
  geofm bench report docs/results/fed-benefit.json  # a result's Markdown tables, as the docs show them

Every run writes its JSON result (machine, library versions, settings, figures, targets) to --out.
Variants are timed side by side in alternating rounds; comparisons are medians of per-round ratios.
"""


def module(name: str) -> ModuleType:
    """The module of benchmark ``name``."""
    return importlib.import_module(BENCHMARKS[name][0])


def settings_of(bench: ModuleType, quick: bool, pairs: list[str]) -> dict[str, Any]:
    """The benchmark's defaults, with ``--quick``'s changes and then the ``key=value`` overrides.

    Raises:
        ConfigError: for an unknown key or a malformed pair.
    """
    settings = dict(bench.DEFAULTS)
    if quick:
        settings.update(bench.QUICK)
    for key, value in parse_overrides(pairs):
        if key not in settings:
            raise ConfigError(f"unknown setting {key!r}; this benchmark has {', '.join(sorted(settings))}")
        settings[key] = value
    return settings


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``geofm bench NAME`` to the geofm command line (the benchmarks are imported only when run)."""
    parser = subparsers.add_parser(
        "bench",
        help=f"benchmarks: {', '.join(BENCHMARKS)}",
        description="Measure one part of geofm, print a table and write a JSON result. Benchmarks never gate "
        "anything: they measure, compare variants side by side and say which targets are met.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, (path, summary) in BENCHMARKS.items():
        bench = names.add_parser(
            name,
            help=summary,
            description=f"{summary}. Settings and their defaults: DEFAULTS and QUICK in {path.replace('.', '/')}.py.",
        )
        bench.add_argument("--quick", action="store_true", help="tiny settings: under a minute on a CPU")
        bench.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
        bench.add_argument("--out", type=Path, default=None, help=f"JSON result file (default runs/bench/{name}.json)")
        bench.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
        bench.add_argument("settings", nargs="*", metavar="key=value", help="benchmark settings (YAML values)")
        bench.set_defaults(handler=_run)
    reporting = names.add_parser(
        "report",
        help="print the Markdown tables (and claims) of a results file",
        description="Print the Markdown tables of a benchmark's JSON result (fed-benefit, one-shot): the docs' "
        "tables are this output verbatim.",
    )
    reporting.add_argument("results", type=Path, help="a JSON result written by geofm bench NAME --out")
    reporting.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> None:
    from benchmarks.report import report_file

    print(report_file(args.results), end="")


def _run(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.common import format_report, machine, result_record

    bench = module(args.name)
    settings = settings_of(bench, args.quick, args.settings)
    out = args.out or Path("runs/bench") / f"{args.name}.json"
    check_writable(out, "--out", folder=False)
    for key in OUTPUT_SETTINGS & settings.keys():
        if settings[key] is not None:
            check_writable(settings[key], key, folder=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    started, before = time.perf_counter(), machine()
    report = bench.run(settings)
    command = " ".join(["geofm bench", args.name, *(["--quick"] if args.quick else []), *args.settings])
    record = result_record(args.name, command, settings, report, started, before)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(format_report(record, report))
        print(f"\nwrote {out}")


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.cli NAME ...``: the same command without the geofm entry point."""
    import logging

    parser = argparse.ArgumentParser(prog="geofm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.handler(args)
    except GeoFMError as exc:
        parser.exit(2, f"geofm: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
