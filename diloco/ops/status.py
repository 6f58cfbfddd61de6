"""`diloco status HOST:PORT`: what a coordinator knows — health, membership, round, last losses, bytes, rejections.

A coordinator with island secrets answers Status only with an island's credentials (`--name`, `--secret`), and
over TLS when it serves TLS (`--tls-ca`, plus `--tls-cert`/`--tls-key` for mutual TLS). The health line is the
standard gRPC health check: NOT_SERVING while the coordinator restores its checkpoint or stops (the command then
says so and exits 1 without asking for Status). `--watch` redraws the same view every ~2 s until Ctrl+C, which ends
it with exit code 0; a coordinator that goes away meanwhile is shown as such, and the view comes back with it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import grpc
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from floor.errors import UserError
from transport import diloco_pb2 as pb
from transport.auth import TlsConfig
from transport.config import TransportConfig
from transport.errors import TransportError
from transport.grpc_client import GrpcTransport

SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
WATCH_INTERVAL_S = 2.0
WATCH_CONFIG = TransportConfig(max_attempts=1, rpc_timeout_s=3.0)
"""One quick attempt per frame: the next frame is the retry."""


class StatusError(UserError, ValueError):
    """`diloco status` could not be asked as given (credentials refused, options that do not go together)."""


def health_of(client: GrpcTransport) -> str:
    """The coordinator's health status, or "unknown (CODE)" when it cannot be asked (an older coordinator without
    the health service, a handshake that failed: the Status call that follows then says why)."""
    try:
        return client.health()
    except TransportError as exc:
        return f"unknown ({exc.code.name})"


def ask(client: GrpcTransport, secret: str | None) -> pb.StatusReply:
    """The Status RPC; a refusal for want of credentials says which ones to pass."""
    try:
        return client.status()
    except TransportError as exc:
        if exc.code != grpc.StatusCode.UNAUTHENTICATED:
            raise
        hint = "" if secret else "; pass --name ISLAND --secret env:VAR (an island's credentials)"
        raise StatusError(f"{exc}{hint}") from None


def status_view(reply: pb.StatusReply, detail: dict[str, Any], health: str) -> RenderableType:
    """The whole view: a header line, one row per enrolled island (state, last seen, last loss, bytes; an admitted
    island marked so), the retired ones, the totals."""
    header = Text.from_markup(
        f"run [bold]{reply.run_id}[/] round {reply.round}/{detail.get('rounds_planned', '?')} state {reply.state} "
        f"health {health}"
    )
    table = Table("island", "state", "last seen", "last loss", "bytes up", "bytes down")
    losses = detail.get("last_losses", {})
    per_island = detail.get("island_bytes", {})
    roster = detail.get("roster") if isinstance(detail.get("roster"), dict) else {}
    admitted = set(roster.get("admitted") or ())
    for isl in reply.islands:
        seen = f"{isl.last_seen_s:.1f}s ago" if isl.last_seen_s >= 0 else "-"
        loss = f"{losses[isl.name]:.4f}" if isinstance(losses.get(isl.name), int | float) else "-"
        nbytes = per_island.get(isl.name, {})
        up, down = (f"{nbytes[k]:,}" if isinstance(nbytes.get(k), int) else "-" for k in ("bytes_up", "bytes_down"))
        table.add_row(isl.name + (" (admitted)" if isl.name in admitted else ""), isl.state, seen, loss, up, down)
    ev = detail.get("final_eval_loss")
    by_code = detail.get("rejected_by_code") or {}
    codes = f" ({', '.join(f'{k} {v}' for k, v in sorted(by_code.items()))})" if by_code else ""
    totals = Text(
        (f"eval loss {ev:.4f}  " if isinstance(ev, int | float) else "")
        + f"bytes up {detail.get('bytes_up', 0):,}  down {detail.get('bytes_down', 0):,}  "
        f"rejected {detail.get('rejected', 0)}{codes}  islands lost {detail.get('islands_lost', 0)}"
    )
    retired = roster.get("retired") or {}
    if not isinstance(retired, dict) or not retired:
        return Group(header, table, totals)
    shown_names = list(retired)[-8:]  # the newest
    shown = ", ".join(f"{n} (round {retired[n].get('round')}: {retired[n].get('reason')})" for n in shown_names)
    total = roster.get("retired_total")
    total = total if isinstance(total, int) and total >= len(retired) else len(retired)  # an older coordinator's
    more = f" and {total - len(shown_names)} more" if total > len(shown_names) else ""
    return Group(header, table, totals, Text(f"retired: {shown}{more}"))


def show_status(
    address: str,
    as_json: bool = False,
    *,
    island: str | None = None,
    secret: str | None = None,
    tls: TlsConfig | None = None,
    watch: bool = False,
    interval_s: float = WATCH_INTERVAL_S,
) -> int:
    """Print the coordinator's status (exit code 1 when it is not serving); `island` + `secret` are the
    credentials, `tls` the channel's TLS; `watch` keeps the view live until Ctrl+C."""
    if watch and as_json:
        raise StatusError("--watch and --json do not go together (--json prints one snapshot)")
    if watch:
        return _watch(
            lambda: GrpcTransport(address, island or "status", secret, config=WATCH_CONFIG, tls=tls),
            address,
            secret,
            interval_s,
        )
    config = TransportConfig(max_attempts=2, rpc_timeout_s=5.0)
    with GrpcTransport(address, island or "status", secret, config=config, tls=tls) as client:
        health = health_of(client)
        if health == NOT_SERVING:
            if as_json:
                print(json.dumps({"health": health}, indent=2))
            else:
                Console().print(f"coordinator {address}: health {health} (starting or stopping)")
            return 1
        reply = ask(client, secret)
    detail = json.loads(reply.detail_json or "{}")
    if as_json:
        print(
            json.dumps(
                {"run_id": reply.run_id, "round": reply.round, "state": reply.state, "health": health, **detail},
                indent=2,
            )
        )
        return 0
    Console().print(status_view(reply, detail, health))
    return 0


def _snapshot(connect: Callable[[], GrpcTransport], address: str, secret: str | None) -> RenderableType:
    """One frame of `--watch`: the view, or a line saying why there is none right now. Each frame dials anew: a
    channel that once failed to connect waits out gRPC's reconnect backoff (up to minutes), which would hide a
    restarted coordinator from the view."""
    with connect() as client:
        return _frame(client, address, secret)


def _frame(client: GrpcTransport, address: str, secret: str | None) -> RenderableType:
    """A coordinator away or starting is a line in the view, not the end of it; refused credentials (StatusError)
    end the watch, since no later frame would be any different."""
    health = health_of(client)
    when = time.strftime("%H:%M:%S")
    if health == NOT_SERVING:
        return Text(f"{when}  coordinator {address}: health {health} (starting or stopping)")
    try:
        reply = ask(client, secret)
    except TransportError as exc:
        return Text(f"{when}  coordinator {address} does not answer: {exc}")
    view = status_view(reply, json.loads(reply.detail_json or "{}"), health)
    return Group(Text(f"{when}  {address}  (Ctrl+C to stop)", style="dim"), view)


def _pause(seconds: float) -> None:
    """Between two frames (a test replaces it to stop the loop)."""
    time.sleep(seconds)


def _watch(connect: Callable[[], GrpcTransport], address: str, secret: str | None, interval_s: float) -> int:
    """Redraw every `interval_s` until Ctrl+C (exit code 0, the terminal left as it was)."""
    try:
        with Live(_snapshot(connect, address, secret), auto_refresh=False) as live:
            while True:
                _pause(interval_s)
                live.update(_snapshot(connect, address, secret), refresh=True)
    except KeyboardInterrupt:
        return 0
