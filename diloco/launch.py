"""`diloco launch`: the coordinator and one process per island on this machine, over real gRPC sockets.

Processes are spawned (never forked: each child starts its own JAX and gRPC) by diloco.procs.Federation, the
harness the fault tests and benchmarks use too. The coordinator listens on port 0 and writes its address into the
run directory; islands run supervised (restarted when they crash) in their own sub-run-directories
(islands/NAME), with their WAN link profile (network.links), a random secret each (passed by environment, never
written to disk), and XLA_FLAGS giving them islands.devices CPU devices. Logs go to RUN_DIR/logs/NAME.log.
One live display follows the coordinator's Status RPC. Ctrl+C stops every child with SIGTERM so each flushes
its checkpoint.
"""

from __future__ import annotations

import json
import math
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from diloco.config import RunConfig, load_config
from diloco.procs import Federation, FederationError
from diloco.progress import format_eta
from transport.errors import UserError


class LaunchError(UserError, RuntimeError):
    """A child process failed in a way the user must see (its own one-line error is in the message)."""


def _status_table(status: dict[str, Any], cfg: RunConfig, t0: float) -> Table:
    table = Table(title=f"diloco launch: {cfg.run.name}", show_header=True)
    for col in ("round", "alive", "loss", "eval", "up", "down", "util", "ETA"):
        table.add_column(col)
    rounds = status.get("rounds", 0)
    elapsed = time.monotonic() - t0
    eta = elapsed / rounds * (cfg.train.rounds - rounds) if rounds else 0.0
    losses = list(status.get("last_losses", {}).values())
    table.add_row(
        f"{rounds}/{cfg.train.rounds}",
        f"{len(status.get('islands_alive', []))}/{cfg.islands.count}",
        f"{sum(losses) / len(losses):.4f}" if losses else "-",
        f"{status['final_eval_loss']:.4f}" if status.get("final_eval_loss") is not None else "-",
        f"{status.get('bytes_up', 0) / 1e6:.1f} MB",
        f"{status.get('bytes_down', 0) / 1e6:.1f} MB",
        f"{status.get('compute_utilization', 0):.0%}",
        format_eta(eta) if rounds else "-",
    )
    return table


def launch(config: str, overrides: list[str], run_dir: Path, progress: bool = True) -> dict[str, Any]:
    cfg = load_config(config, overrides)
    names = cfg.islands.island_names
    secret_env: dict[str, str] = {}
    if not cfg.network.secrets:
        refs = [f"env:DILOCO_SECRET_{i}" for i in range(len(names))]
        overrides = [*overrides, "network.secrets=[" + ", ".join(f'"{r}"' for r in refs) + "]"]
        secret_env = {f"DILOCO_SECRET_{i}": secrets.token_hex(16) for i in range(len(names))}
    # Children stay in launch's process group: a Ctrl+C in the terminal reaches every one of them at once. Ctrl+C
    # and SIGTERM interrupt launch itself even when it was started with SIGINT ignored (a background job).
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    fed = Federation(config, overrides, run_dir, env=secret_env, supervise=True, quiet=False, new_session=False)
    try:
        try:
            fed.start_coordinator(timeout_s=math.inf)  # however long it takes, as long as it lives
        except FederationError:
            raise LaunchError(f"coordinator failed: {fed.last_line()}") from None
        for name in fed.names:
            fed.start_island(name)
        _follow(fed, progress)
    except KeyboardInterrupt:
        fed.stop(grace_s=15.0)  # SIGTERM at once: every child flushes its checkpoint
        raise
    finally:
        fed.stop(grace_s=15.0, linger_s=20.0)  # islands first get time to leave on their own
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise LaunchError(f"the run did not finish: {fed.last_line()}")
    return json.loads(summary_path.read_text())


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _follow(fed: Federation, progress: bool) -> None:
    """Show the live display until the coordinator exits; report an island that fails with a user error."""
    from transport.config import TransportConfig
    from transport.errors import TransportError
    from transport.grpc_client import GrpcTransport

    assert fed.coordinator is not None
    cfg = fed.cfg
    client = GrpcTransport(fed.address, "launcher", config=TransportConfig(max_attempts=1, rpc_timeout_s=2.0))
    console = Console(file=sys.stderr)
    t0 = time.monotonic()
    live = Live(console=console, refresh_per_second=2) if progress and console.is_terminal else None
    if live is not None:
        live.start()
    last_print = 0.0
    try:
        while fed.coordinator.poll() is None:
            for name, proc in fed.islands.items():
                if proc.poll() == 2:  # a user error; any other death is a fault the federation rides out
                    raise LaunchError(f"island {name} failed: {fed.last_line(name)}")
            try:
                status = json.loads(client.status().detail_json)
            except (TransportError, json.JSONDecodeError):
                status = None
            if status is not None:
                if live is not None:
                    live.update(_status_table(status, cfg, t0))
                elif progress and time.monotonic() - last_print > 5:
                    last_print = time.monotonic()
                    console.print(_status_table(status, cfg, t0))
            time.sleep(0.5)
    finally:
        if live is not None:
            live.stop()
        client.close()
    if fed.coordinator.returncode != 0:
        raise LaunchError(f"coordinator failed: {fed.last_line()}")
