"""Deployment files (CA, SuperLink certificate, SuperNode keys, CLI connection), commands and ``geofm fed``."""

from __future__ import annotations

import argparse
import inspect
import ipaddress
import os
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from flwr.cli.flower_config import parse_superlink_connection
from flwr.common.config import parse_config_args
from flwr.supernode import cli as supernode_cli
from flwr.supernode import start_client_internal

import federation.deploy.commands
from federation.cli import program_run_config, register
from federation.deploy.commands import (
    deployment_commands,
    format_config_values,
    launch_run,
    run_supernode,
    supernode_command,
)
from federation.deploy.files import write_deployment_files
from federation.flower.adapter import run_supernode_in_process
from federation.runtime.contract import config_entry
from federation.runtime.processes import is_zombie
from geofm.errors import ConfigError, FederatedRunError

pytestmark = pytest.mark.slow


def test_files_hold_a_ca_signed_superlink_certificate_p384_openssh_keys_and_the_cli_connection(tmp_path):
    files = write_deployment_files(tmp_path / "fed", ["esa", "ign"], "fl.example.org", port=9443)
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    cert = x509.load_pem_x509_certificate(files.superlink_cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"fl.example.org", "localhost"}
    local = [ipaddress.ip_address("127.0.0.1")]
    assert san.get_values_for_type(x509.IPAddress) == local, "the SuperLink's own SuperExec connects to 127.0.0.1"
    assert files.superlink_key.stat().st_mode & 0o077 == 0 and files.ca_key.stat().st_mode & 0o077 == 0, "keys private"
    assert files.institutions() == ["esa", "ign"]
    for name in files.institutions():
        private = load_ssh_private_key(files.node_key(name).read_bytes(), None)
        public = load_ssh_public_key(files.node_public_key(name).read_bytes())
        assert isinstance(private.curve, ec.SECP384R1) and private.public_key() == public, f"{name}: P-384 OpenSSH pair"
    name, address = files.connection()
    assert (name, address) == ("geofm", "fl.example.org:9443")
    table = tomllib.loads((files.flwr_home / "config.toml").read_text())["superlink"][name]
    connection = parse_superlink_connection(table, name)
    assert connection.root_certificates == str(files.ca_cert) and not connection.insecure, "Flower reads the connection"
    with pytest.raises(ConfigError, match=r"invalid: \['-bad'\]"):
        write_deployment_files(tmp_path / "x", ["ok", "-bad"], "h")
    san_ip = write_deployment_files(tmp_path / "ip", ["a"], "10.0.0.5").superlink_cert.read_bytes()
    ips = x509.load_pem_x509_certificate(san_ip).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.0.0.5") in ips.get_values_for_type(x509.IPAddress)


def test_private_keys_are_kept_apart_and_never_written_into_a_tracked_folder(tmp_path):
    files = write_deployment_files(tmp_path / "fed", ["esa", "ign"], "fl.example.org")
    handed = {p.relative_to(files.handover("esa")).as_posix() for p in files.handover("esa").rglob("*")}
    assert handed == {"ca.crt", "supernode.key"}, "an institution's folder holds its own key and the CA certificate"
    assert files.ca_key.parent != files.root and set(files.root.glob("*.key")) == {files.superlink_key}
    assert not list((files.root / "supernodes").glob("*.key")), "no private key beside the public ones"
    text = deployment_commands(files)
    assert f"# esa: hand over {files.handover('esa')}/" in text and "never offline/ca.key" in text

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    with pytest.raises(ConfigError, match=r"lies in the git work tree .* not ignored"):
        write_deployment_files(repo / "deploy", ["esa"], "h")
    assert not (repo / "deploy").exists(), "nothing is written before the refusal"
    (repo / ".gitignore").write_text("/deploy/\n")
    assert write_deployment_files(repo / "deploy", ["esa"], "h").node_key("esa").exists(), "an ignored folder is fine"


def test_config_values_are_formatted_as_flower_parses_them():
    values = {"institution": "esa", "data-root": "/data/my archive", "label": 'a=1 b="x"', "n": 3, "f": 0.5, "ok": True}
    assert parse_config_args([format_config_values(values)]) == values
    with pytest.raises(ConfigError, match="both single and double quotes"):
        format_config_values({"x": 'it\'s "odd"'})


def test_commands_cover_superlink_registration_supernodes_and_the_run(tmp_path):
    files = write_deployment_files(tmp_path / "fed", ["esa", "ign"], "fl.example.org")
    text = deployment_commands(files, data_roots={"esa": "/archive/esa"})
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    superlink = shlex.split(lines[0])
    tls = ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile")
    for flag in (*tls, "--enable-supernode-auth", "--disable-runtime-dependency-installation"):
        assert flag in superlink, f"{flag} missing from {lines[0]}"
    [register] = [shlex.split(line) for line in lines if " fed register " in line]
    assert register[register.index("--deployment") + 1] == str(files.root), "every key, idempotently"
    nodes = [shlex.split(line) for line in lines if " fed supernode " in line]
    assert len(nodes) == 2 and len({node[node.index("--port") + 1] for node in nodes}) == 2, "one Runtime API port each"
    configs = [parse_config_args([node[node.index("--node-config") + 1]]) for node in nodes]
    assert configs[0] == {"institution": "esa", "data-root": "/archive/esa"} and configs[1]["institution"] == "ign"
    assert all(node[node.index("--superlink") + 1] == "fl.example.org:9093" for node in nodes)
    launch = shlex.split(next(line for line in lines if " fed launch " in line))
    assert launch[launch.index("--deployment") + 1] == str(files.root), "the run is launched and followed by geofm"
    assert any("flwr ls geofm --run-id RUN_ID --format json" in line for line in lines), "the final status is checked"


def test_fed_command_line_writes_certificates_and_prints_commands(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="geofm")
    register(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "fed"
    args = parser.parse_args(
        ["fed", "certs", "--deployment", str(out), "--institutions", "esa,ign", "--host", "10.1.2.3", "--port", "9000"]
    )
    args.handler(args)
    printed = capsys.readouterr().out
    assert (out / "institutions" / "ign" / "supernode.key").exists() and "--superlink 10.1.2.3:9000" in printed
    nodes = [line for line in printed.splitlines() if " fed supernode " in line]
    assert [shlex.split(line)[-1] for line in nodes] == ["9001", "9002"], "node ports follow --port"
    assert all('DS_ACCELERATOR="cpu"' in line for line in nodes), "client processes know their accelerator"
    args = parser.parse_args(["fed", "commands", "--out", str(out), "--data-root", "ign=/srv/ign"])  # as before
    args.handler(args)
    printed = capsys.readouterr().out
    assert 'data-root="/srv/ign"' in printed, printed
    args = parser.parse_args(["fed", "commands", "--deployment", str(out), "--data-root", "ign"])
    with pytest.raises(ConfigError, match="expected NAME=PATH"):
        args.handler(args)
    config = tmp_path / "toy.yaml"
    config.write_text("rounds: 3\nname: a\n")
    args = parser.parse_args(
        [
            "fed",
            "simulate",
            "--config",
            str(config),
            "--program",
            "toy",
            "--institutions",
            "a,b",
            "name=a b",
            "rounds=4",
        ]
    )
    assert args.handler.__name__ == "_simulate"
    assert program_run_config(args) == {
        "program": "toy",
        "institutions": "a,b",
        "config": config_entry({"rounds": 4, "name": "a b"}),
    }


def test_a_supernode_the_superlink_refuses_is_started_again_for_a_bounded_time(tmp_path, monkeypatch, capfd):
    """As after a crash: refused while its previous process still counts as online, then accepted."""
    starts = tmp_path / "starts"
    fake = tmp_path / "bin" / "flower-supernode"
    fake.parent.mkdir()
    leftovers = tmp_path / "leftovers"
    fake.write_text(  # refused twice; each refused start leaves a child holding its output, as SuperExec does
        "#!/bin/sh\n"
        f'echo start >> "{starts}"\n'
        f'if [ "$(wc -l < "{starts}")" -lt 3 ]; then sleep 600 & echo $! >> "{leftovers}"; '
        'echo "ERROR: Failed to activate SuperNode."; exit 1; fi\n'
        'echo "SuperNode ID: 7 $*"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    assert run_supernode(["--superlink", "h:1"], retry_activation_s=60, pause_s=0) == 0
    assert starts.read_text().count("start") == 3 and "SuperNode ID: 7 --superlink h:1" in capfd.readouterr().out
    left = [int(pid) for pid in leftovers.read_text().split()]
    assert len(left) == 2 and not any(Path(f"/proc/{pid}").exists() and not is_zombie(pid) for pid in left)
    starts.unlink()
    assert run_supernode([], retry_activation_s=0, pause_s=0) == 1, "no retry without a window: refused for good"
    assert starts.read_text().count("start") == 1


def test_a_supernode_waits_for_work_and_for_replies_at_most_its_poll_interval(monkeypatch):
    """flower-supernode's fixed waits (3 s without a message, 0.5 s between looks for a reply) are cut to poll_s."""
    source = inspect.getsource(start_client_internal)
    assert "time.sleep(3)" in source and "time.sleep(0.5)" in source, "the waits this shortens are Flower's"
    slept, argv = [], []

    def flower_supernode():
        argv.append(sys.argv)
        start_client_internal.time.sleep(3)
        start_client_internal.time.sleep(0.1)

    monkeypatch.setattr(start_client_internal, "time", time)  # put back after the test
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(supernode_cli, "flower_supernode", flower_supernode)
    monkeypatch.setattr(sys, "argv", sys.argv)
    run_supernode_in_process(["--superlink", "h:1"], poll_s=0.2)
    assert slept == [0.2, 0.1] and argv == [["flower-supernode", "--superlink", "h:1"]]
    assert start_client_internal.time.monotonic is time.monotonic, "the rest of time as it is"


def test_a_supernode_started_with_poll_s_runs_flower_supernode_with_shortened_waits(tmp_path):
    command = supernode_command(
        tmp_path / "ca.crt", tmp_path / "node.key", "h:1", 9094, {"institution": "a"}, poll_s=0.2
    )
    assert command[: command.index("--")] == [
        "geofm",
        "fed",
        "supernode",
        "--retry-activation-s",
        "120",
        "--poll-s",
        "0.2",
    ]
    args = argparse.ArgumentParser()
    register(args.add_subparsers(dest="command"))
    parsed = args.parse_args(command[1:])
    assert parsed.poll_s == 0.2 and parsed.arguments[:3] == ["--", "--superlink", "h:1"]
    assert args.parse_args(["fed", "supernode", "--", "--superlink", "h:1"]).poll_s is None, "Flower's own waits"


def test_a_message_s_clientapp_process_does_not_import_torch():
    """A deployed node starts a ClientApp process per message, which imports federation.flower.adapter: not torch's seconds."""
    code = "import sys, federation.flower.adapter; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def _fake_command(folder: Path, name: str, script: str) -> Path:
    fake = folder / "bin" / name
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    return fake.parent


def test_a_key_refused_longer_than_a_crashed_node_counts_as_online_is_reported_unknown(tmp_path, monkeypatch, capfd):
    """flower-supernode says the same for an unknown key as for a node still online; time tells them apart."""
    starts = tmp_path / "starts"
    folder = _fake_command(
        tmp_path, "flower-supernode", f'echo start >> "{starts}"\necho "ERROR: Failed to activate SuperNode."; exit 1\n'
    )
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    monkeypatch.setattr(federation.deploy.commands, "ONLINE_PATIENCE_S", 0.0)  # any later refusal is past it
    with pytest.raises(FederatedRunError, match=r"does not know this SuperNode's key.*`geofm fed register"):
        run_supernode([], retry_activation_s=600, pause_s=0)
    assert starts.read_text().count("start") == 2
    assert "or the SuperLink does not know this key" in capfd.readouterr().out, "the retry names both causes"


def test_launch_reports_a_lost_superlink_and_how_to_resume(tmp_path, monkeypatch):
    """flwr ls exits 0 with an error in its JSON once the SuperLink is gone."""
    files = write_deployment_files(tmp_path / "fed", ["esa"], "127.0.0.1")
    unavailable = (
        '{"success": false, "error-message": "Using SuperLink: geofm\\n\\nConnection to the SuperLink is '
        'unavailable. Please check your network connection."}'
    )
    folder = _fake_command(
        tmp_path,
        "flwr",
        f"""case "$1" in run) echo '{{"success": true, "run-id": 7}}';; ls) printf '%s\\n' '{unavailable}';; esac\n""",
    )
    environment = {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}
    monkeypatch.setattr(federation.deploy.commands, "operator_env", lambda files: environment)
    with pytest.raises(FederatedRunError) as lost:
        launch_run(files, {"program": "toy"})
    message = str(lost.value)
    assert message.startswith("lost run 7: `flwr ls geofm --run-id 7 --format json` failed: Using SuperLink")
    assert "Connection to the SuperLink is unavailable" in message and "exit 0" not in message
    assert f"geofm fed commands --deployment {files.root}" in message and "rerun this `geofm fed launch`" in message
    assert "\n" not in message
