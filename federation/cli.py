"""``geofm fed``: federated training on Flower, registered with the geofm command line through an entry point.

``geofm fed simulate``  runs a federated config on this machine (Flower's simulation
                        engine, one simulated SuperNode per institution);
``geofm fed certs``     writes a deployment's certificates, SuperNode keys and CLI connection, then
                        prints its commands;
``geofm fed commands``  prints those commands again for a folder ``geofm fed certs`` wrote;
``geofm fed register``  registers the institutions' SuperNode keys with the SuperLink;
``geofm fed supernode`` runs an institution's SuperNode, starting it again while it is refused;
``geofm fed launch``    starts a run on a deployment's SuperLink and follows it to its final status;
``geofm fed sweep``     runs one simulation per algorithm x scenario (x uplink) of a sweep file and
                        compares them (:mod:`federation.sweep`).

The built-in program (``geofm``: the config's task, algorithm and partition) is the default;
``--program`` runs another program registered for the same runtime (:mod:`federation.runtime.contract`).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from federation.deploy.commands import (
    ACTIVATION_RETRY_S,
    NODE_POLL_S,
    ONLINE_PATIENCE_S,
    deployment_commands,
    launch_run,
    register_nodes,
    run_supernode,
)
from federation.deploy.files import DEFAULT_CONNECTION, DEFAULT_PORT, DeploymentFiles, write_deployment_files
from federation.runtime.contract import CONFIG, INSTITUTIONS, PROGRAM, PROGRAMS, Scalar, config_entry
from geofm.config.base import read_config_tree
from geofm.errors import ConfigError, RunInterrupted
from geofm.fl.algorithms import ALGORITHMS
from geofm.paths import check_writable

BUILT_IN = "geofm"
"""The registered program that runs a config's task, algorithm and partition."""

EXAMPLES = {
    "simulate": [
        "geofm fed simulate --config configs/federated/demo_fedsense_swin_micro__3inst__1bit_ef.yaml",
        "geofm fed simulate --config configs/federated/fedavg_swin_tiny__10clients__100rounds.yaml federation.rounds=5",
        "geofm fed simulate --config configs/feddiff/demo_feddiff_classification__swin_micro__3clients.yaml "
        "--program feddiff",
        "geofm fed simulate --config configs/oscar/demo_oscar_classification__swin_micro__3clients.yaml --program oscar",
    ],
    "certs": [
        "geofm fed certs --deployment ~/geofm-deployment --institutions naip,sentinel2,aerial_fr "
        "--host superlink.example.org --data-root naip=/archive/naip",
    ],
    "commands": ["geofm fed commands --deployment ~/geofm-deployment --data-root naip=/archive/naip"],
    "register": ["geofm fed register --deployment ~/geofm-deployment"],
    "supernode": [
        "geofm fed supernode -- --superlink superlink.example.org:9093 --root-certificates naip/ca.crt "
        '--auth-supernode-private-key naip/supernode.key --node-config \'institution="naip" '
        'data-root="/archive/naip"\' --port 9094',
    ],
    "launch": [
        "geofm fed launch --deployment ~/geofm-deployment "
        "--config configs/federated/fedsense_swin_tiny__10clients__100rounds.yaml",
    ],
    "sweep": ["geofm fed sweep --config sweep.yaml --num-cpus 8"],
}
"""Each subcommand's examples, shown by its ``--help`` (``geofm fed --help`` shows the first of each)."""
RESUMES = "Rerunning the same config resumes from the server's last checkpoint."
SWEEP_FILE = """\
a sweep file (docs/federated.md: "Comparing algorithms and scenarios"):
  config: base.yaml               # a federated config, relative to the sweep file
  output_dir: runs/sweep          # OUTPUT
  algorithms:                     # label: its algorithm settings (name defaults to the label)
    fedavg: {}
    fedprox: {options: {proximal_beta: 0.01}}
  scenarios:                      # label: its federation settings, over the base's
    sources: {partition: by_source}
  uplinks:                        # optional; label: its algorithm.uplink settings
    1bit_ef: {bits: 1, error_feedback: true}
"""


def _examples(lines: list[str], *notes: str) -> str:
    """An epilog: the example command lines, then notes as paragraphs."""
    return "\n\n".join(["examples:\n" + "".join(f"  {line}\n" for line in lines), *notes])


def register(subparsers: argparse._SubParsersAction) -> None:
    fed = subparsers.add_parser(
        "fed",
        help="federated pretraining and finetuning on Flower: simulation, deployment and launch",
        description=f"Federated continual pretraining and finetuning with a registered algorithm "
        f"({', '.join(ALGORITHMS)}; `geofm list algorithms` describes them) on Flower, simulated on this machine "
        "or deployed with one SuperNode per institution. `geofm fed COMMAND --help` shows a command's examples.",
        epilog=_examples([lines[0] for lines in EXAMPLES.values()]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = fed.add_subparsers(dest="fed_command", required=True, metavar="COMMAND")

    simulate = commands.add_parser(
        "simulate",
        help="run a federated config on this machine, one simulated SuperNode per institution",
        description="Run the ServerApp and one simulated SuperNode per institution with Flower's simulation engine. "
        "Exits non-zero when the server fails.",
        epilog=_examples(EXAMPLES["simulate"], RESUMES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_program_args(simulate)
    simulate.add_argument(
        "--institutions",
        type=_names,
        metavar="A,B,...",
        help="another program's institutions (default: the config's clients, where the program names them)",
    )
    simulate.add_argument("--cpus-per-node", type=float, default=1.0, help="cores per running ClientApp (default 1)")
    simulate.add_argument(
        "--gpus-per-node", type=float, default=0.0, help="GPU share per running ClientApp (default 0)"
    )
    simulate.add_argument("--num-cpus", type=int, help="cores the simulation may use (default: all)")
    simulate.set_defaults(handler=_simulate)

    certs = commands.add_parser(
        "certs",
        help="write a deployment's CA, SuperLink certificate, SuperNode keys and CLI connection; print its commands",
        description="Write into the deployment folder (outside any git work tree, or ignored by git): ca.crt, "
        "offline/ca.key, superlink.crt/superlink.key (SAN: HOST, localhost, 127.0.0.1), per institution "
        "supernodes/NAME.pub and institutions/NAME/ (ca.crt and its SuperNode's private key, EC P-384, OpenSSH: "
        "the folder to hand to NAME) and flwr-home/config.toml; then print every command of the deployment.",
        epilog=_examples(EXAMPLES["certs"]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_deployment(certs, "the deployment folder to write")
    certs.add_argument(
        "--institutions", type=_names, required=True, metavar="A,B,...", help="one SuperNode key pair each"
    )
    certs.add_argument(
        "--host", required=True, help="host name or IP address of the SuperLink, as the SuperNodes reach it"
    )
    certs.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"SuperLink HTTPS port (default {DEFAULT_PORT})")
    certs.add_argument("--connection", default=DEFAULT_CONNECTION, help="name of the flwr CLI connection")
    certs.add_argument("--valid-days", type=int, default=365, help="certificate validity (default 365)")
    _add_data_roots(certs)
    certs.set_defaults(handler=_certs)

    show = commands.add_parser(
        "commands",
        help="print the deployment commands for a folder written by `geofm fed certs`",
        description="Print again, in order and commented, every command of the deployment that `geofm fed certs` "
        "wrote into the folder: the SuperLink's, registering the SuperNode keys, each institution's SuperNode "
        "(with its --data-root, or a placeholder) and launching a run.",
        epilog=_examples(EXAMPLES["commands"]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_deployment(show)
    _add_data_roots(show)
    show.set_defaults(handler=_commands)

    node = commands.add_parser(
        "supernode",
        help="run flower-supernode, starting it again while the SuperLink refuses its activation",
        description="Run `flower-supernode ARGS`; while the SuperLink refuses to activate it (a node restarted "
        "within a minute of a crash still counts as online there), start it again, for at most "
        "--retry-activation-s seconds. A key the SuperLink does not know is refused the same way: refused for longer "
        f"than a previous process counts as online ({ONLINE_PATIENCE_S:g} s), it stops and says that "
        "`geofm fed register` must run first. "
        "Exits with flower-supernode's exit code.",
        epilog=_examples(EXAMPLES["supernode"], "`geofm fed commands` prints each institution's line."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    node.add_argument(
        "--retry-activation-s", type=float, default=ACTIVATION_RETRY_S, help=f"default {ACTIVATION_RETRY_S:g}"
    )
    node.add_argument(
        "--poll-s",
        type=float,
        help="longest wait between the node's asks for work and looks for its ClientApp's reply (default: "
        f"Flower's own 3 s and 0.5 s; {NODE_POLL_S:g} takes seconds off short rounds)",
    )
    node.add_argument("arguments", nargs=argparse.REMAINDER, metavar="-- ARGS", help="flower-supernode's arguments")
    node.set_defaults(handler=_supernode)

    enrol = commands.add_parser(
        "register",
        help="register the institutions' SuperNode keys with the SuperLink (a key already there is fine)",
        description="Register every institution's supernodes/NAME.pub of a deployment folder with its SuperLink "
        "(`flwr supernode register`). Idempotent: a key the SuperLink already holds counts as registered.",
        epilog=_examples(EXAMPLES["register"]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_deployment(enrol)
    enrol.add_argument("--institutions", type=_names, metavar="A,B,...", help="only these (default: all)")
    enrol.set_defaults(handler=_register)

    launch = commands.add_parser(
        "launch",
        help="start a run on a deployment's SuperLink and follow it until it finishes",
        description="Submit the config to the SuperLink of a deployment folder (`flwr run`), stream the run's log, "
        "and exit 0 only if the run's final status is finished:completed.",
        epilog=_examples(EXAMPLES["launch"], RESUMES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_deployment(launch)
    _add_program_args(launch)
    launch.set_defaults(handler=_launch)

    sweep = commands.add_parser(
        "sweep",
        help="one simulation per algorithm x scenario (x uplink) of a sweep file, then their comparison",
        description="Validate every cell of a sweep file (below), run each unfinished one with `geofm fed simulate` "
        "in a process of its own into OUTPUT/SCENARIO/ALGORITHM[__UPLINK], and write OUTPUT/comparison/comparison.md, "
        ".json and .png. A cell's algorithm settings replace the base's algorithm-specific ones. Rerunning skips "
        "finished cells and resumes the others.",
        epilog=SWEEP_FILE + "\n" + _examples(EXAMPLES["sweep"]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument("--config", required=True, type=Path, help="the sweep file")
    sweep.add_argument("overrides", nargs="*", metavar="key.path=value", help="override sweep-file values")
    sweep.add_argument("--num-cpus", type=int, help="cores each simulation may use (default: all)")
    sweep.add_argument("--cpus-per-node", type=float, default=1.0, help="cores per running ClientApp (default 1)")
    sweep.set_defaults(handler=_sweep)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_program_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="YAML config, e.g. configs/federated/*.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="override config values")
    parser.add_argument(
        "--program",
        default=BUILT_IN,
        metavar="NAME",
        help=f"a registered federated program (default {BUILT_IN}: the config's task, algorithm and partition)",
    )


def _add_deployment(parser: argparse.ArgumentParser, help_text: str = "folder written by geofm fed certs") -> None:
    """``--deployment DIR``, required; ``--out DIR``, its name on ``certs`` and ``commands`` before, still works."""
    folder = parser.add_mutually_exclusive_group(required=True)
    folder.add_argument("--deployment", type=Path, metavar="DIR", help=help_text)
    folder.add_argument("--out", dest="deployment", type=Path, help=argparse.SUPPRESS)


def _add_data_roots(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-root",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an institution's data folder (repeatable)",
    )


def program_run_config(args: argparse.Namespace) -> dict[str, Scalar]:
    """The run config of a command's program: its name and its config (checked now, not on the nodes)."""
    tree = read_config_tree(args.config, args.overrides)
    if args.program == BUILT_IN:
        from geofm.config.federated import read_federated_config

        names = read_federated_config(tree, str(args.config), args.overrides).client_names
    else:
        names = getattr(args, "institutions", None) or []
        if not names and args.program in PROGRAMS and PROGRAMS.get(args.program).client_names is not None:
            names = PROGRAMS.get(args.program).client_names(tree)
    return {PROGRAM: args.program, CONFIG: config_entry(tree), INSTITUTIONS: ",".join(names)}


def _data_roots(items: list[str]) -> dict[str, str]:
    roots = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--data-root {item!r}: expected NAME=PATH")
        roots[name] = path
    return roots


def _simulate(args: argparse.Namespace) -> None:
    run_config = program_run_config(args)
    if not run_config[INSTITUTIONS]:
        raise ConfigError("--institutions names the simulated nodes of another program")
    check = PROGRAMS.get(args.program).check_simulation
    if check is not None:
        check(run_config, str(args.config))  # before the simulation engine starts
    from federation.flower.simulation import simulate  # imports flwr: only once the config is valid

    try:
        simulate(
            run_config,
            cpus_per_node=args.cpus_per_node,
            gpus_per_node=args.gpus_per_node,
            num_cpus=args.num_cpus,
            verbose=getattr(args, "verbose", False),  # geofm --verbose
        )
    except RunInterrupted:
        # The process ends now: its last garbage collection would walk every object of torch, Ray and Flower
        # (6-10 s of a stop's exit on a loaded machine) only to free memory the exit frees anyway.
        gc.freeze()
        raise
    if args.program == BUILT_IN:
        from federation.programs.rounds import run_config_tree
        from geofm.tasks.mim.figures import print_reconstruction_figure

        print_reconstruction_figure(run_config_tree(run_config).run.output_dir)


def _print_commands(out: Path, args: argparse.Namespace) -> None:
    print(deployment_commands(DeploymentFiles(out.resolve()), data_roots=_data_roots(args.data_root)), end="")


def _certs(args: argparse.Namespace) -> None:
    check_writable(args.deployment, "--deployment", folder=True)
    files = write_deployment_files(
        args.deployment,
        args.institutions,
        args.host,
        port=args.port,
        connection=args.connection,
        valid_days=args.valid_days,
    )
    print(
        f"# wrote {files.root}: ca.crt, offline/ca.key (keep offline), superlink.crt/.key, supernodes/*.pub, "
        "institutions/*/ (one folder to hand to each institution), flwr-home/config.toml\n"
    )
    _print_commands(files.root, args)


def _commands(args: argparse.Namespace) -> None:
    _print_commands(args.deployment, args)


def _supernode(args: argparse.Namespace) -> None:
    arguments = args.arguments[1:] if args.arguments[:1] == ["--"] else args.arguments
    code = run_supernode(arguments, args.retry_activation_s, poll_s=args.poll_s)
    if code:
        raise SystemExit(code)


def _register(args: argparse.Namespace) -> None:
    for name, outcome in register_nodes(DeploymentFiles(args.deployment.resolve()), args.institutions).items():
        print(f"{name}: {outcome}")


def _launch(args: argparse.Namespace) -> None:
    run_config = program_run_config(args)
    run_config.pop(INSTITUTIONS)  # deployed SuperNodes name their institution themselves
    launch_run(DeploymentFiles(args.deployment.resolve()), run_config)


def _sweep(args: argparse.Namespace) -> None:
    from federation.sweep import run_sweep

    extra = ["--cpus-per-node", str(args.cpus_per_node)]
    if args.num_cpus:
        extra += ["--num-cpus", str(args.num_cpus)]
    print(f"wrote {run_sweep(args.config, args.overrides, extra)}")
