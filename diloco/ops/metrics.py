"""Prometheus metrics of the coordinator and of each island, served on `network.metrics_port` (0: off).

Thin on purpose: the numbers come from where the processes already account for them. Most are fed by the events the
process logs to its metrics.jsonl (`RunDir.observers`: a `round` event is the round duration, the outer step's
seconds and the eval loss; `checkpoint` its seconds; `synced` a digest check that passed), so a metric and its event
can never disagree; the rest by one call where the number is known and no event is written (a pull's bytes, a
refusal's code, an RPC's latency, an inner-step run). Gauges about the present (the open round, its age, the islands
alive) are read from the coordinator at scrape time. A resumed coordinator starts the metrics that claim a run total
from the run's durable records (`CoordinatorMetrics.resume`; docs/architecture.md, "Metrics across a restart").

Every metric lives in a registry of its own per process (`CollectorRegistry`), never prometheus_client's global
one, so several coordinators or islands in one process (tests) do not collide. Label values are bounded: `island`
is one of the config's islands.names or "unknown" (a client that invents names grows nothing), `reason` a gRPC
status code name, `kind`, `outcome`, `method` and `result` small fixed sets. Nothing secret is exported: names,
counts, seconds, bytes and losses only.

Ports (one rule in every process, so `launch` and diloco.harness.procs.Federation need nothing of their own): with
`network.metrics_port = P` the coordinator serves on P and island i (its index in islands.names) on P + 1 + i;
`--metrics-port N` on `diloco coordinator` / `diloco island` gives that one process N instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sized
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from diloco.config import RunConfig
from diloco.run.summary import Totals
from floor.errors import UserError

UNKNOWN = "unknown"
"""The label of every island name that is not in the run's config: what a rogue client's inventions count under."""
OTHER = "other"
CODES = frozenset(code.name for code in grpc.StatusCode)
METHODS = frozenset({"Join", "Heartbeat", "Leave", "Status", "PushPseudoGrad", "PullGlobal"})
PULL_KINDS = frozenset({"update", "full", "wait", "push_first", "resync"})

RPC_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ROUND_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Run(Protocol):
    """What `IslandMetrics.trained` reads of a run of inner steps (islands.island.InnerRun)."""

    losses: Any
    tokens: int
    seconds: float


class Present(Protocol):
    """What `CoordinatorMetrics.follow` reads of the coordinator (diloco.coordinator.coordinator.Coordinator) at scrape
    time."""

    loop: Any
    """Its outer loop (diloco.run.rounds.OuterLoop): `loop.round` is the round in progress."""
    clock: Callable[[], float]
    committer: Any
    """`committer.opened_at`: when the open round opened."""
    roster: Sized
    """The members now."""
    enrollment: Sized
    """The islands that may take part."""


class MetricsError(UserError, OSError):
    """The metrics endpoint cannot listen where it was told to (a port in use, a host not of this machine)."""


def bounded(value: str, allowed: Collection[str], fallback: str = OTHER) -> str:
    """`value` when it is one of `allowed`, else `fallback`: a label never takes a value from off the wire."""
    return value if value in allowed else fallback


def metrics_port(cfg: RunConfig, island: str | None = None, flag: int | None = None) -> int:
    """The port this process serves /metrics on (0: none): `flag` (--metrics-port) when given, else
    network.metrics_port for the coordinator (`island` None) and network.metrics_port + 1 + i for island i, so that
    every process of one config on one host gets its own port."""
    if flag is not None:
        if not 0 <= flag <= 65535:
            raise MetricsError(f"--metrics-port must be a port number, 0 to 65535 (got {flag})")
        return flag
    base = cfg.network.metrics_port
    if base == 0 or island is None:
        return base
    port = base + 1 + cfg.islands.island_names.index(island)
    if port > 65535:
        raise MetricsError(
            f"island {island}'s metrics port network.metrics_port + 1 + {port - base - 1} = {port} "
            "is beyond 65535; lower network.metrics_port"
        )
    return port


@dataclass
class MetricsServer:
    """prometheus_client's own HTTP server for one registry, on a daemon thread; `stop` closes its socket."""

    httpd: Any
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, *, certfile: str = "", keyfile: str = ""
) -> MetricsServer | None:
    """Serve `registry` at http://HOST:PORT/metrics (HTTPS with `certfile`/`keyfile`: a coordinator serving TLS
    serves its metrics with the same certificate); None when `port` is 0 (metrics off)."""
    if port == 0:
        return None
    host = host.strip("[]") or "127.0.0.1"
    try:
        httpd, _ = start_http_server(port, host, registry, certfile=certfile or None, keyfile=keyfile or None)
    except OSError as exc:
        raise MetricsError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    return MetricsServer(httpd, host, port)


class CoordinatorMetrics:
    """The coordinator's metrics (names per Prometheus conventions: `diloco_` prefix, units in names, `_total`)."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = frozenset(names)
        self.islands = (*sorted(self.names), UNKNOWN)
        self.registry = r = CollectorRegistry()
        self.round = Gauge("diloco_round", "The open round (= rounds committed so far)", registry=r)
        self.open_round_age = Gauge("diloco_open_round_age_seconds", "Seconds since the open round opened", registry=r)
        self.alive = Gauge("diloco_islands_alive", "Islands holding a lease", registry=r)
        self.joined = Counter(
            "diloco_islands_joined_total", "Islands that joined (rejoins after a loss count)", registry=r
        )
        self.lost = Counter(
            "diloco_islands_lost_total",
            "Islands dropped without a Leave (presence call broken, or lease expired)",
            registry=r,
        )
        self.admitted = Counter(
            "diloco_islands_admitted_total", "Islands an operator admitted into the live run", registry=r
        )
        self.retired = Counter("diloco_islands_retired_total", "Islands retired from the run", registry=r)
        self.enrolled = Gauge("diloco_islands_enrolled", "Islands on the run's roster (may take part)", registry=r)
        self.pushes = Counter(
            "diloco_pushes_total",
            "Push RPCs by island and outcome (accepted or the gRPC code)",
            ["island", "outcome"],
            registry=r,
        )
        self.pulls = Counter(
            "diloco_pulls_total",
            "Pulls answered by island and kind (update, full, wait, ...)",
            ["island", "kind"],
            registry=r,
        )
        self.rejected = Counter("diloco_rejected_total", "Refused calls by gRPC status code", ["reason"], registry=r)
        self.bytes_up = Counter(
            "diloco_bytes_up_total", "Pseudo-gradient payload bytes accepted, by island", ["island"], registry=r
        )
        self.bytes_down = Counter(
            "diloco_bytes_down_total", "Update and parameter payload bytes served, by island", ["island"], registry=r
        )
        self.rpc = Histogram(
            "diloco_rpc_duration_seconds",
            "Server-side RPC duration, admission to last byte",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self.round_duration = Histogram(
            "diloco_round_duration_seconds",
            "Seconds from a round's opening to its commit",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.outer_step = Histogram(
            "diloco_outer_step_seconds",
            "Seconds of a commit (aggregate, outer step, encode)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.checkpoint = Histogram(
            "diloco_checkpoint_seconds", "Seconds to save a checkpoint", buckets=SAVE_BUCKETS, registry=r
        )
        self.eval_loss = Gauge("diloco_eval_loss", "Eval loss of the newest kept global model", registry=r)
        self.eval_loss.set(float("nan"))
        self.tally: dict[str, dict[str, int]] = {n: {"bytes_up": 0, "bytes_down": 0} for n in self.islands}
        """Per-island bytes as plain numbers, for `diloco status` (detail_json): bounded like the labels."""
        self.reasons: dict[str, int] = {}
        """Refusals by code, for `diloco status` (at most one key per gRPC status code)."""
        self._events: Mapping[str, Callable[[dict[str, Any]], None]] = {
            "island_joined": lambda f: self.joined.inc(),
            "island_lost": lambda f: self.lost.inc(),
            "island_admitted": lambda f: self.admitted.inc(),
            "island_retired": lambda f: self.retired.inc(),
            "push": self._on_push,
            "round": self._on_round,
            "sync": self._on_commit,
            "eval": lambda f: self._set_loss(f.get("eval_loss")),
            "checkpoint": lambda f: self.checkpoint.observe(float(f.get("seconds", 0.0))),
        }

    def enroll(self, name: str) -> None:
        """`name` joins the run's islands (configured, or admitted: bounded by islands.max) and gets its own label."""
        if name not in self.names:
            self.names = self.names | {name}
            self.islands = (*sorted(self.names), UNKNOWN)
            self.tally[name] = {"bytes_up": 0, "bytes_down": 0}

    def retire(self, name: str) -> None:
        """`name` was retired: its labels and tally go, so the series are bounded by the roster, not by every island
        ever enrolled (a call in its name is counted under "unknown" from then on)."""
        if name not in self.names:
            return
        self.names = self.names - {name}
        self.islands = (*sorted(self.names), UNKNOWN)
        self.tally.pop(name, None)
        for family in (self.pushes, self.pulls, self.bytes_up, self.bytes_down):
            family.remove_by_labels({"island": name})

    def resume(self, totals: Totals, pushes: Iterable[dict[str, Any]]) -> None:
        """A resumed run: the metrics that claim a run total start where its durable records stand, not at 0 (what
        a counter restarted at 0 would claim is the history since this process started): the roster counters and
        the eval loss from the checkpoint's totals (summary.json's), each island's bytes up from the `push` records
        kept. The per-call counters and histograms count this process's calls (docs/architecture.md, "Metrics")."""
        for counter, total in (
            (self.joined, totals.islands_joined),
            (self.lost, totals.islands_lost),
            (self.admitted, totals.islands_admitted),
            (self.retired, totals.islands_retired),
        ):
            counter.inc(total)
        self._set_loss(totals.final_eval_loss)
        for push in pushes:
            self._on_push(push)

    def island(self, name: str) -> str:
        """The `island` label of `name`: itself when it is one of the run's islands, else "unknown"."""
        return bounded(name, self.names, UNKNOWN)

    def follow(self, coordinator: Present) -> None:
        """Read the present from `coordinator` at scrape time (no lock: single reads of ints and dicts)."""
        self.round.set_function(lambda: coordinator.loop.round)
        self.open_round_age.set_function(lambda: max(0.0, coordinator.clock() - coordinator.committer.opened_at))
        self.alive.set_function(lambda: len(coordinator.roster))
        self.enrolled.set_function(lambda: len(coordinator.enrollment))

    # -- fed by metrics.jsonl events (RunDir.observers) --------------------------------------------------------

    def on_event(self, event: str, fields: dict[str, Any]) -> None:
        handler = self._events.get(event)
        if handler is not None:
            handler(fields)

    def _on_push(self, f: dict[str, Any]) -> None:
        label = self.island(str(f.get("island", "")))
        nbytes = int(f.get("bytes_up", 0))
        self.bytes_up.labels(island=label).inc(nbytes)
        self.tally[label]["bytes_up"] += nbytes

    def _on_round(self, f: dict[str, Any]) -> None:
        if f.get("seconds") is not None:
            self.round_duration.observe(float(f["seconds"]))
        self._on_commit(f)

    def _on_commit(self, f: dict[str, Any]) -> None:
        commit_s = (f.get("close_s") or {}).get("commit")
        if commit_s is not None:
            self.outer_step.observe(float(commit_s))
        self._set_loss(f.get("eval_loss"))

    def _set_loss(self, value: Any) -> None:
        if value is not None:
            self.eval_loss.set(float(value))

    # -- fed by calls where no event is written ----------------------------------------------------------------

    def call(self, method: str, island: str, code: grpc.StatusCode, seconds: float) -> None:
        """One RPC answered (transport/grpc_server.py's `on_call`): its latency, and a push's outcome."""
        self.rpc.labels(method=bounded(method, METHODS)).observe(seconds)
        if method == "PushPseudoGrad":
            outcome = "accepted" if code == grpc.StatusCode.OK else code.name.lower()
            self.pushes.labels(island=self.island(island), outcome=outcome).inc()

    def pulled(self, island: str, kind: str, nbytes: int) -> None:
        """A pull answered with `kind` (membership.PullKind's value) and `nbytes` of payload."""
        label = self.island(island)
        self.pulls.labels(island=label, kind=bounded(kind, PULL_KINDS)).inc()
        if nbytes:
            self.bytes_down.labels(island=label).inc(nbytes)
            self.tally[label]["bytes_down"] += nbytes

    def refused(self, reason: str) -> None:
        """A refusal reported as "CODE: text" (transport/service.py): counted by its code, never by its text."""
        code = bounded(reason.partition(":")[0], CODES)
        self.rejected.labels(reason=code).inc()
        self.reasons[code] = self.reasons.get(code, 0) + 1


class IslandMetrics:
    """One island's metrics (`diloco_island_` prefix); the island is the scrape target, so no island label."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.registry = r = CollectorRegistry()
        self.step_seconds = Histogram(
            "diloco_island_inner_step_seconds",
            "Mean seconds of an inner step, per run",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "diloco_island_tokens_per_second", "Tokens per second of the last run", registry=r
        )
        self.loss = Gauge("diloco_island_loss", "Training loss of the last inner step", registry=r)
        self.utilization = Gauge(
            "diloco_island_compute_utilization",
            "Inner-step seconds / wall seconds since the previous run (0 to 1)",
            registry=r,
        )
        self.retries = Counter(
            "diloco_island_retries_total", "RPCs tried again because the coordinator did not answer", registry=r
        )
        self.digest_checks = Counter(
            "diloco_island_digest_checks_total",
            "Parameter digests checked after a pull, by result",
            ["result"],
            registry=r,
        )
        self.round = Gauge("diloco_island_round", "The round of this island's copy of the global model", registry=r)
        self.round.set(-1)
        self.loss.set(float("nan"))
        self._last_run_end: float | None = None

    def on_event(self, event: str, fields: dict[str, Any]) -> None:
        if event in ("synced", "digest_mismatch"):
            self.digest_checks.labels(result="ok" if event == "synced" else "mismatch").inc()
        if event in ("synced", "joined", "resumed") and isinstance(fields.get("round"), int):
            self.round.set(fields["round"])

    def trained(self, run: Run) -> None:
        """One run of inner steps: step time, throughput, loss, and utilization since the previous run ended (the
        gap is encoding, pushing, waiting for commits and checkpoints)."""
        now = self.clock()
        steps, seconds = len(run.losses), float(run.seconds)
        if steps > 0:
            self.step_seconds.observe(seconds / steps)
            self.loss.set(float(run.losses[-1]))
        if seconds > 0:
            self.tokens_per_second.set(run.tokens / seconds)
        if self._last_run_end is not None and now > self._last_run_end:
            self.utilization.set(min(1.0, seconds / (now - self._last_run_end)))
        self._last_run_end = now

    def retried(self) -> None:
        self.retries.inc()
