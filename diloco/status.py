"""`diloco status HOST:PORT`: what a coordinator knows — membership, round, last losses, bytes, rejections.

A coordinator with island secrets answers Status only with an island's credentials (`--name`, `--secret`), and
over TLS when it serves TLS (`--tls-ca`, plus `--tls-cert`/`--tls-key` for mutual TLS).
"""

from __future__ import annotations

import json

import grpc
from rich.console import Console
from rich.table import Table

from transport.auth import TlsConfig
from transport.config import TransportConfig
from transport.errors import TransportError, UserError
from transport.grpc_client import GrpcTransport


class StatusError(UserError, ValueError):
    """`diloco status` could not be asked as given (credentials refused, options that do not go together)."""


def show_status(
    address: str,
    as_json: bool = False,
    *,
    island: str | None = None,
    secret: str | None = None,
    tls: TlsConfig | None = None,
) -> int:
    """Print the coordinator's status; `island` + `secret` are the credentials, `tls` the channel's TLS."""
    config = TransportConfig(max_attempts=2, rpc_timeout_s=5.0)
    with GrpcTransport(address, island or "status", secret, config=config, tls=tls) as client:
        try:
            reply = client.status()
        except TransportError as exc:
            if exc.code != grpc.StatusCode.UNAUTHENTICATED:
                raise
            hint = "" if secret else "; pass --name ISLAND --secret env:VAR (an island's credentials)"
            raise StatusError(f"{exc}{hint}") from None
    detail = json.loads(reply.detail_json or "{}")
    if as_json:
        print(json.dumps({"run_id": reply.run_id, "round": reply.round, "state": reply.state, **detail}, indent=2))
        return 0
    console = Console()
    console.print(f"run [bold]{reply.run_id}[/] round {reply.round}/{detail.get('rounds_planned', '?')} "
                  f"state {reply.state}")  # fmt: skip
    table = Table("island", "state", "last seen", "last loss")
    losses = detail.get("last_losses", {})
    for isl in reply.islands:
        seen = f"{isl.last_seen_s:.1f}s ago" if isl.last_seen_s >= 0 else "-"
        loss = f"{losses[isl.name]:.4f}" if isl.name in losses else "-"
        table.add_row(isl.name, isl.state, seen, loss)
    console.print(table)
    ev = detail.get("final_eval_loss")
    console.print(
        f"eval loss {ev:.4f}  " if ev is not None else "",
        f"bytes up {detail.get('bytes_up', 0):,}  down {detail.get('bytes_down', 0):,}  "
        f"rejected {detail.get('rejected', 0)}  islands lost {detail.get('islands_lost', 0)}",
    )
    return 0
