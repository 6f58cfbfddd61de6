"""`diloco launch`: the coordinator and one process per island on this machine, over real gRPC sockets.

Processes are spawned (never forked: each child starts its own JAX and gRPC) by diloco.harness.procs.Federation, the
harness the fault tests and benchmarks use too. The coordinator listens on 127.0.0.1 port 0 and writes its address
into the run directory; islands run supervised (restarted when they crash) in their own sub-run-directories
(islands/NAME), with their WAN link profile (network.links) and XLA_FLAGS giving them islands.devices CPU devices.
Logs go to RUN_DIR/logs/NAME.log. One live display follows the coordinator's Status RPC. Ctrl+C stops every child
with SIGTERM so each flushes its checkpoint. With islands.processes = N each island is N processes of islands.devices
devices each, one JAX program (diloco/worker/island_group.py): its supervisor starts them as a group, joined on a
loopback port of their own, and restarts them together.

Security, even on one machine (a shared host has other users): every link is mutual TLS, with a CA, a server
certificate and one client certificate per island made at start in RUN_DIR/tls/ (diloco/deploy/tls.py; keys 0600, the
CA key never written). Each island has a secret: the config's (resolved here) or a random one. Secrets travel by
environment only: the coordinator gets every DILOCO_SECRET_<i>, island i gets DILOCO_SECRET_<i> and nothing else
(this process's own secret variables are hidden from all children), and every child's config names them as
`env:DILOCO_SECRET_<i>` references, the same for all, so they agree on the config digest while the run dir's
config.toml and the config sent at join hold references only.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from diloco.config import RunConfig, apply_overrides, load_config, parse_override, require_federated
from diloco.deploy.tls import OPERATOR_CLIENT, make_local_pki
from diloco.harness.procs import Federation, FederationError
from diloco.harness.roster_driver import RosterDriver, held_entries
from diloco.ops.progress import format_eta
from diloco.run.rundir import LAUNCH_LOCK_FILE, RunDirLock, check_free
from diloco.worker.island_group import check_supported
from floor.errors import UserError
from transport.auth import TlsConfig, resolve_secret

SECRET_VAR = "DILOCO_SECRET_{}"
"""The environment variable that carries island i's secret to the coordinator and to island i alone."""


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


def child_overrides(overrides: Sequence[str], n_islands: int) -> list[str]:
    """The children's overrides: the user's, minus any network.secrets (a literal would sit in every child's
    argv), plus references to the per-process variables that carry the secrets."""
    kept = [o for o in overrides if parse_override(o)[0] != ["network", "secrets"]]
    refs = ", ".join(f'"env:{SECRET_VAR.format(i)}"' for i in range(n_islands))
    return [*kept, f"network.secrets=[{refs}]"]


def _hidden_variables(cfg: RunConfig) -> set[str]:
    """This process's variables that hold secrets: what no child may inherit."""
    mine = {ref[4:] for ref in cfg.network.secrets if ref.startswith("env:")}
    return mine | {var for var in os.environ if var.startswith(SECRET_VAR.format(""))}


SCRIPTED: dict[str, float] = {
    "quorum.min_islands": 1.0,
    "quorum.min_deadline_s": math.inf,
    "quorum.max_deadline_s": math.inf,
    "islands.retire_after_s": 0.0,
}
"""What a launch of roster.events runs with (docs/architecture.md, "Churn by script"): each round closes when every
live island pushed, as in `simulate`, never at a deadline (the script holds a round at named points while a joiner
starts; a lost island is still noticed by presence); and no island is retired for its absence (the script does the
retiring, and a killed island restarting on a loaded machine would otherwise race islands.retire_after_s)."""


def scripted_overrides(config: str, overrides: Sequence[str]) -> list[str]:
    """`SCRIPTED` as overrides, after the user's. A key of it that the config file or an override sets to another
    value is refused in one line: launch never drops a setting the user wrote."""
    cfg = load_config(config, overrides)
    written = apply_overrides(tomllib.loads(Path(config).read_text()), overrides)
    for key, value in SCRIPTED.items():
        section, name = key.split(".")
        if name not in written.get(section, {}):
            continue
        given = getattr(getattr(cfg, section), name)
        if (type(given), given) != (type(value), value):
            wanted = ", ".join(f"{k} = {v!r}" for k, v in SCRIPTED.items())
            raise LaunchError(
                f'roster.events: launch runs a script with {wanted} (docs/architecture.md, "Churn by script"); '
                f"{key} = {given!r} is set: remove it or set it so"
            )
    return [f"{key}={value!r}" for key, value in SCRIPTED.items()]


def launch(config: str, overrides: list[str], run_dir: Path, progress: bool = True) -> dict[str, Any]:
    cfg = load_config(config, overrides)
    if cfg.roster.events:
        overrides = [*overrides, *scripted_overrides(config, overrides)]
        cfg = load_config(config, overrides)
    require_federated(cfg, "launch")
    check_supported(cfg, cfg.islands.processes)  # a multi-process island's limits: one line before anything starts
    check_scriptable(cfg)
    names = cfg.islands.island_names
    values = [resolve_secret(ref) for ref in cfg.network.secrets] or [secrets.token_hex(16) for _ in names]
    env = {SECRET_VAR.format(i): value for i, value in enumerate(values)}
    # One launch per run dir, and none beside a coordinator that already writes it: refused before anything in it
    # is rewritten (TLS files, coordinator.addr, logs). The coordinator child takes run.lock itself.
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir, role="launch", name=LAUNCH_LOCK_FILE)
    check_free(run_dir)
    joiners = sorted({event.join for event in cfg.roster.events if event.join})
    pki = make_local_pki(run_dir / "tls", [*names, *joiners, *([OPERATOR_CLIENT] if cfg.roster.events else [])])
    # Children stay in launch's process group: a Ctrl+C in the terminal reaches every one of them at once. Ctrl+C
    # and SIGTERM interrupt launch itself even when it was started with SIGINT ignored (a background job).
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    fed = Federation(
        config,
        child_overrides(overrides, len(names)),
        run_dir,
        supervise=True,
        quiet=False,
        new_session=False,
        hide_env=_hidden_variables(cfg),
        pause_at=held_entries(cfg),
    )
    driver = (
        RosterDriver(fed, cfg, pki, cfg.network.operator_secret, dict(zip(names, values, strict=True)))
        if cfg.roster.events
        else None
    )
    finished = False
    try:
        try:
            # however long it takes, as long as it lives
            fed.start_coordinator(timeout_s=math.inf, env=env, args=pki.server_args())
        except FederationError:
            raise LaunchError(f"coordinator failed: {_reason(fed.last_line())}") from None
        for i, name in enumerate(fed.names):
            var = SECRET_VAR.format(i)
            # --tls-server-name: the certificate names localhost, whatever network.tls_server_name the config has.
            fed.start_island(name, args=[*pki.client_args(name), "--tls-server-name", "localhost"], env={var: env[var]})
        # The live display asks Status as island 0 (launch holds every secret anyway), over mutual TLS.
        _follow(fed, progress, (names[0], values[0]), pki.client_tls(names[0]), driver)
        finished = True
    except KeyboardInterrupt:
        fed.stop(grace_s=15.0)  # SIGTERM at once: every child flushes its checkpoint
        raise
    finally:
        # After a finished run islands first get time to leave on their own; after a failure none will: stop them now.
        fed.stop(grace_s=15.0, linger_s=20.0 if finished else 0.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lock.release()
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise LaunchError(f"the run did not finish: {_reason(fed.last_line())}")
    return json.loads(summary_path.read_text())


def check_scriptable(cfg: RunConfig) -> None:
    """What `launch` needs to carry out roster.events: the operator's credential (it admits and retires as the
    operator does) and one process per island (a kill lands on that process). One line before anything starts."""
    if not cfg.roster.events:
        return
    if not cfg.network.operator_secret:
        raise LaunchError(
            "roster.events: launch admits and retires islands with the operator's credential: set "
            "network.operator_secret (env:VAR or file:PATH)"
        )
    if cfg.islands.processes != 1:
        raise LaunchError("roster.events: launch carries out the script with islands.processes = 1")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _reason(line: str) -> str:
    """A child's one-line error without its own "diloco: error: " (the CLI prefixes launch's line with one)."""
    return line.removeprefix("diloco: error: ")


def _island_failed(fed: Federation, name: str, grace_s: float = 10.0) -> None:
    """Raise the LaunchError for island `name`, which exited with a user error.

    An island's error is often the echo of the coordinator stopping on its own error (a diverged model, the
    island's last call refused or failed as it stopped): when the coordinator also exits with an error within
    `grace_s`, its line, the cause, is the one reported.
    """
    assert fed.coordinator is not None
    try:
        code = fed.coordinator.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        code = None
    if code not in (None, 0):
        raise LaunchError(f"coordinator failed: {_reason(fed.last_line())}")
    raise LaunchError(f"island {name} failed: {_reason(fed.last_line(name))}")


def _follow(
    fed: Federation, progress: bool, credentials: tuple[str, str], tls: TlsConfig, driver: RosterDriver | None
) -> None:
    """Show the live display until the coordinator exits, carrying out the roster script (`driver`) meanwhile;
    report an island that fails with a user error (one the script retired exits so by design)."""
    from transport.config import TransportConfig
    from transport.errors import TransportError
    from transport.grpc_client import GrpcTransport

    assert fed.coordinator is not None
    cfg = fed.cfg
    config = TransportConfig(max_attempts=1, rpc_timeout_s=2.0)
    client = GrpcTransport(fed.address, *credentials, config=config, tls=tls)
    console = Console(file=sys.stderr)
    t0 = time.monotonic()
    live = Live(console=console, refresh_per_second=2) if progress and console.is_terminal else None
    if live is not None:
        live.start()
    last_print = 0.0
    try:
        while fed.coordinator.poll() is None:
            retired = driver.retired if driver is not None else set()
            for name, proc in list(fed.islands.items()):
                if proc.poll() == 2 and name not in retired:  # a user error; other deaths are faults ridden out
                    _island_failed(fed, name)
            if driver is not None:
                driver.poll()
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
        raise LaunchError(f"coordinator failed: {_reason(fed.last_line())}")
