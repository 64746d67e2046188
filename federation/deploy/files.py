"""The files of a deployment: a certificate authority, the SuperLink's TLS certificate, one SuperNode key per institution.

:func:`write_deployment_files` writes, for a list of institutions and the SuperLink's host name or
IP, a certificate authority, the SuperLink's TLS certificate and key, one EC P-384 key pair per
institution in OpenSSH format (SuperNode authentication) and the Flower CLI's connection
(``flwr-home/config.toml``); :mod:`federation.deploy.commands` spells out the commands that use them.

Layout of the output folder, which must lie outside any git work tree (or be ignored by git), so
that no ``git add -A`` publishes a private key::

    ca.crt                          the certificate authority's certificate (public)
    offline/ca.key                  the CA's private key: only for issuing new certificates; keep it offline
    superlink.crt, superlink.key    the SuperLink's TLS certificate and key (SAN: host, localhost, 127.0.0.1)
    supernodes/NAME.pub             each institution's SuperNode public key, registered by the operator
    institutions/NAME/              what goes to institution NAME, and to no one else:
        ca.crt, supernode.key       the CA certificate and its SuperNode's private key
    flwr-home/config.toml           the operator's `flwr` connection, used with FLWR_HOME=flwr-home
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import subprocess
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tomli_w
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geofm.errors import ConfigError

DEFAULT_PORT = 9093
DEFAULT_CONNECTION = "geofm"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class DeploymentFiles:
    """Paths of the files :func:`write_deployment_files` writes below ``root``."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "offline" / "ca.key"

    @property
    def superlink_cert(self) -> Path:
        return self.root / "superlink.crt"

    @property
    def superlink_key(self) -> Path:
        return self.root / "superlink.key"

    @property
    def flwr_home(self) -> Path:
        """FLWR_HOME of the operator's ``flwr`` CLI: holds ``config.toml`` with the connection."""
        return self.root / "flwr-home"

    def handover(self, institution: str) -> Path:
        """The folder to hand to one institution: the CA certificate and its SuperNode's private key."""
        return self.root / "institutions" / institution

    def node_key(self, institution: str) -> Path:
        """An institution's SuperNode private key (OpenSSH format)."""
        return self.handover(institution) / "supernode.key"

    def node_public_key(self, institution: str) -> Path:
        """An institution's SuperNode public key, registered with ``flwr supernode register``."""
        return self.root / "supernodes" / f"{institution}.pub"

    def institutions(self) -> list[str]:
        """Institutions with a key pair here, sorted."""
        return sorted(path.stem for path in (self.root / "supernodes").glob("*.pub"))

    def connection(self) -> tuple[str, str]:
        """Name and address (``host:port``) of the CLI's default connection in ``flwr-home/config.toml``."""
        path = self.flwr_home / "config.toml"
        try:
            superlink = tomllib.loads(path.read_text())["superlink"]
            return superlink["default"], superlink[superlink["default"]]["address"]
        except (OSError, KeyError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"{path}: expected the connection written by write_deployment_files ({err!r})") from err


def check_institutions(names: Sequence[str]) -> list[str]:
    """Institution names usable as file names and node-config values, without duplicates."""
    bad = [name for name in names if not _NAME.match(name)]
    if bad or not names or len(set(names)) != len(names):
        raise ConfigError(
            f"institutions {list(names)}: expected distinct names of letters, digits, '_', '.' or '-' "
            f"(not starting with '.', '_' or '-'){'; invalid: ' + str(bad) if bad else ''}"
        )
    return list(names)


def check_outside_git(folder: Path) -> None:
    """Refuse a folder for private keys inside a git work tree, unless git ignores it.

    Raises:
        ConfigError: ``folder`` lies in a repository's work tree and is not ignored.
    """
    probe = folder
    while not probe.exists():
        probe = probe.parent
    inside = subprocess.run(
        ["git", "-C", str(probe), "rev-parse", "--show-toplevel"], check=False, capture_output=True, text=True
    )
    if inside.returncode != 0:
        return  # not a work tree, or no git on this machine
    ignored = subprocess.run(["git", "-C", str(probe), "check-ignore", "-q", f"{folder}/"], check=False)
    if ignored.returncode != 0:
        raise ConfigError(
            f"{folder} lies in the git work tree {inside.stdout.strip()} and is not ignored: the private keys "
            "written there would be published by the next `git add -A`. Choose a folder outside the repository "
            "(e.g. ~/geofm-deployment) or add it to .gitignore first."
        )


def _subject(common_name: str) -> x509.Name:
    organization = x509.NameAttribute(NameOID.ORGANIZATION_NAME, "geofm federation")
    return x509.Name([organization, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            names.append(x509.DNSName(host))
    else:
        if str(address) != "127.0.0.1":
            names.append(x509.IPAddress(address))
    return x509.SubjectAlternativeName(names)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o600)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def write_certificates(files: DeploymentFiles, server_host: str, valid_days: int) -> None:
    """Write a CA and the SuperLink's TLS certificate for ``server_host`` (plus localhost and 127.0.0.1)."""
    now = datetime.datetime.now(datetime.UTC)
    not_before, not_after = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=valid_days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = _subject("geofm federation CA")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_subject(server_host))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(server_host), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    files.root.mkdir(parents=True, exist_ok=True)
    _write_private(files.ca_key, _pem_key(ca_key))
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(files.superlink_key, _pem_key(server_key))
    files.superlink_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))


def write_node_keys(files: DeploymentFiles, institution: str) -> None:
    """Write an institution's SuperNode key pair: EC P-384, OpenSSH format."""
    key = ec.generate_private_key(ec.SECP384R1())
    encoding, no_password = serialization.Encoding, serialization.NoEncryption()
    private = key.private_bytes(encoding.PEM, serialization.PrivateFormat.OpenSSH, no_password)
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write_private(files.node_key(institution), private)
    (files.handover(institution) / files.ca_cert.name).write_bytes(files.ca_cert.read_bytes())
    files.node_public_key(institution).parent.mkdir(parents=True, exist_ok=True)
    files.node_public_key(institution).write_bytes(public + f" geofm-{institution}\n".encode())


def write_connection(files: DeploymentFiles, address: str, connection: str = DEFAULT_CONNECTION) -> Path:
    """Write the Flower CLI's ``config.toml`` with one connection (the default) to the SuperLink at ``address``."""
    config = {
        "superlink": {
            "default": connection,
            connection: {"address": address, "root-certificates": str(files.ca_cert.resolve())},
        }
    }
    path = files.flwr_home / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config))
    return path


def write_deployment_files(
    out_dir: Path,
    institutions: Sequence[str],
    server_host: str,
    *,
    port: int = DEFAULT_PORT,
    connection: str = DEFAULT_CONNECTION,
    valid_days: int = 365,
) -> DeploymentFiles:
    """Write the CA, the SuperLink's certificate and key, every institution's key pair and the CLI's connection.

    Args:
        out_dir: output folder (created).
        institutions: one SuperNode per name.
        server_host: host name or IP address the SuperNodes and the operator reach the SuperLink at.
        port: the SuperLink's HTTPS port (Fleet, Control and Runtime APIs).
        connection: name of the connection in the CLI's config.toml.
        valid_days: certificate validity.
    """
    names = check_institutions(institutions)
    files = DeploymentFiles(Path(out_dir).resolve())
    check_outside_git(files.root)
    write_certificates(files, server_host, valid_days)
    for name in names:
        write_node_keys(files, name)
    write_connection(files, f"{server_host}:{port}", connection)
    return files


__all__ = [
    "DEFAULT_CONNECTION",
    "DEFAULT_PORT",
    "DeploymentFiles",
    "check_institutions",
    "check_outside_git",
    "write_certificates",
    "write_connection",
    "write_deployment_files",
    "write_node_keys",
]
