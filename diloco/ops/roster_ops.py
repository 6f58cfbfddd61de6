"""`diloco admit` and `diloco retire`: the operator changes the roster of a live run (docs/architecture.md, "Elastic
federation").

`admit` makes the new island's credentials on the operator's machine: a secret of 256 random bits written only to
the island's own 0600 file (and, given the federation's CA key, a client certificate naming the island), then sends
the coordinator the secret's SHA-256 with the operator's credential. Nothing is left behind when the coordinator
refuses. `retire` asks the coordinator to retire an island for good, as the operator or as the island itself.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from floor.errors import UserError
from transport import diloco_pb2 as pb
from transport.auth import (
    ISLAND_KEY,
    OPERATOR_KEY,
    SECRET_KEY,
    TlsConfig,
    is_island_name,
    reserved_name_refusal,
    resolve_secret,
    secret_digest,
)
from transport.grpc_client import OperatorClient


class RosterOpError(UserError, ValueError):
    """An admission or retirement that cannot be asked for as given (one line)."""


@dataclass(frozen=True)
class IslandKit:
    """What an admitted island needs, as paths: its secret (and, under mutual TLS, its certificate and key)."""

    secret: Path
    cert: Path | None = None
    key: Path | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"secret": f"file:{self.secret}"}
        if self.cert is not None:
            out |= {"tls_cert": str(self.cert), "tls_key": str(self.key)}
        return out


def write_island_kit(out: Path, name: str, ca_dir: Path | None, days: int = 365) -> IslandKit:
    """The island's secret in `out`/NAME.secret (0600, never overwritten) and, with `ca_dir` (made by `diloco certs
    --keep-ca-key`), a client certificate naming it."""
    if not is_island_name(name):
        raise RosterOpError(f"island name {name[:64]!r} must be 1 to 64 characters of [A-Za-z0-9_-]")
    if reserved := reserved_name_refusal(name):
        raise RosterOpError(reserved)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = out / f"{name}.secret"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise RosterOpError(f"{path} exists: an island's credentials are never overwritten") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    if ca_dir is None:
        return IslandKit(path)
    from diloco.deploy.tls import issue_client_certificate

    try:
        cert, key = issue_client_certificate(ca_dir, name, out, days)
    except BaseException:
        path.unlink()
        raise
    return IslandKit(path, cert, key)


def admit_island(
    address: str,
    run_id: str,
    name: str,
    operator_ref: str,
    out: Path,
    tls: TlsConfig | None,
    ca_dir: Path | None = None,
) -> dict[str, Any]:
    """Make island `name`'s credentials in `out` and admit it into the run at `address`; the kit is removed again
    when the coordinator refuses (TransportError with its reason)."""
    if not operator_ref:
        raise RosterOpError(
            "admitting an island needs the operator's credential: network.operator_secret or --operator-secret"
        )
    operator = resolve_secret(operator_ref)
    kit = write_island_kit(out, name, ca_dir)
    request = pb.AdmitRequest(run_id=run_id, island=name, secret_sha256=secret_digest(kit.secret.read_text()))
    try:
        with OperatorClient(address, [(OPERATOR_KEY, operator)], tls) as client:
            reply = client.admit(request)
    except BaseException:
        for path in (kit.secret, kit.cert, kit.key):
            if path is not None:
                path.unlink(missing_ok=True)
        raise
    return {"island": name, "round": reply.round, "detail": reply.detail, **kit.as_json()}


def retire_island(
    address: str,
    run_id: str,
    name: str,
    reason: str,
    tls: TlsConfig | None,
    operator_ref: str = "",
    island_secret_ref: str = "",
) -> dict[str, Any]:
    """Retire island `name`, as the operator (`operator_ref`) or as the island itself (`island_secret_ref`)."""
    if operator_ref:
        metadata = [(OPERATOR_KEY, resolve_secret(operator_ref))]
    elif island_secret_ref:
        metadata = [(ISLAND_KEY, name), (SECRET_KEY, resolve_secret(island_secret_ref))]
    else:
        raise RosterOpError(
            "retiring an island needs the operator's credential (network.operator_secret, --operator-secret) "
            "or the island's own (--secret)"
        )
    with OperatorClient(address, metadata, tls) as client:
        reply = client.retire(pb.RetireRequest(run_id=run_id, island=name, reason=reason))
    return {"island": name, "round": reply.round, "detail": reply.detail}
