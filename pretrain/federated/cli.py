"""``geofm fed``: federated runs on Flower, registered with the geofm command line through an entry point.

``geofm fed simulate``  runs a federated program on this machine (Flower's simulation engine);
``geofm fed certs``     writes a deployment's certificates, SuperNode keys and CLI connection, then
                        prints its commands;
``geofm fed commands``  prints those commands again for a folder ``geofm fed certs`` wrote.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from geofm.errors import ConfigError
from pretrain.federated.deploy import (
    DEFAULT_CONNECTION,
    DEFAULT_PORT,
    DeploymentFiles,
    deployment_commands,
    write_deployment_files,
)
from pretrain.federated.runtime import CLIENT_FACTORY, CONFIG_FILE, INSTITUTIONS, OVERRIDES, SERVER_FACTORY, Scalar


def register(subparsers: argparse._SubParsersAction) -> None:
    fed = subparsers.add_parser(
        "fed", help="federated pretraining on Flower: simulation, deployment certificates and commands"
    )
    commands = fed.add_subparsers(dest="fed_command", required=True, metavar="COMMAND")

    simulate = commands.add_parser(
        "simulate",
        help="run a federated program on this machine, one simulated SuperNode per institution",
        description="Run the ServerApp and one simulated SuperNode per institution with Flower's simulation engine. "
        "Exits non-zero when the server program fails.",
    )
    _add_program_args(simulate, required=True)
    simulate.add_argument("--institutions", type=_names, required=True, metavar="A,B,...", help="one simulated node each")
    simulate.add_argument("--cpus-per-node", type=float, default=1.0, help="cores per running ClientApp (default 1)")
    simulate.add_argument("--gpus-per-node", type=float, default=0.0, help="GPU share per running ClientApp (default 0)")
    simulate.add_argument("--num-cpus", type=int, help="cores the simulation may use (default: all)")
    simulate.set_defaults(handler=_simulate)

    certs = commands.add_parser(
        "certs",
        help="write a deployment's CA, SuperLink certificate, SuperNode keys and CLI connection; print its commands",
        description="Write into OUT: ca.crt/ca.key, superlink.crt/superlink.key (SAN: HOST, localhost, 127.0.0.1), "
        "supernodes/NAME.key/.pub (EC P-384, OpenSSH) per institution and flwr-home/config.toml; then print every "
        "command of the deployment.",
    )
    certs.add_argument("--out", type=Path, required=True, help="output folder")
    certs.add_argument("--institutions", type=_names, required=True, metavar="A,B,...", help="one SuperNode key pair each")
    certs.add_argument("--host", required=True, help="host name or IP address of the SuperLink, as the SuperNodes reach it")
    certs.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"SuperLink HTTPS port (default {DEFAULT_PORT})")
    certs.add_argument("--connection", default=DEFAULT_CONNECTION, help="name of the flwr CLI connection")
    certs.add_argument("--valid-days", type=int, default=365, help="certificate validity (default 365)")
    _add_command_args(certs)
    certs.set_defaults(handler=_certs)

    show = commands.add_parser("commands", help="print the deployment commands for a folder written by `geofm fed certs`")
    show.add_argument("--out", type=Path, required=True, help="folder written by geofm fed certs")
    _add_command_args(show)
    show.set_defaults(handler=_commands)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_program_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--server-factory", required=required, metavar="MODULE:FUNCTION", help="builds the ServerProgram")
    parser.add_argument("--client-factory", required=required, metavar="MODULE:FUNCTION", help="builds a ClientProgram")
    parser.add_argument("--config", help="YAML config of the program")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="override config values")


def _add_command_args(parser: argparse.ArgumentParser) -> None:
    _add_program_args(parser, required=False)
    parser.add_argument(
        "--data-root", action="append", default=[], metavar="NAME=PATH", help="an institution's data folder (repeatable)"
    )


def _run_config(args: argparse.Namespace) -> dict[str, Scalar]:
    config: dict[str, Scalar] = {SERVER_FACTORY: args.server_factory, CLIENT_FACTORY: args.client_factory}
    if args.config:
        config[CONFIG_FILE] = str(Path(args.config).resolve())
    if args.overrides:
        config[OVERRIDES] = shlex.join(args.overrides)
    return {key: value for key, value in config.items() if value}


def _data_roots(items: list[str]) -> dict[str, str]:
    roots = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--data-root {item!r}: expected NAME=PATH")
        roots[name] = path
    return roots


def _simulate(args: argparse.Namespace) -> None:
    from pretrain.federated.flower import simulate  # imports flwr: only this command needs it

    run_config = {**_run_config(args), INSTITUTIONS: ",".join(args.institutions)}
    simulate(run_config, cpus_per_node=args.cpus_per_node, gpus_per_node=args.gpus_per_node, num_cpus=args.num_cpus)


def _print_commands(out: Path, args: argparse.Namespace) -> None:
    files = DeploymentFiles(out.resolve())
    print(deployment_commands(files, data_roots=_data_roots(args.data_root), run_config=_run_config(args) or None), end="")


def _certs(args: argparse.Namespace) -> None:
    files = write_deployment_files(
        args.out, args.institutions, args.host, port=args.port, connection=args.connection, valid_days=args.valid_days
    )
    print(f"# wrote {files.root}: ca.crt, superlink.crt/.key, supernodes/*.key/.pub, flwr-home/config.toml\n")
    _print_commands(files.root, args)


def _commands(args: argparse.Namespace) -> None:
    _print_commands(args.out, args)
