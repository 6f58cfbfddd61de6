"""`diloco status HOST:PORT`: what a coordinator knows — membership, round, last losses, bytes, rejections."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from transport.config import TransportConfig
from transport.grpc_client import GrpcTransport


def show_status(address: str, as_json: bool = False) -> int:
    with GrpcTransport(address, "status", config=TransportConfig(max_attempts=2, rpc_timeout_s=5.0)) as client:
        reply = client.status()
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
