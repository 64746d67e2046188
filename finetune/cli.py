"""``geofm predict``: registered with the geofm command line through an entry point."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``geofm predict`` to the geofm command line."""
    parser = subparsers.add_parser(
        "predict",
        help="sliding-window inference of a finetuned model over GeoTIFF scenes of any size",
        description="Predict a whole scene with a finetuned run in overlapping, blended tiles and write a GeoTIFF "
        "with the scene's CRS, transform and nodata: class ids (segmentation), a change mask (change, from "
        "--before and --after) or a finer image (super-resolution, pixel size / scale factor).",
    )
    parser.add_argument("--model", required=True, type=Path, metavar="RUN", help="run directory of geofm finetune")
    parser.add_argument("--input", type=Path, metavar="SCENE.tif", help="the scene (segmentation, super-resolution)")
    parser.add_argument("--before", type=Path, metavar="A.tif", help="change detection: the earlier scene")
    parser.add_argument("--after", type=Path, metavar="B.tif", help="change detection: the later scene, on the same grid")
    parser.add_argument("--output", required=True, type=Path, metavar="OUT.tif", help="GeoTIFF to write")
    parser.add_argument("--tile", type=int, default=256, help="side of the tiles the model sees, in pixels (default 256)")
    parser.add_argument("--overlap", type=int, default=64, help="pixels shared by neighbouring tiles (default 64)")
    parser.add_argument("--batch-size", type=int, default=8, help="tiles per model call (default 8)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> None:
    # finetune.predictor (load_predictor: run directory -> Predictor) belongs to the finetuning program.
    from finetune.predict import predict_scene
    from finetune.predictor import load_predictor
    from geofm.errors import ConfigError

    predictor = load_predictor(args.model)
    if predictor.task == "change":
        if args.before is None or args.after is None or args.input is not None:
            raise ConfigError(f"{args.model} is a change detection model: give --before A.tif and --after B.tif, not --input")
        inputs = (args.before, args.after)
    else:
        if args.input is None or args.before is not None or args.after is not None:
            raise ConfigError(f"{args.model} is a {predictor.task} model: give --input SCENE.tif, not --before/--after")
        inputs = args.input
    output = predict_scene(
        predictor.model_fn,
        inputs,
        args.output,
        task=predictor.task,
        normaliser=predictor.normaliser,
        tile=args.tile,
        overlap=args.overlap,
        batch_size=args.batch_size,
        scale_factor=predictor.scale_factor,
        progress=args.progress,
    )
    print(f"wrote {output}")
