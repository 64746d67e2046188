"""``geofm pretrain``: registered with the geofm command line through an entry point."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pretrain",
        help="continual pretraining (SimMIM, GFM with a teacher) on the DeepSpeed engine",
        description="Pretrain a backbone as configured. Rerunning the same command resumes from the last checkpoint.",
    )
    parser.add_argument("--config", required=True, help="YAML file, e.g. configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="override config values")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> None:
    from geofm.config import PretrainConfig
    from pretrain.central import pretrain

    cfg = PretrainConfig.from_file(args.config, args.overrides)
    run_dir = pretrain(cfg)
    print(f"run directory: {run_dir}")
