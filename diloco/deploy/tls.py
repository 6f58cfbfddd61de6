"""Who may reach a coordinator and how: TLS files checked up front, the loopback rule, and launch's local PKI.

Three jobs, each a security default a user should not have to think about:

* `server_tls` / `client_tls` turn the `network.tls_*` keys (or the `--tls-*` flags that override them) into a
  `transport.auth.TlsConfig`, after checking every file the way gRPC would only complain about at handshake time,
  obscurely: readable, PEM, an unencrypted key that matches its certificate, a certificate not expired. Each
  problem is one `TlsSetupError` line naming the key and the flag.
* `exposure_problem` is the loopback rule. Beyond loopback a coordinator without island secrets lets anyone who
  reaches the port join and push pseudo-gradients into the global model, and one without TLS hands every
  island's secret (call metadata) to anyone on the path. So a coordinator refuses to listen beyond loopback
  without both, and an island or `diloco status` refuses to send a secret in clear beyond loopback, unless the
  user says `--insecure`.
* `make_local_pki` makes what `diloco launch` needs to run TLS (mutual) on one machine: a CA, a server
  certificate for 127.0.0.1 / ::1 / localhost and one client certificate per name, written with 0600 keys
  into a 0700 directory. The CA's private key is never written: once launch has signed, nobody can mint more.

`cryptography` is imported only inside the functions that need it, so `diloco status` without TLS and
`diloco --help` stay quick.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from floor.errors import UserError
from transport.auth import TlsConfig

log = logging.getLogger("diloco.deploy.tls")


class TlsSetupError(UserError, ValueError):
    """A TLS file or setting that cannot work; the message is one line naming the config key and the flag."""


class ExposureError(UserError, PermissionError):
    """A coordinator or client about to expose a run (or a secret) beyond loopback without protection."""


def _key(name: str) -> str:
    """`tls_cert` -> "network.tls_cert / --tls-cert": both places the user may have set it."""
    return f"network.{name} / --{name.replace('_', '-')}"


def _read(name: str, path: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise TlsSetupError(f"{_key(name)}: cannot read {path} ({exc.strerror})") from None
    if not data.strip():
        raise TlsSetupError(f"{_key(name)}: {path} is empty")
    return data


def _certificates(name: str, path: str) -> list[Any]:
    from cryptography import x509

    data = _read(name, path)  # outside the try: its TlsSetupError is a ValueError too
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsSetupError(f"{_key(name)}: {path} is not a PEM certificate") from None
    now = datetime.datetime.now(datetime.UTC)
    for cert in certs:
        if cert.not_valid_after_utc < now:
            raise TlsSetupError(f"{_key(name)}: {path} expired on {cert.not_valid_after_utc:%Y-%m-%d}")
    return certs


def _private_key(name: str, path: str) -> Any:
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _read(name, path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # encrypted: gRPC takes no passphrase
        raise TlsSetupError(f"{_key(name)}: {path} is an encrypted key; gRPC needs an unencrypted PEM key") from None
    except (ValueError, UnsupportedAlgorithm):
        raise TlsSetupError(f"{_key(name)}: {path} is not a PEM private key") from None
    mode = os.stat(Path(path).expanduser()).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: %s is readable by other users (mode %o); chmod 600 it", _key(name), path, stat.S_IMODE(mode))
    return key


def _pair(cert_path: str, key_path: str) -> None:
    """Both files load, and the key is the certificate's (the first certificate of the chain is the leaf)."""
    from cryptography.hazmat.primitives import serialization

    leaf = _certificates("tls_cert", cert_path)[0]
    key = _private_key("tls_key", key_path)
    spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    if leaf.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise TlsSetupError(f"{_key('tls_key')}: {key_path} is not the key of {_key('tls_cert')} {cert_path}")


def server_tls(cert: str, key: str, ca: str) -> TlsConfig | None:
    """The coordinator's TLS: None (plaintext) when no file is set; with `ca`, clients must present a certificate
    signed by it (mutual TLS). A `ca` without cert and key is refused rather than silently ignored."""
    if not (cert or key or ca):
        return None
    if not (cert and key):
        missing = "tls_key" if cert else "tls_cert"
        raise TlsSetupError(f"{_key(missing)} is required for a TLS coordinator (set tls_cert and tls_key together)")
    _pair(cert, key)
    if ca:
        _certificates("tls_ca", ca)
    return TlsConfig(cert_file=cert, key_file=key, ca_file=ca or None)


def network_client_tls(network: Any) -> TlsConfig | None:
    """`client_tls` of a config's `[network]` tls_* keys: what an island's (or its operator's) calls use."""
    return client_tls(network.tls_ca, network.tls_cert, network.tls_key, network.tls_server_name)


def client_tls(ca: str, cert: str, key: str, server_name: str) -> TlsConfig | None:
    """An island's or `diloco status`'s TLS: on when any TLS setting is given (`ca` verifies the coordinator, the
    system roots when it is empty; `cert` + `key` answer a mutual-TLS coordinator); None means plaintext."""
    if not (ca or cert or key or server_name):
        return None
    if bool(cert) != bool(key):
        missing = "tls_key" if cert else "tls_cert"
        raise TlsSetupError(f"{_key(missing)} is required too: a client certificate needs its key")
    if cert:
        _pair(cert, key)
    if ca:
        _certificates("tls_ca", ca)
    return TlsConfig(ca_file=ca or None, cert_file=cert or None, key_file=key or None, server_name=server_name or None)


# -- the loopback rule -------------------------------------------------------------------------------------------


def split_host(address: str) -> str:
    """The host part of HOST:PORT (IPv6 brackets removed; "" for ":PORT")."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    """Only what provably stays on this machine: "localhost" or a loopback IP literal. Any other name may
    resolve anywhere, and "" / 0.0.0.0 / :: mean every interface."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(listen: str, *, authenticated: bool, encrypted: bool) -> str | None:
    """Why a coordinator must not listen on `listen` as configured ("on ADDR without ...: why"); None: it may."""
    if is_loopback(split_host(listen)):
        return None
    missing = []
    if not authenticated:
        missing.append("island secrets (network.secrets)")
    if not encrypted:
        missing.append("TLS (network.tls_cert/tls_key or --tls-cert/--tls-key)")
    if not missing:
        return None
    if not authenticated:
        why = "anyone who reaches it could join and push into the global model"
    else:
        why = "island secrets would cross the network in clear"
    return f"on {listen} without {' and '.join(missing)}: {why}"


def check_exposure(listen: str, *, authenticated: bool, encrypted: bool, insecure: bool) -> None:
    """The coordinator's loopback rule: refuse (one line naming the fix), or with `insecure` warn and go on."""
    problem = exposure_problem(listen, authenticated=authenticated, encrypted=encrypted)
    if problem is None:
        return
    if not insecure:
        raise ExposureError(f"refusing to listen {problem}; listen on 127.0.0.1, configure them, or pass --insecure")
    log.warning("--insecure: listening %s", problem)


def check_client_exposure(target: str, *, sends_secret: bool, encrypted: bool, insecure: bool) -> None:
    """Refuse to send a secret in clear beyond loopback: whoever is on the path (or answers at that address)
    would learn it and could push as this island."""
    if not sends_secret or encrypted or insecure or is_loopback(split_host(target)):
        return
    raise ExposureError(
        f"refusing to send an island secret in clear to {target}: set network.tls_ca (or --tls-ca) to use TLS, "
        "or pass --insecure"
    )


# -- launch's local PKI ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalPki:
    """Paths of the files `make_local_pki` wrote."""

    ca: Path
    """The CA certificate (verifies the server for clients, and the clients for the server)."""
    server_cert: Path
    server_key: Path
    directory: Path

    def client(self, name: str) -> tuple[Path, Path]:
        """(certificate, key) of client `name`."""
        return self.directory / f"client-{name}.crt", self.directory / f"client-{name}.key"

    def server_args(self) -> list[str]:
        """`diloco coordinator` flags: serve TLS and require a client certificate (mutual TLS)."""
        return ["--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key), "--tls-ca", str(self.ca)]

    def client_args(self, name: str) -> list[str]:
        """`diloco island` / `diloco status` flags for client `name`."""
        cert, key = self.client(name)
        return ["--tls-ca", str(self.ca), "--tls-cert", str(cert), "--tls-key", str(key)]

    def client_tls(self, name: str) -> TlsConfig:
        cert, key = self.client(name)
        return TlsConfig(ca_file=str(self.ca), cert_file=str(cert), key_file=str(key))


def _san(host: str) -> Any:
    """A subject alternative name for `host`: an IP address entry for an address, a DNS name otherwise."""
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


OPERATOR_CLIENT = "diloco.operator"
"""The common name of the operator's client certificate (`diloco certs --keep-ca-key`): what `diloco admit` and
`diloco retire` present to a mutual-TLS coordinator. The certificate opens the TLS door only; the operator's secret
is the credential. It is no island name (a '.' is outside `[A-Za-z0-9_-]`), so no island can be admitted under it
and bound to the operator's certificate (`transport.auth.check_certified`)."""


def make_federation_kit(
    directory: Path, islands: Sequence[str], hosts: Sequence[str], days: int = 365, keep_ca_key: bool = False
) -> LocalPki:
    """`diloco certs`: what a federation across machines needs, in `directory`: the CA, the coordinator's
    certificate for `hosts`, a client certificate per island, and a fresh secret per island in
    `directory/secrets/NAME` (0600) for `network.secrets = ["file:..."]`. With `keep_ca_key` the CA's key stays in
    ca.key (0600) and the operator gets a client certificate (`OPERATOR_CLIENT`) for `diloco admit` and `diloco
    retire`. Nothing is printed but paths."""
    import secrets

    clients = [*islands, OPERATOR_CLIENT] if keep_ca_key else list(islands)
    pki = make_local_pki(directory, clients, days, hosts=hosts, issuer="diloco federation CA", keep_ca_key=keep_ca_key)
    (directory / "secrets").mkdir(mode=0o700, exist_ok=True)
    for name in islands:
        _write(directory / "secrets" / name, secrets.token_hex(32).encode(), private=True)
    return pki


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write a key 0600 before its first byte (no window where it is readable), never through a symlink; a
    certificate is public, so it gets 0644 less the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        if private:
            os.fchmod(f.fileno(), 0o600)  # an existing file keeps its old mode through O_CREAT
        f.write(data)


def _subject(cn: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _sign(cn: str, key: Any, issuer: Any, issuer_key: Any, ca: bool, extensions: list[Any], days: int) -> Any:
    """A P-256 certificate for common name `cn`, valid from 5 minutes ago for `days`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(_subject(cn))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    for ext in extensions:
        b = b.add_extension(ext, critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _save(directory: Path, stem: str, cert: Any, key: Any | None) -> tuple[Path, Path]:
    """`stem`.crt (public) and, when given, `stem`.key (0600, written so from its first byte)."""
    from cryptography.hazmat.primitives import serialization

    crt, pem = directory / f"{stem}.crt", directory / f"{stem}.key"
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), private=False)
    if key is not None:
        raw = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _write(pem, raw, private=True)
    return crt, pem


def _client_certificate(directory: Path, client: str, ca_name: Any, ca_key: Any, days: int) -> tuple[Path, Path]:
    """client-`client`.crt/.key in `directory`: a client certificate whose common name is the island's name."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
    return _save(directory, f"client-{client}", _sign(client, key, ca_name, ca_key, False, [usage], days), key)


def make_local_pki(
    directory: Path,
    clients: Sequence[str],
    days: int = 365,
    hosts: Sequence[str] = (),
    issuer: str = "diloco launch CA",
    keep_ca_key: bool = False,
) -> LocalPki:
    """A fresh CA, a server certificate for this machine's loopback (and `hosts`: the names or addresses islands
    dial) and one client certificate per name, in `directory` (0700; keys 0600). Certificates are P-256 ECDSA. The
    CA key stays in memory and is discarded, so no one can issue another certificate from it later, unless
    `keep_ca_key` writes it to ca.key (0600): then the operator can issue certificates for islands admitted later
    (`issue_client_certificate`, `diloco admit --ca-dir`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _subject(issuer)
    ca_path, _ = _save(
        directory, "ca", _sign(issuer, ca_key, ca_name, ca_key, True, [], days), ca_key if keep_ca_key else None
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName(
        [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
            *(_san(host) for host in hosts),
        ]
    )
    usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])
    server = _sign("localhost", server_key, ca_name, ca_key, False, [san, usage], days)
    server_cert, server_key_path = _save(directory, "server", server, server_key)
    for client in clients:
        _client_certificate(directory, client, ca_name, ca_key, days)
    return LocalPki(ca=ca_path, server_cert=server_cert, server_key=server_key_path, directory=directory)


def issue_client_certificate(ca_dir: Path, client: str, out: Path, days: int = 365) -> tuple[Path, Path]:
    """A client certificate for island `client`, signed by the CA in `ca_dir` (ca.crt and the ca.key that
    `diloco certs --keep-ca-key` kept), written to `out`: (certificate, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert, ca_key = ca_dir / "ca.crt", ca_dir / "ca.key"
    for path in (ca_cert, ca_key):
        if not path.is_file():
            raise TlsSetupError(
                f"--ca-dir {ca_dir}: {path.name} not found (a CA directory made by diloco certs --keep-ca-key)"
            )
    try:
        issuer = x509.load_pem_x509_certificate(ca_cert.read_bytes()).subject
        key = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
    except ValueError as exc:
        raise TlsSetupError(f"--ca-dir {ca_dir}: cannot load the CA ({exc})") from None
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    if (out / f"client-{client}.key").exists():
        raise TlsSetupError(f"{out / f'client-{client}.key'} exists: an island's credentials are never overwritten")
    return _client_certificate(out, client, issuer, key, days)
