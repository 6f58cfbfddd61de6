"""`diloco coordinator`: the coordinator process — a gRPC server around `Coordinator`, a ticker, a status line.

It prints its address (and writes it to RUN_DIR/coordinator.addr so `launch` can find a port-0 server), ticks the
round logic a few times a second (leases and deadlines need a clock, not just RPCs), and on SIGTERM / Ctrl+C flushes
its checkpoint and stops. When the last round is committed it waits briefly for islands to collect the final update,
then exits.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from diloco import faults
from diloco.config import RunConfig, require_federated
from diloco.coordinator.coordinator import Coordinator
from diloco.deploy.tls import check_exposure, server_tls
from diloco.ops.metrics import CoordinatorMetrics, MetricsServer, metrics_port, serve_metrics
from diloco.run.rundir import RunDir
from diloco.run.setup import build_setup
from diloco.run.warm_start import check_fresh
from floor.errors import UserError
from transport.auth import Authenticator, TlsConfig, resolve_secret, secret_digest
from transport.grpc_server import RunningServer, start_server
from transport.service import DilocoService

log = logging.getLogger("diloco.coordinator.serve")


class ListenError(UserError, OSError):
    """The coordinator cannot listen where it was told to."""


def island_secrets(cfg: RunConfig) -> dict[str, str] | None:
    if not cfg.network.secrets:
        return None
    return {name: resolve_secret(ref) for name, ref in zip(cfg.islands.island_names, cfg.network.secrets, strict=True)}


def operator_digest(cfg: RunConfig) -> bytes | None:
    """SHA-256 of network.operator_secret (None without one: the coordinator takes no operator calls)."""
    ref = cfg.network.operator_secret
    return secret_digest(resolve_secret(ref)) if ref else None


def check_listen(listen: str) -> None:
    """Fail fast, before loading data and compiling, when the address is malformed or the port is taken."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ListenError(f"--listen must be HOST:PORT (got '{listen}')")
    if int(port) == 0:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]") or "0.0.0.0", int(port)))
        except OSError as exc:
            raise ListenError(f"cannot listen on {listen}: {exc.strerror}") from None


def serve(
    cfg: RunConfig,
    run_dir: Path,
    listen: str,
    progress: bool = True,
    linger_s: float = 15.0,
    *,
    insecure: bool = False,
    metrics_port_flag: int | None = None,
) -> dict[str, Any]:
    """Run the coordinator until the run is done or a signal stops it.

    It listens before it restores its checkpoint: the gRPC health check says NOT_SERVING (and islands' calls are
    UNAVAILABLE, which they retry) until the coordinator accepts islands, SERVING then, NOT_SERVING again from the
    moment it stops. /metrics (diloco/ops/metrics.py) is served on the host it listens on, on network.metrics_port
    (`metrics_port_flag`, --metrics-port, instead), over HTTPS with its TLS certificate when it serves TLS.

    Security is settled before anything slow starts (diloco/deploy/tls.py): TLS files are checked, and beyond loopback
    the coordinator refuses to listen without island secrets and TLS unless `insecure`. With secrets, Status
    needs an island's credentials too (it reveals the run's membership, losses and progress).
    """
    check_listen(listen)
    require_federated(cfg, "coordinator")
    net = cfg.network
    tls = server_tls(net.tls_cert, net.tls_key, net.tls_ca)
    check_exposure(listen, authenticated=bool(net.secrets), encrypted=tls is not None, insecure=insecure)
    secrets = island_secrets(cfg)
    operator_digest(cfg)  # an operator secret that does not resolve is one line now, not after the restore
    check_fresh(cfg, run_dir)
    rd = RunDir(run_dir, cfg)
    stop = threading.Event()
    stopped_by: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopped_by.append(signal.Signals(signum).name)
        stop.set()

    # From before the start (the model built, the checkpoint restored: a while): a stop that comes then is kept, and
    # the coordinator stops as soon as it started, with its `stopped` record, never by the signal's default death.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server, metrics_server, coordinator = _start(cfg, rd, listen, tls, secrets, metrics_port_flag)
    except BaseException:
        _restore_handlers(previous)
        raise
    _announce(run_dir, rd, server, coordinator)
    try:
        _tick_until_done(coordinator, stop, progress, linger_s)
    finally:
        _restore_handlers(previous)
        server.stop(grace_s=1.0)
        coordinator.settled(timeout_s=120.0)  # the last commits' evaluations and checkpoints
        if stopped_by and not coordinator.done:
            # The open round is abandoned (its pushes come again after a restart); the last committed one is kept.
            coordinator.flush()
            rd.log("stopped", round=coordinator.loop.round, reason=stopped_by[0])
        summary = coordinator.world.summary()
        if coordinator.done:
            rd.write_summary(summary)
        coordinator.close()
        rd.log_memory_peak()
        rd.close()
        if metrics_server is not None:
            metrics_server.stop()
    print(json.dumps(summary), flush=True)
    return summary


def _restore_handlers(previous: dict[signal.Signals, Any]) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


def _start(
    cfg: RunConfig,
    rd: RunDir,
    listen: str,
    tls: TlsConfig | None,
    secrets: dict[str, str] | None,
    metrics_port_flag: int | None,
) -> tuple[RunningServer, MetricsServer | None, Coordinator]:
    """Listen (health NOT_SERVING), serve /metrics, restore the coordinator, then attach it (health SERVING). A
    failure on the way stops what was started and closes the run directory."""
    net = cfg.network
    metrics = CoordinatorMetrics(cfg.islands.island_names)
    # Sized for a full roster: admitted islands are honest islands too (islands.max bounds them).
    transport = cfg.transport.for_islands(cfg.islands.max, cfg.stream.fragments)
    try:
        server = start_server(None, listen, tls=tls, config=transport, on_call=metrics.call)
    except (OSError, RuntimeError, ValueError) as exc:
        rd.close()
        raise ListenError(f"cannot listen on {listen} ({exc}); is the port already in use?") from None
    metrics_server: MetricsServer | None = None
    try:
        port = metrics_port(cfg, None, metrics_port_flag)
        host = listen.rpartition(":")[0]
        metrics_server = serve_metrics(metrics.registry, host, port, certfile=net.tls_cert, keyfile=net.tls_key)
        credentials = {name: secret_digest(secret) for name, secret in (secrets or {}).items()}
        faults.at(faults.COORDINATOR, "before_restore", 0)
        coordinator = Coordinator(cfg, rd, build_setup(cfg, islands=()), metrics=metrics, credentials=credentials)
    except BaseException:
        server.stop(0)
        if metrics_server is not None:
            metrics_server.stop()
        rd.close()
        raise
    service = DilocoService(
        coordinator,
        cfg.run.name,
        coordinator.model_spec,
        authenticator=Authenticator(secrets, admitted=coordinator.enrollment.secret_of),
        config=transport,
        on_rejected=coordinator.on_rejected,
        status_requires_auth=secrets is not None,
        islands=coordinator.enrollment,
        uplink=cfg.codec.spec("uplink"),
        operator=operator_digest(cfg),
    )
    server.attach(service)  # health: SERVING
    return server, metrics_server, coordinator


def _announce(run_dir: Path, rd: RunDir, server: RunningServer, coordinator: Coordinator) -> None:
    """Say where the coordinator listens: coordinator.addr (written whole or not at all, by a rename, so whoever
    polls for it never reads it half-written), the run directory's lock, and a log line."""
    partial = run_dir / "coordinator.addr.tmp"
    partial.write_text(server.address)
    partial.replace(run_dir / "coordinator.addr")
    rd.set_address(server.address)  # a second coordinator on this run dir is told where this one listens
    log.info(
        "diloco coordinator listening on %s (run %s, round %d)",
        server.address,
        coordinator.run_id,
        coordinator.loop.round,
        extra={"fields": {"address": server.address, "round": coordinator.loop.round}},
    )


def _tick_until_done(coordinator: Coordinator, stop: threading.Event, progress: bool, linger_s: float) -> None:
    """Tick every 0.1 s until a signal stops the coordinator or the run is done and its islands left, those starting
    again included (`Coordinator.awaited_at_end`), or it lingered `linger_s`; a diverged run or a checkpoint that
    could not be written ends it with its error."""
    last_line = 0.0
    done_at: float | None = None
    while not stop.is_set():
        coordinator.tick()
        if coordinator.world.diverged is not None:  # a commit blew up (undone): stop rather than serve on
            raise coordinator.world.diverged
        failure = coordinator.committer.settler.failure
        if failure is not None:  # a checkpoint could not be written: stop, the last one is intact
            raise failure
        now = time.monotonic()
        if progress and now - last_line > 5:
            last_line = now
            _log_progress(coordinator)
        if coordinator.done:
            done_at = done_at or now
            # Islands collect the last update and leave, and one starting again (killed near the end) learns that the
            # run is done; do not wait for ever on one that died.
            settled = not coordinator.roster and not coordinator.awaited_at_end()
            if settled or now - done_at > linger_s:
                return
        stop.wait(0.1)


def _log_progress(coordinator: Coordinator) -> None:
    s = coordinator.live_status()
    fields = {k: s[k] for k in ("rounds", "final_eval_loss", "bytes_up", "bytes_down", "rejected")}
    log.info(
        "round %d/%d alive %d eval %.4f up %s B down %s B rejected %d",
        s["rounds"],
        coordinator.cfg.train.rounds,
        len(s["islands_alive"]),
        s["final_eval_loss"],
        f"{s['bytes_up']:,}",
        f"{s['bytes_down']:,}",
        s["rejected"],
        extra={"fields": fields},
    )
