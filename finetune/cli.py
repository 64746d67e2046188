"""``geofm finetune``, ``geofm eval``, ``geofm report``, ``geofm predict`` and ``geofm export onnx``: registered
with the geofm command line through an entry point."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from finetune.files import ONNX_FILE
from geofm.paths import check_writable

FINETUNE_EXAMPLES = """\
examples:
  geofm finetune --config configs/finetune/ucmerced__swin_base__img256_win8__100ep.yaml checkpoint=exports/gfm
  geofm finetune --config my.yaml checkpoint=runs/my_pretraining model.frozen=true     # linear probe
  geofm finetune --config my.yaml checkpoint=null run.output_dir=runs/random_init      # random-init baseline
  torchrun --nproc_per_node 8 -m geofm.cli finetune --config my.yaml

checkpoint is anything geofm checkpoint reads: an export, a pretraining run directory, a released
GFM/SimMIM file, ImageNet Swin/ViT weights. Bands are matched by name; task bands the checkpoint
lacks start fresh and are reported in the log and in eval.json. Rerunning the same command resumes.
"""

EVAL_EXAMPLES = """\
examples:
  geofm eval checkpoint=runs/ucmerced__swin_base__img256_win8__100ep              # the run's own config, test split
  geofm eval --config my.yaml checkpoint=runs/my_run split=val data.root=/data/ucm_copy
"""

REPORT_EXAMPLES = """\
examples:
  geofm report runs/gfm_*/eval.json --baseline runs/in22k_*/eval.json --out reports/gfm_vs_in22k
  geofm report runs/sweep_bigearthnet_k7 --out reports/bigearthnet_k7     # federated runs side by side
"""


PREDICT_EXAMPLES = """\
examples:
  geofm predict --model runs/demo_segmentation__swin_micro --input scene.tif --output classes.tif
  geofm export onnx --model runs/demo_segmentation__swin_micro          # writes RUN/model.onnx
  geofm predict --model runs/demo_segmentation__swin_micro --engine onnx --input scene.tif --output classes.tif
  geofm predict --onnx model.onnx --input scene.tif --output classes.tif  # the file alone, without its run
"""

EXPORT_EXAMPLES = """\
examples:
  geofm export onnx --model runs/demo_segmentation__swin_micro                   # RUN/model.onnx, 64 px tiles
  geofm export onnx --model runs/demo_segmentation__swin_micro --tile 256 --output seg256.onnx

The file holds the model (backbone and head) with a dynamic batch dimension for tiles of one size,
and in its metadata_props (JSON strings) the task, bands, normalisation, classes, tile and the run's
kept weights it was made from (docs/export-onnx.md lists the keys).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``geofm finetune``, ``geofm eval``, ``geofm report``, ``geofm predict`` and ``geofm export`` to the
    geofm command line."""
    finetune = subparsers.add_parser(
        "finetune",
        help="finetune (or linearly probe) a backbone on a downstream task on the DeepSpeed engine",
        description="Train the task's head (and the backbone unless model.frozen) as configured, keep the weights with "
        "the best validation metric and write their test metrics to eval.json in the run directory.",
        epilog=FINETUNE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    finetune.add_argument(
        "--config", required=True, help="YAML file, e.g. configs/finetune/ucmerced__swin_base__img256_win8__100ep.yaml"
    )
    finetune.add_argument(
        "overrides",
        nargs="*",
        metavar="key.path=value",
        help="override config values (YAML values), e.g. checkpoint=PATH",
    )
    finetune.set_defaults(handler=_finetune)

    evaluate = subparsers.add_parser(
        "eval",
        help="evaluate a finetuned run's kept weights on a split and print the metrics JSON",
        description="Evaluate the weights a geofm finetune run kept (best/) on a split of its data; write the record "
        "to RUN/eval_<split>.json (or --out) and print it.",
        epilog=EVAL_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("--config", help="config giving the model and data (default: the run's own config.yaml)")
    evaluate.add_argument("--out", type=Path, help="where to write the record (default: RUN/eval_<split>.json)")
    evaluate.add_argument(
        "overrides",
        nargs="+",
        metavar="key=value",
        help="checkpoint=RUN (required), split=train|val|test (default test), and config overrides",
    )
    evaluate.set_defaults(handler=_eval)

    report = subparsers.add_parser(
        "report",
        help="ARP of a model against a baseline over tasks, or federated runs side by side",
        description="Compare evaluation records (eval.json) of a model and a baseline task by task (matched by task, "
        "dataset and train fraction) and write report.md, arp.json and arp.png. Given run directories (or a sweep's "
        "output folder) instead, compare the federated runs in them: each algorithm's score per scenario and "
        "uplink, and each run's bytes per round, server seconds per round, client seconds per local step "
        "(relative to FedAvg) and client memory, in comparison.md, comparison.json and comparison.png.",
        epilog=REPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument(
        "evals", nargs="+", type=Path, metavar="EVAL.json|RUN", help="the model's evaluation records, or run folders"
    )
    report.add_argument("--baseline", nargs="+", type=Path, metavar="EVAL.json", help="the baseline's (ARP only)")
    report.add_argument(
        "--out", type=Path, default=Path("arp_report"), help="folder to write into (default: arp_report)"
    )
    report.add_argument("--name", default="model", help="the model's name in the report")
    report.add_argument("--baseline-name", default="baseline", help="the baseline's name in the report")
    report.set_defaults(handler=_report)

    predict = subparsers.add_parser(
        "predict",
        help="sliding-window inference of a finetuned model over GeoTIFF scenes of any size",
        description="Predict a whole scene with a finetuned run in overlapping, blended tiles and write a GeoTIFF "
        "with the scene's CRS, transform and nodata, holding what the run's task predicts (geofm list tasks): "
        "class ids, a change mask of two dates (--before and --after) or a finer image (pixel size / scale factor). "
        "The model runs on PyTorch (--engine torch) or, exported with geofm export onnx, on ONNX Runtime "
        "(--engine onnx); tiling, blending and writing are the same.",
        epilog=PREDICT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    predict.add_argument(
        "--model",
        type=Path,
        metavar="RUN",
        help="run directory of geofm finetune (required unless --onnx FILE; with it, the file must match the run)",
    )
    predict.add_argument(
        "--engine",
        choices=("torch", "onnx"),
        help="torch: the run's weights on PyTorch (default); onnx: its export on ONNX Runtime (RUN/model.onnx "
        "written by geofm export onnx, or --onnx FILE; CUDA provider when onnxruntime has one, else the CPU)",
    )
    predict.add_argument(
        "--onnx",
        type=Path,
        metavar="FILE.onnx",
        help="an export of geofm export onnx to run (implies --engine onnx; default RUN/model.onnx)",
    )
    predict.add_argument("--input", type=Path, metavar="SCENE.tif", help="the scene (a task of one image)")
    predict.add_argument("--before", type=Path, metavar="A.tif", help="a task of two dates: the earlier scene")
    predict.add_argument(
        "--after", type=Path, metavar="B.tif", help="a task of two dates: the later scene, on the same grid"
    )
    predict.add_argument("--output", required=True, type=Path, metavar="OUT.tif", help="GeoTIFF to write")
    predict.add_argument(
        "--tile",
        type=int,
        help="side of the tiles the model sees, in pixels (default: the model's training size, model.img_size; "
        "other sizes: multiples of its coarsest feature stride, 32 for Swin)",
    )
    predict.add_argument(
        "--overlap", type=int, help="pixels shared by neighbouring tiles (default: a quarter of the tile)"
    )
    predict.add_argument("--batch-size", type=int, default=8, help="tiles per model call (default 8)")
    predict.add_argument(
        "--overwrite",
        action="store_true",
        help="predict from the start even when OUT.tif already holds this prediction or an interrupted one "
        "left OUT.tif.partial (default: keep the first, continue the second), and replace an OUT.tif that geofm "
        "did not write (default: refused); an input is never replaced",
    )
    predict.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    predict.set_defaults(
        handler=_predict,
        on_stop="rerun the same command to continue after the blocks already written to {output}.partial",
    )

    export = subparsers.add_parser(
        "export",
        help="a finetuned run in a portable format: onnx",
        description="Write a finetuned run in a format other runtimes read.",
    )
    formats = export.add_subparsers(dest="format", required=True, metavar="FORMAT")
    onnx = formats.add_parser(
        "onnx",
        help="the run's kept weights, backbone and head, as an ONNX model with its metadata",
        description="Export a geofm finetune run's kept weights (best/) with torch.onnx.export(dynamo=True): a "
        "dynamic batch of tiles of one size, and the task, bands, normalisation, classes and tile as JSON "
        "metadata_props, so that ONNX Runtime or any ONNX consumer runs it without geofm. The export is "
        "compared with PyTorch on random tiles of batch 1 and 3 and the largest difference printed.",
        epilog=EXPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    onnx.add_argument("--model", required=True, type=Path, metavar="RUN", help="run directory of geofm finetune")
    onnx.add_argument(
        "--output",
        type=Path,
        metavar="OUT.onnx",
        help="ONNX file to write (default RUN/model.onnx, which geofm predict --model RUN --engine onnx reads)",
    )
    onnx.add_argument(
        "--tile",
        type=int,
        help="side of the tiles the model takes (default: its training size, model.img_size; other sizes as "
        "geofm predict --tile)",
    )
    onnx.add_argument("--opset", type=int, help="ONNX opset version (default: the exporter's)")
    onnx.set_defaults(handler=_export_onnx)


def _finetune(args: argparse.Namespace) -> None:
    from geofm.config.finetune import FinetuneConfig

    cfg = FinetuneConfig.from_file(args.config, args.overrides)
    check_writable(cfg.run.output_dir, "run.output_dir", folder=True)
    from finetune.run import finetune  # loads torch: only once the config and its output are

    run_dir = finetune(cfg, source=str(args.config))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"run directory: {run_dir}")


def _eval(args: argparse.Namespace) -> None:
    from geofm.config import read_config_tree
    from geofm.config.base import CONFIG_FILE
    from geofm.config.fedfinetune import check_finetuning_run, read_finetune_config
    from geofm.config.saved import read_saved_config
    from geofm.errors import ConfigError

    settings = {"checkpoint": None, "split": "test"}
    overrides = []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if sep and key in settings:
            settings[key] = value
        else:
            overrides.append(item)
    if not settings["checkpoint"]:
        raise ConfigError("geofm eval needs checkpoint=RUN, the run directory of geofm finetune")
    if settings["split"] not in ("train", "val", "test"):
        raise ConfigError(f"split={settings['split']!r}: expected train, val or test")
    run_dir = Path(settings["checkpoint"])
    check_finetuning_run(run_dir)
    source = Path(args.config) if args.config else run_dir / CONFIG_FILE
    tree = read_config_tree(source, overrides) if args.config else read_saved_config(source, overrides)
    cfg = read_finetune_config(tree, str(source), overrides)
    out = args.out or run_dir / f"eval_{settings['split']}.json"
    check_writable(out, "--out" if args.out else "the record (--out)", folder=False)
    from finetune.evaluate import evaluate_run, write_json  # the training stack, once the config is valid

    record = evaluate_run(run_dir, settings["split"], cfg)
    write_json(record, out)
    print(json.dumps(record, indent=2, default=str))


def _report(args: argparse.Namespace) -> None:
    check_writable(args.out, "--out", folder=True)
    from finetune.report import average_relative_performance, compare, read_eval, write_report
    from geofm.errors import ConfigError

    if all(path.is_dir() for path in args.evals):
        if args.baseline:
            raise ConfigError("--baseline compares eval.json records; run folders are compared with each other")
        from geofm.fl.comparison import write_comparison

        print(f"wrote {write_comparison(args.evals, args.out)}")
        return
    if args.baseline is None:
        raise ConfigError("geofm report EVAL.json ...: give the baseline's records with --baseline EVAL.json ...")

    rows, unmatched = compare([read_eval(p) for p in args.evals], [read_eval(p) for p in args.baseline])
    paths = write_report(rows, args.out, model=args.name, baseline=args.baseline_name, unmatched=unmatched)
    for note in unmatched:
        print(f"not compared, {note}")
    print(
        f"ARP of {args.name} against {args.baseline_name} over {len(rows)} tasks: {average_relative_performance(rows):+.2f}%"
    )
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


def _predict(args: argparse.Namespace) -> None:
    from geofm.errors import ConfigError

    engine = args.engine or ("onnx" if args.onnx is not None else "torch")
    if engine == "torch" and args.onnx is not None:
        raise ConfigError("--onnx FILE is run by ONNX Runtime: leave out --engine torch (or give --engine onnx)")
    if args.model is None and args.onnx is None:
        raise ConfigError("give the finetuned run with --model RUN (or an exported model with --onnx FILE.onnx)")
    check_writable(args.output, "--output", folder=False)
    from finetune.predict import predict_scene  # loads torch: only once the output can be written
    from geofm.tasks import finetune_task

    name = args.model if args.model is not None else args.onnx
    if engine == "onnx":
        from finetune.onnx_model import load_onnx_predictor

        predictor = load_onnx_predictor(args.model, args.onnx, args.tile)
        info = predictor.info
        model_id = {
            "engine": "onnx",
            "onnx": str(Path(info["onnx"]).resolve()),
            "run": str(Path(args.model).resolve()) if args.model is not None else info["run"],
            "selected": info["selected"],
            "weights_sha256": info["weights_sha256"],
        }
    else:
        from finetune.predictor import load_predictor

        predictor = load_predictor(args.model, args.tile)
        model_id = {"run": str(Path(args.model).resolve()), "selected": predictor.info.get("selected")}
    if len(finetune_task(predictor.task).inputs) == 2:
        if args.before is None or args.after is None or args.input is not None:
            raise ConfigError(f"{name} is a change detection model: give --before A.tif and --after B.tif, not --input")
        inputs = (args.before, args.after)
    else:
        if args.input is None or args.before is not None or args.after is not None:
            raise ConfigError(f"{name} is a {predictor.task} model: give --input SCENE.tif, not --before/--after")
        inputs = args.input
    output = predict_scene(
        predictor.model_fn,
        inputs,
        args.output,
        task=predictor.task,
        normaliser=predictor.normaliser,
        tile=predictor.tile,
        overlap=args.overlap,
        batch_size=args.batch_size,
        scale_factor=predictor.scale_factor,
        target_normaliser=predictor.target_normaliser,
        progress=args.progress,
        model_id=model_id,
        overwrite=args.overwrite,
    )
    print(f"wrote {output}")


def _export_onnx(args: argparse.Namespace) -> None:
    output = args.output if args.output is not None else args.model / ONNX_FILE
    check_writable(output, "--output", folder=False)
    from finetune.onnx_model import export_onnx  # loads torch: only once the output can be written

    exported = export_onnx(args.model, output, tile=args.tile, opset=args.opset)
    meta = exported.metadata
    print(
        f"wrote {exported.path}: {meta['task']} model, inputs {', '.join(meta['inputs'])} of shape "
        f"(batch, {len(meta['bands'])}, {meta['tile']}, {meta['tile']}), output {meta['output']['shape']}"
    )
    if exported.max_abs_diff is not None:
        print(
            f"ONNX Runtime vs PyTorch on random tiles (batch 1 and 3): max abs difference {exported.max_abs_diff:.2e}"
        )
