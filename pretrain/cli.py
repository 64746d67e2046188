"""``geofm pretrain``: registered with the geofm command line through an entry point."""

from __future__ import annotations

import argparse
import os

EXAMPLES = """\
examples:
  geofm pretrain --config configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml
  geofm pretrain --config my.yaml train.epochs=10 data.num_workers=16 data.sources.0.root=/archive/naip
  geofm pretrain --config my.yaml train.epochs=150 --extend     # train a finished 100-epoch run 50 more epochs
  torchrun --nproc_per_node 8 -m geofm.cli pretrain --config my.yaml

Rerunning the same command resumes from the run's checkpoints/last with the same data order and
learning-rate schedule. Relative paths in the config are resolved against the working directory.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    from geofm.tasks import pretraining_objectives  # imports no torch

    objectives = pretraining_objectives()
    width = max(map(len, objectives), default=0)
    parser = subparsers.add_parser(
        "pretrain",
        help=f"continual pretraining with a registered objective ({', '.join(objectives)}) on the DeepSpeed engine",
        description="Pretrain a backbone with the objective its config names (task, default mim; its own settings "
        "in task_options; geofm list tasks):\n"
        + "".join(f"  {name:<{width}}  {summary}\n" for name, summary in objectives.items())
        + "Every input path is checked before anything is built; the run directory is created once training starts.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", required=True, help="YAML file, e.g. configs/pretrain/gfm_swin_base__img192_win6__100ep.yaml"
    )
    parser.add_argument(
        "--extend",
        action="store_true",
        help="train a finished run for longer: raise train.epochs and pass --extend; the schedule is re-planned over "
        "the new length (no second warm-up), so the learning rate resumes where the longer cosine is at this step",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.path=value",
        help="override config values (YAML values; list entries by index)",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> None:
    from geofm.config import PretrainConfig
    from geofm.paths import check_writable

    cfg = PretrainConfig.from_file(args.config, args.overrides)
    check_writable(cfg.run.output_dir, "run.output_dir", folder=True)
    from geofm.tasks.mim.figures import print_reconstruction_figure
    from pretrain.central import pretrain  # loads torch: only once the config is valid

    run_dir = pretrain(cfg, extend=args.extend, source=str(args.config))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"run directory: {run_dir}")
        print_reconstruction_figure(run_dir)
