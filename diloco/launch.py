"""`diloco launch`: the coordinator and one process per island on this machine, over real gRPC sockets.

Processes are spawned (never forked: each child starts its own JAX and gRPC). The coordinator listens on port 0
and writes its address into the run directory; islands get their own sub-run-directories (islands/NAME), their
WAN link profile (network.links), a random secret each (passed by environment, never written to disk), and
XLA_FLAGS giving them islands.devices CPU devices. One live display follows the coordinator's Status RPC.
Ctrl+C stops every child with SIGTERM so each flushes its checkpoint.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from diloco.config import RunConfig, load_config
from diloco.progress import format_eta


class LaunchError(RuntimeError):
    """A child process failed in a way the user must see (its own one-line error is in the message)."""


def child_env(cfg: RunConfig, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cfg.islands.devices}"
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(extra)
    return env


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    out = log.open("ab")
    return subprocess.Popen([sys.executable, "-m", "diloco.cli", *argv], env=env, stdout=out, stderr=out)


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("diloco: error:")]
    return (errors or lines or [""])[-1]


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
        cfg = load_config(config, overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    addr_file = run_dir / "coordinator.addr"
    addr_file.unlink(missing_ok=True)
    logs = run_dir / "logs"
    env = child_env(cfg, secret_env)
    coordinator = _spawn(
        ["coordinator", config, "--listen", "127.0.0.1:0", "--run-dir", str(run_dir), *overrides],
        env, logs / "coordinator.log",
    )  # fmt: skip
    children: dict[str, subprocess.Popen[bytes]] = {"coordinator": coordinator}
    try:
        while not addr_file.exists():
            if coordinator.poll() is not None:
                raise LaunchError(f"coordinator failed: {_last_line(logs / 'coordinator.log')}")
            time.sleep(0.1)
        address = addr_file.read_text().strip()
        for name in names:
            children[name] = _spawn(
                ["island", config, "--name", name, "--coordinator", address,
                 "--run-dir", str(run_dir / "islands" / name), *overrides],
                env, logs / f"{name}.log",
            )  # fmt: skip
        _follow(cfg, address, children, logs, progress)
    except KeyboardInterrupt:
        _stop_all(children)
        raise
    finally:
        _stop_all(children, grace_s=30.0)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise LaunchError(f"the run did not finish: {_last_line(logs / 'coordinator.log')}")
    return json.loads(summary_path.read_text())


def _follow(
    cfg: RunConfig, address: str, children: dict[str, subprocess.Popen[bytes]], logs: Path, progress: bool
) -> None:
    """Show the live display until the coordinator exits; report an island that fails with a user error."""
    from transport.config import TransportConfig
    from transport.errors import TransportError
    from transport.grpc_client import GrpcTransport

    client = GrpcTransport(address, "launcher", config=TransportConfig(max_attempts=1, rpc_timeout_s=2.0))
    console = Console(file=sys.stderr)
    t0 = time.monotonic()
    live = Live(console=console, refresh_per_second=2) if progress and console.is_terminal else None
    if live is not None:
        live.start()
    last_print = 0.0
    try:
        while children["coordinator"].poll() is None:
            for name, proc in children.items():
                if name != "coordinator" and proc.poll() == 2:
                    raise LaunchError(f"island {name} failed: {_last_line(logs / f'{name}.log')}")
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
    if children["coordinator"].returncode != 0:
        raise LaunchError(f"coordinator failed: {_last_line(logs / 'coordinator.log')}")


def _stop_all(children: dict[str, subprocess.Popen[bytes]], grace_s: float = 20.0) -> None:
    """Islands first get time to leave on their own; then SIGTERM (checkpoints flush), then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for proc in children.values():
        if proc.poll() is None and time.monotonic() < deadline:
            try:
                proc.wait(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in children.values():
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
