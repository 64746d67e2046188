"""The ``geofm`` command line.

Library commands live here; programs outside the library (``geofm pretrain``) register their
own subcommands through the ``geofm.commands`` entry-point group, so the library never imports
them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from geofm.errors import GeoFMError


def _demo_data(args: argparse.Namespace) -> None:
    from geofm.data.demo import make_demo_archive

    for name, path in make_demo_archive(args.out, seed=args.seed).items():
        print(f"{name}: {path}")


def _data_stats(args: argparse.Namespace) -> None:
    from geofm.data.stats import compute_band_stats, format_stats_yaml

    stats = compute_band_stats(
        root=args.root,
        pattern=args.pattern,
        bands=args.bands,
        scale=args.scale,
        nodata=args.nodata,
        max_files=args.max_files,
    )
    print(f"# {stats.files} files, valid pixels per band: {dict(zip(stats.bands, stats.pixels))}")
    print(format_stats_yaml(stats))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geofm", description="Geospatial foundation models: pretrain, finetune, publish.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    # The deepspeed launcher passes --local_rank; the engine reads LOCAL_RANK from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo-data", help="write the built-in synthetic multi-sensor archive (smoke-test data, not real imagery)"
    )
    demo.add_argument("--out", type=Path, default=Path("data/demo"))
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(handler=_demo_data)

    data = commands.add_parser("data", help="inspect imagery sources").add_subparsers(dest="data_command", required=True)
    stats = data.add_parser("stats", help="per-band mean/std of a source, as YAML to paste into its config")
    stats.add_argument("root", type=Path, help="folder of images")
    stats.add_argument("--bands", nargs="+", required=True, help="band names in the files' band order")
    stats.add_argument("--pattern", default="**/*.tif", help="glob below root (default: **/*.tif)")
    stats.add_argument("--scale", type=float, default=1.0, help="multiplies raw values, e.g. 0.0001 for reflectance")
    stats.add_argument("--nodata", type=float, default=None, help="overrides the files' nodata value")
    stats.add_argument("--max-files", type=int, default=None, help="use an evenly spaced subset")
    stats.set_defaults(handler=_data_stats)

    for plugin in entry_points(group="geofm.commands"):
        plugin.load()(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if args.verbose else logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        args.handler(args)
    except GeoFMError as exc:
        print(f"geofm: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
