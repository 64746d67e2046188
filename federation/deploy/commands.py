"""Deployment commands: a SuperLink and one SuperNode per institution, with TLS and SuperNode auth.

:func:`deployment_commands` spells out every command of a deployment whose files
:func:`~federation.deploy.files.write_deployment_files` wrote; the same argument lists start the
processes of :class:`~federation.deploy.local.LocalDeployment`. :func:`run_supernode` keeps a
SuperNode up while the SuperLink refuses it, :func:`launch_run` submits a run and follows it.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import tomli_w

from federation.deploy.files import DEFAULT_CONNECTION, DEFAULT_PORT, DeploymentFiles
from federation.runtime.contract import DATA_ROOT, INSTITUTION, Scalar
from federation.runtime.processes import WATCH_S, end_marked
from geofm.errors import ConfigError, FederatedRunError

APP_DIR = Path(__file__).parents[1] / "flower" / "app"
"""The Flower App submitted by ``flwr run``: its components are this package's ServerApp and ClientApp."""

ACTIVATION_RETRY_S = 120.0
"""How long ``geofm fed supernode`` keeps starting a SuperNode the SuperLink refuses (its heartbeat patience is 60 s)."""
ONLINE_PATIENCE_S = 60.0
"""How long the SuperLink counts a SuperNode online after its last heartbeat (flwr: two 30 s heartbeat intervals)."""
NODE_POLL_S = 0.2
"""A SuperNode's longest wait between asks for work and between looks for its ClientApp's reply with
``geofm fed supernode --poll-s`` as ``geofm bench fed-deploy`` runs it (flower-supernode 1.41 and 1.42: a fixed 3 s and 0.5 s)."""
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
"""Environment for every Flower process: no telemetry, no update check (machines may be offline)."""
COMPLETED = "finished:completed"


def format_config_values(values: Mapping[str, Scalar]) -> str:
    """``key=value`` pairs as Flower's ``--run-config`` and ``--node-config`` parse them (TOML values)."""
    parts = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, int | float):
            text = repr(value)
        elif '"' not in value and "\\" not in value:
            text = json.dumps(value)
        elif "'" not in value:
            text = f"'{value}'"
        else:
            raise ConfigError(f"config value {key}={value!r}: cannot hold both single and double quotes")
        parts.append(f"{key}={text}")
    return " ".join(parts)


def superlink_command(
    files: DeploymentFiles, *, host: str = "0.0.0.0", port: int = DEFAULT_PORT, database: Path | None = None
) -> list[str]:
    """``flower-superlink`` with TLS, SuperNode auth and no runtime dependency installation."""
    command = [
        "flower-superlink",
        "--ssl-ca-certfile",
        str(files.ca_cert),
        "--ssl-certfile",
        str(files.superlink_cert),
        "--ssl-keyfile",
        str(files.superlink_key),
        "--enable-supernode-auth",
        "--disable-runtime-dependency-installation",
        "--host",
        host,
        "--port",
        str(port),
    ]
    return command + (["--database", str(database)] if database else [])


def register_command(public_key: Path, institution: str, connection: str = DEFAULT_CONNECTION) -> list[str]:
    """``flwr supernode register``: allow the SuperNode holding the matching private key to connect."""
    return ["flwr", "supernode", "register", str(public_key), connection, "--name", institution]


def supernode_command(
    ca_cert: Path,
    private_key: Path,
    superlink_address: str,
    port: int,
    node_config: Mapping[str, Scalar],
    *,
    retry_activation_s: float = ACTIVATION_RETRY_S,
    poll_s: float | None = None,
) -> list[str]:
    """``flower-supernode`` for one institution; ``port`` is its own Runtime API (ClientApp) port.

    With ``retry_activation_s``, through ``geofm fed supernode`` (:func:`run_supernode`), which
    starts it again while the SuperLink refuses its activation for that long, and with ``poll_s``
    shortens its waits for work and replies to that.
    """
    flower = [
        "--superlink",
        superlink_address,
        "--root-certificates",
        str(ca_cert),
        "--auth-supernode-private-key",
        str(private_key),
        "--node-config",
        format_config_values(node_config),
        "--port",
        str(port),
    ]
    if not retry_activation_s:
        return ["flower-supernode", *flower]
    poll = [] if poll_s is None else ["--poll-s", f"{poll_s:g}"]
    return ["geofm", "fed", "supernode", "--retry-activation-s", f"{retry_activation_s:g}", *poll, "--", *flower]


ACTIVATION_REFUSED = "Failed to activate SuperNode"
SUPERNODE_MARKER = "GEOFM_SUPERNODE"
"""Environment variable marking the processes of one start of flower-supernode (see :func:`run_supernode`)."""


def run_supernode(
    arguments: Sequence[str], retry_activation_s: float, pause_s: float = 5.0, poll_s: float | None = None
) -> int:
    """Run ``flower-supernode ARGUMENTS``, starting it again while the SuperLink refuses its activation.

    A SuperNode restarted within a minute of a crash is refused: the SuperLink still counts its
    previous process as online until two heartbeats (:data:`ONLINE_PATIENCE_S`) pass without one. A
    key the SuperLink does not know is refused with the same words, so it is told apart by time: a
    start refused more than that after the first refusal was refused for its key.

    With ``poll_s``, flower-supernode runs with its fixed waits for work (3 s) and for its ClientApp's
    reply (0.5 s) shortened to at most that (:func:`federation.flower.adapter.run_supernode_in_process`).

    Returns:
        flower-supernode's exit code (that of its last start).

    Raises:
        FederatedRunError: the SuperLink refused this node's key (never registered, or registered
            with a SuperLink that has since lost its database).
    """
    deadline = time.monotonic() + retry_activation_s
    program = (
        ["flower-supernode"] if poll_s is None else [sys.executable, "-m", "federation.flower.adapter", f"{poll_s:g}"]
    )
    first_refusal = None
    while True:
        # flower-supernode starts a SuperExec that outlives it when it exits on an error, retrying its
        # connection forever with this output open: a marker finds it (and any other leftover) after.
        token = uuid.uuid4().hex
        started = time.monotonic()
        process = subprocess.Popen(
            [*program, *arguments],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, SUPERNODE_MARKER: token},
        )
        refused = threading.Event()
        relay = threading.Thread(target=_relay, args=(process.stdout, refused), daemon=True)
        relay.start()
        forward = signal.signal(signal.SIGTERM, lambda signum, frame, child=process: child.terminate())
        try:
            code = process.wait()
        finally:
            signal.signal(signal.SIGTERM, forward)
        end_marked(SUPERNODE_MARKER, token)  # what this start left: SuperExec, ClientApps, the node's worker
        # A leftover caught mid-exec shows no environment yet: look again until its output closes.
        while relay.is_alive():
            relay.join(WATCH_S)
            end_marked(SUPERNODE_MARKER, token)
        if code == 0 or not refused.is_set():
            return code
        if first_refusal is None:
            first_refusal = time.monotonic()
        elif started - first_refusal > ONLINE_PATIENCE_S:
            raise FederatedRunError(
                f"the SuperLink does not know this SuperNode's key: it still refuses activation "
                f"{started - first_refusal:.0f} s after the first refusal, longer than it counts a previous "
                f"process of this node as online ({ONLINE_PATIENCE_S:g} s). The operator must register the key "
                "first (`geofm fed register --deployment DIR`), then start this node again"
            )
        if time.monotonic() + pause_s > deadline:
            return code
        print(
            "# the SuperLink refused activation: a previous process of this node counts as online there for up to "
            f"{ONLINE_PATIENCE_S:g} s after its end, or the SuperLink does not know this key (then the operator must "
            f"run `geofm fed register` first); starting again in {pause_s:g} s",
            flush=True,
        )
        time.sleep(pause_s)


def _relay(stream, refused: threading.Event) -> None:
    """Copy a SuperNode's output to this process's, noting a refused activation."""
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        if ACTIVATION_REFUSED in line:
            refused.set()


def run_command(
    run_config_file: Path | None, connection: str = DEFAULT_CONNECTION, app_dir: Path = APP_DIR
) -> list[str]:
    """``flwr run`` of the geofm Flower App, its run config from a TOML file; prints the run id as JSON.

    A file (written by :func:`write_run_config`) rather than ``key=value`` arguments: a program's
    config travels as JSON text, which Flower's argument parser cannot take inside quotes.
    """
    command = ["flwr", "run", str(app_dir), connection, "--format", "json"]
    return command + (["--run-config", str(run_config_file)] if run_config_file else [])


def write_run_config(path: Path, run_config: Mapping[str, Scalar]) -> Path:
    """Write run-config entries as the TOML file ``flwr run --run-config`` reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(dict(run_config)))
    return path


def status_command(run_id: int | str, connection: str = DEFAULT_CONNECTION) -> list[str]:
    """``flwr ls`` of one run as JSON; its status ends ``finished:completed`` on success."""
    return ["flwr", "ls", connection, "--run-id", str(run_id), "--format", "json"]


def _line(command: list[str], env: Mapping[str, str]) -> str:
    """A shell line; environment values are double-quoted so that ``$HOME`` expands."""
    prefix = " ".join(f'{key}="{value}"' for key, value in env.items())
    return f"{prefix} {shlex.join(command)}"


def deployment_commands(files: DeploymentFiles, *, data_roots: Mapping[str, str] | None = None) -> str:
    """Every command of a deployment, in order and commented, ready to copy.

    The institutions, the SuperLink's address and the connection's name are read from the folder
    :func:`write_deployment_files` wrote.

    Args:
        files: that folder.
        data_roots: each institution's data folder on its own machine (default: a placeholder).
    """
    names = files.institutions()
    connection, address = files.connection()
    port = int(address.rsplit(":", 1)[1])
    operator_env = {**QUIET_ENV, "FLWR_HOME": str(files.flwr_home)}
    lines = [
        "# 1. On the SuperLink machine (the installed geofm environment on PATH, flower-superexec included):",
        _line(superlink_command(files, port=port, database=files.root / "superlink-state.db"), QUIET_ENV),
        "",
        "# 2. Operator (any machine with this folder): allow each institution's SuperNode key (idempotent:",
        "#    rerun it after a SuperLink restart; by hand: flwr supernode register supernodes/NAME.pub CONNECTION):",
        _line(["geofm", "fed", "register", "--deployment", str(files.root)], {}),
        "",
        "# 3. At each institution: copy its own folder institutions/NAME/ (ca.crt and supernode.key, nothing",
        f"#    else; never offline/ca.key) from {files.root} to the same path there, then run its line",
        "#    (SuperNodes sharing a machine need their own --port and FLWR_HOME; on a GPU machine set",
        "#    DS_ACCELERATOR=cuda instead of cpu):",
    ]
    for index, name in enumerate(names):
        root = (data_roots or {}).get(name, f"/path/to/{name}/data")
        node_env = {**QUIET_ENV, "DS_ACCELERATOR": "cpu", "FLWR_HOME": f"$HOME/.flwr-geofm-{name}"}
        lines.append(f"# {name}: hand over {files.handover(name)}/")
        command = supernode_command(
            files.handover(name) / files.ca_cert.name,
            files.node_key(name),
            address,
            port + 1 + index,  # each SuperNode's ClientApp port, after the SuperLink's
            {INSTITUTION: name, DATA_ROOT: root},
        )
        lines.append(_line(command, node_env))
    lines += [
        "",
        "# 4. Operator: launch a run, follow its log and check its final status (exit 0 only if it completed):",
        _line(["geofm", "fed", "launch", "--deployment", str(files.root), "--config", "CONFIG.yaml"], {}),
        "#    or by hand: flwr run, flwr log RUN_ID --stream, and flwr ls --run-id RUN_ID (status finished:completed):",
        _line(status_command("RUN_ID", connection), operator_env),
    ]
    return "\n".join(lines) + "\n"


def launch_run(files: DeploymentFiles, run_config: Mapping[str, Scalar], poll_s: float = 5.0) -> dict:
    """Submit a run to a deployment's SuperLink, stream its log, and check how it ended.

    ``flwr run --stream`` exits 0 even when the ServerApp fails, so the run's final status is read
    with ``flwr ls`` and anything but ``finished:completed`` is an error.

    Returns:
        The run's final record from ``flwr ls``.

    Raises:
        FederatedRunError: the run could not be submitted, or did not complete.
    """
    connection, _ = files.connection()
    env = operator_env(files)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    config_file = write_run_config(files.root / "runs" / f"run_config_{stamp}.toml", run_config)
    run_id = int(flwr_json(run_command(config_file, connection), env)["run-id"])
    print(f"run {run_id} submitted; following its log (Ctrl-C stops following, not the run)", flush=True)
    subprocess.run(["flwr", "log", str(run_id), connection, "--stream"], check=False, env=env, stdin=subprocess.DEVNULL)
    try:
        while not (record := flwr_json(status_command(run_id, connection), env)["runs"][0])["status"].startswith(
            "finished"
        ):
            time.sleep(poll_s)
    except FederatedRunError as err:
        raise FederatedRunError(
            f"lost run {run_id}: {err}. Once the SuperLink and the SuperNodes run again (the commands "
            f"`geofm fed commands --deployment {files.root}` prints), rerun this `geofm fed launch`: the run "
            "resumes from the server's last checkpoint"
        ) from err
    if record["status"] != COMPLETED:
        raise FederatedRunError(f"run {run_id} ended {record['status']}: {record.get('status-details', '')}")
    print(f"run {run_id}: {record['status']}")
    return record


def operator_env(files: DeploymentFiles) -> dict[str, str]:
    """The environment of the operator's ``flwr`` commands: this deployment's connection, and this
    environment's ``flwr`` first on PATH (the one installed beside geofm)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, **QUIET_ENV, "FLWR_HOME": str(files.flwr_home), "PATH": path}


def register_nodes(files: DeploymentFiles, names: Sequence[str] | None = None) -> dict[str, str]:
    """Register institutions' SuperNode public keys with the deployment's SuperLink, idempotently.

    A key the SuperLink already holds (after its restart with its database, or a second run of
    this command) counts as registered, so the printed commands can be rerun as they are.

    Returns:
        Institution -> ``registered as node N`` or ``already registered``.

    Raises:
        FederatedRunError: a registration failed for another reason (quoting ``flwr``'s output).
    """
    connection, _ = files.connection()
    env = operator_env(files)
    outcome = {}
    for name in names or files.institutions():
        command = [*register_command(files.node_public_key(name), name, connection), "--format", "json"]
        try:
            outcome[name] = f"registered as node {flwr_json(command, env)['node-id']}"
        except FederatedRunError as err:
            if "already in use" not in str(err):
                raise
            outcome[name] = "already registered"
    return outcome


def flwr_json(command: list[str], env: Mapping[str, str]) -> dict:
    """Run a ``flwr`` command that prints JSON; a failure is an error quoting what ``flwr`` said, on one line.

    ``flwr`` reports some failures (an unreachable SuperLink) as JSON with exit code 0.
    """
    result = subprocess.run(
        command, check=False, env=dict(env), capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    try:
        answer = json.loads(result.stdout)
    except ValueError:
        answer = {"success": False}
    if result.returncode != 0 or not answer.get("success"):
        said = answer.get("error-message") or f"{result.stdout}{result.stderr}" or f"exit code {result.returncode}"
        raise FederatedRunError(f"`{shlex.join(command)}` failed: {' '.join(said.split())}")
    return answer
