"""`diloco bench load`: one real coordinator process serving many islands, played by light in-process clients.

What it answers: does the coordinator keep up when many islands talk to it at once, and what does a round cost it?
Real islands would each need a JAX process (64 of them do not fit on 2 cores), and their training is not what is
measured here. So the islands are LIGHT clients: one thread each in this process, each with its own
`transport.grpc_client.GrpcTransport` (own channel, own secret), doing exactly what an island's loop does on the
wire: join, pull the full θ once, then per round heartbeat, push a pseudo-gradient taken from θ_r (its
`base_digest` is the `param_digest` of the pull that brought θ_r, which the coordinator requires), and pull the
committed update. The pseudo-gradient is built once with numpy from the names and shapes of the first full pull
(fp32: an `EncodedTensor` whose payload is the float32 bytes), so the clients cost the coordinator's CPU nothing
but the wire. The coordinator is the real `diloco coordinator` (started with `diloco.harness.procs.Federation`) on a
config written for the benchmark (`load_config_text`): a tiny transformer, synthetic data, `islands` islands each with
its own secret, quorum = every island (each round holds all of them), leases long enough for a loaded machine.

Reported (JSON): rounds committed; per round the coordinator's own `round` event `seconds` (round open to commit)
and the push-to-commit latency measured here (from the start of the round's last push to the first moment a
client held the commit: the closing push returns only after commit, evaluation and checkpoint, and the first
pull of the update returns after them too, so the earlier of the two bounds the commit from above); the
coordinator's RSS (/proc/PID/status VmRSS) and CPU seconds (/proc/PID/stat utime + stime) after each round, its
peak RSS (VmHWM); on the coordinator's own clock, how far apart a round's pushes arrived and the time from its
last push to its `round` event (commit and evaluation); bytes moved, counted by the clients and by the coordinator;
and the rounds whose pulls brought another digest than the coordinator logged for them (must be none).

The islands retry exactly what a real island retries (`diloco.worker.island_sync.retry_forever`), so an island that
a real one would lose (a call refused for good, e.g. RESOURCE_EXHAUSTED when more calls arrive at once than the
server's transport.max_unary_calls / transport.max_streams admit) ends the benchmark with one line.

With ``--admit N`` the roster grows while the run goes on (docs/architecture.md, "Elastic federation"): the run
starts with ``--islands`` islands, and N more are admitted over the first half of the rounds, a batch after each
commit, through the operator's `Admit` call (each with a fresh secret of its own, of which the coordinator receives
only the SHA-256); each admitted island then starts as a light client, joins during the open round (which does not
wait for it) and pushes from then on. The quorum is every live island the round waits for (min_islands = 1.0).
Reported beside the above: the admissions' latency and, per round, how many islands pushed.

Run: ``diloco bench load [--islands 64] [--rounds 20] [--admit 0] [--run-dir DIR] [key=value ...]`` (JSON on stdout;
a failure is one line); the overrides change the benchmark's config (e.g. transport.max_unary_calls=80).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from diloco import RELEASE
from diloco.bench.errors import BenchError
from diloco.bench.federation import _federation
from diloco.config import RunConfig, config_digest, load_config
from diloco.coordinator.membership import REJOIN
from diloco.harness.procs import Federation
from diloco.worker.island_sync import retry_forever
from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.auth import OPERATOR_KEY, secret_digest
from transport.errors import TransportError
from transport.grpc_client import GrpcTransport, OperatorClient
from transport.handler import PullPayload

CAPS_HINT = (
    "; the server's caps on calls at once are transport.max_unary_calls and transport.max_streams: "
    "override them (key=value) to serve more islands at once"
)
"""Said when an island was refused for a cap: a real island would have failed the same way (it does not retry it)."""
CLIENT_GIVE_UP_S = 300.0
"""How long a light client keeps retrying a call the coordinator answers "not yet" or not at all."""


def load_config_text(islands: int, rounds: int, secret_refs: Sequence[str]) -> str:
    """The benchmark's run config: as small as a real run gets, so that the coordinator's own costs dominate.

    quorum.min_islands = islands: a round closes when every island pushed, so each round carries the full load.
    quorum.lease_s = 300: a light client heartbeats once per round, and on 2 loaded cores a round of 64 may take
    long; losing an island would end the benchmark (its round could never close), not measure anything.
    """
    quoted = ", ".join(f'"{ref}"' for ref in secret_refs)
    return f"""
[run]
name = "bench-load"
seed = 0

[model]
kind = "transformer"
vocab_size = 256
seq_len = 16
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64

[data]
kind = "synthetic"

[train]
rounds = {rounds}
inner_steps = 1
batch_size = 4
eval_batches = 1
checkpoint_every = 1

[islands]
count = {islands}

[codec]
uplink = "fp32"
downlink = "fp32"

[quorum]
min_islands = {islands}
lease_s = 300.0
max_deadline_s = 600.0

[network]
secrets = [{quoted}]
pull_wait_s = 10.0
"""


# -- the coordinator process, seen through /proc -----------------------------------------------------------------


def proc_memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of process `pid`, in KiB, from /proc/PID/status."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc/PID/stat fields 14 and 15."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces: cut after it
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Sample:
    """The coordinator as seen at one moment."""

    rss_kib: int
    hwm_kib: int
    cpu_s: float

    @staticmethod
    def of(pid: int) -> Sample:
        mem = proc_memory_kib(pid)
        return Sample(mem["VmRSS"], mem["VmHWM"], proc_cpu_s(pid))


# -- the light islands -------------------------------------------------------------------------------------------


class SharedDelta:
    """One synthetic pseudo-gradient for every client, built once from the first full pull's names and shapes.

    Small (1e-4 · N(0, 1)), so θ stays finite over any number of rounds; fp32, so encoding is the float32 bytes.
    """

    def __init__(self, seed: int) -> None:
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(seed)
        self.tensors: list[EncodedTensor] = []

    def from_pull(self, full: PullPayload) -> list[EncodedTensor]:
        with self._lock:
            if not self.tensors:
                self.tensors = [
                    EncodedTensor(
                        name=t.name,
                        codec="fp32",
                        dtype="float32",
                        shape=tuple(t.shape),
                        block_size=0,
                        zstd_level=0,
                        payload=(1e-4 * self._rng.standard_normal(t.shape)).astype("<f4").tobytes(),
                    )
                    for t in full.tensors
                ]
            return self.tensors


@dataclass
class ClientTrace:
    """What one light island saw: per round it pushed to, when its push started and ended and when its pull
    of the update returned (monotonic seconds), the digest the pull brought; bytes it moved."""

    push_start: dict[int, float] = field(default_factory=dict)
    push_end: dict[int, float] = field(default_factory=dict)
    pull_end: dict[int, float] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    """Round r -> the digest of θ_{r+1} that the pull after round r carried."""
    bytes_up: int = 0
    bytes_down: int = 0
    error: str = ""


def _payload_bytes(tensors: Sequence[EncodedTensor]) -> int:
    return sum(t.nbytes for t in tensors)


def light_island(address: str, cfg: RunConfig, name: str, secret: str, delta: SharedDelta, trace: ClientTrace) -> None:
    """One island's wire traffic for the whole run, without training: see the module docstring."""
    meta = {"run_id": cfg.run.name, "island": name}
    tokens = cfg.train.inner_steps * cfg.train.batch_size * cfg.model.seq_len
    try:
        with GrpcTransport(address, name, secret, config=cfg.transport) as client:
            join = pb.JoinRequest(
                **meta, config_digest=bytes.fromhex(config_digest(cfg)), last_round=-1, devices=1, release=RELEASE
            )
            retry_forever(lambda: client.join(join), "join", CLIENT_GIVE_UP_S)
            full = retry_forever(
                lambda: client.pull(pb.PullRequest(**meta, have_round=-1, full=True)), "pull", CLIENT_GIVE_UP_S
            )
            trace.bytes_down += _payload_bytes(full.tensors)
            tensors = delta.from_pull(full)
            round_, digest = full.round, full.param_digest
            while round_ < cfg.train.rounds:
                with contextlib.suppress(TransportError):  # as an island's heartbeat thread: the next call retries
                    if client.heartbeat(pb.HeartbeatRequest(**meta, round=round_, step=0)).state == REJOIN:
                        retry_forever(lambda: client.join(join), "join", CLIENT_GIVE_UP_S)
                push = pb.PushMeta(
                    **meta, round=round_, tokens=tokens, inner_steps=cfg.train.inner_steps, loss=1.0, base_digest=digest
                )
                trace.push_start[round_] = time.monotonic()
                try:
                    retry_forever(lambda: client.push(push, tensors), "push", CLIENT_GIVE_UP_S)  # noqa: B023
                except TransportError as exc:
                    if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    # A push for a round that closed meanwhile (an admitted island that joined as its round closed):
                    # as a real island does (IslandWorker), it loses that round and takes the newest θ.
                    del trace.push_start[round_]
                    full = retry_forever(lambda: client.pull(pb.PullRequest(**meta, have_round=-1, full=True)), "pull",
                                         CLIENT_GIVE_UP_S)  # fmt: skip
                    trace.bytes_down += _payload_bytes(full.tensors)
                    round_, digest = full.round, full.param_digest
                    continue
                trace.push_end[round_] = time.monotonic()
                trace.bytes_up += _payload_bytes(tensors)
                pull = pb.PullRequest(**meta, have_round=round_)
                update = retry_forever(lambda: client.pull(pull), "pull", CLIENT_GIVE_UP_S)  # noqa: B023
                trace.pull_end[round_] = time.monotonic()
                trace.bytes_down += _payload_bytes(update.tensors)
                if update.kind != "update" or update.round != round_ + 1:
                    raise BenchError(f"{name}: pull after round {round_} brought {update.kind} θ_{update.round}")
                trace.digests[round_] = update.param_digest.hex()
                round_, digest = update.round, update.param_digest
            client.leave(pb.LeaveRequest(**meta, reason="done"))
    except Exception as exc:  # reported by the main thread as the benchmark's one-line failure
        trace.error = f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# -- the benchmark -----------------------------------------------------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"median": round(statistics.median(values), 4), "max": round(max(values), 4), "min": round(min(values), 4)}


def _watch(
    fed: Federation,
    pid: int,
    threads: Callable[[], Sequence[threading.Thread]],
    traces: Sequence[ClientTrace],
    timeout_s: float,
    failed: Callable[[], bool] = lambda: False,
) -> dict[int, Sample]:
    """Sample the coordinator once after each new `round` event until every client thread is done and every round
    is logged, or one client failed (with every island in the quorum, the others would wait for it for ever).

    A round is logged when the coordinator settles it, after serving its commit (docs/architecture.md, "Commits
    off the critical path"), so the last round's event may come after the clients are done."""
    samples: dict[int, Sample] = {}

    def clients_done() -> bool:
        for r in fed.rounds():
            if r["round"] not in samples:
                samples[r["round"]] = Sample.of(pid)
        if failed() or any(t.error for t in traces):
            return True
        return not any(t.is_alive() for t in threads()) and {r for t in traces for r in t.pull_end} <= samples.keys()

    fed.wait_for(clients_done, timeout_s, "the light islands to finish every round", poll_s=0.02)
    return samples


@dataclass(frozen=True)
class LoadRun:
    """Everything one load run observed, for `report`."""

    cfg: RunConfig
    run_dir: Path
    events: list[dict[str, Any]]
    """The coordinator's `round` events."""
    pushes: list[dict[str, Any]]
    """The coordinator's `push` events (one per accepted pseudo-gradient)."""
    traces: dict[str, ClientTrace]
    samples: dict[int, Sample]
    """Round -> the coordinator just after its `round` event appeared."""
    started: Sample
    """The coordinator once it listened (imports, θ_0, evaluation and compilation done), before any island."""
    ended: Sample
    """The coordinator after the last client's last pull."""
    summary: dict[str, Any]
    exit_code: int
    """The coordinator's, once the run was over (the benchmark fails earlier if it died)."""
    push_bytes: int
    wall_s: float
    admit_s: list[float] = field(default_factory=list)
    """How long each operator's `Admit` call took (--admit)."""


class Admitter:
    """The operator of a growing run: after each of the first commits, admits the next batch of islands (the
    operator's `Admit` call, a fresh secret each) and starts each as a light client; what each admission took. A
    commit is seen when the first configured island (`lead`) holds it (the `round` events come later, settled)."""

    def __init__(
        self, lead: ClientTrace, cfg: RunConfig, operator: str, names: Sequence[str], delta: SharedDelta
    ) -> None:
        self.lead, self.cfg, self.operator, self.delta = lead, cfg, operator, delta
        self.names = list(names)
        self.traces = {name: ClientTrace() for name in names}
        self.threads: list[threading.Thread] = []
        self.seconds: list[float] = []
        """How long each `Admit` call took."""
        self.error = ""

    def run(self, address: str, batches: int) -> None:
        if not self.names:
            return
        per_batch = -(-len(self.names) // max(batches, 1))
        try:
            with OperatorClient(address, [(OPERATOR_KEY, self.operator)]) as client:
                for b in range(0, len(self.names), per_batch):
                    committed = b // per_batch  # the round whose commit the lead island must hold first
                    deadline = time.monotonic() + CLIENT_GIVE_UP_S
                    while committed not in self.lead.pull_end and not self.lead.error:
                        if time.monotonic() > deadline:
                            raise BenchError(f"round {committed} was not committed in {CLIENT_GIVE_UP_S:.0f}s")
                        time.sleep(0.01)
                    for name in self.names[b : b + per_batch]:
                        secret = secrets.token_hex(32)
                        t0 = time.monotonic()
                        request = pb.AdmitRequest(
                            run_id=self.cfg.run.name, island=name, secret_sha256=secret_digest(secret)
                        )
                        client.admit(request)
                        self.seconds.append(time.monotonic() - t0)
                        args = (address, self.cfg, name, secret, self.delta, self.traces[name])
                        thread = threading.Thread(target=light_island, args=args, name=f"light-{name}", daemon=True)
                        thread.start()
                        self.threads.append(thread)
        except Exception as exc:  # reported by the main thread as the benchmark's one-line failure
            self.error = f"admitting: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run_load_bench(
    islands: int,
    rounds: int,
    run_dir: Path,
    overrides: Sequence[str] = (),
    timeout_s: float = 900.0,
    admit: int = 0,
) -> dict[str, Any]:
    """Start the coordinator, run `islands` light islands for `rounds` rounds (and admit `admit` more over the first
    half of them), and report what it cost. `overrides` (key=value) change the benchmark's config, e.g. the server's
    limits (transport.*)."""
    if islands < 1 or rounds < 1 or admit < 0:
        raise BenchError(f"--islands and --rounds must be >= 1 and --admit >= 0 (got {islands}, {rounds}, {admit})")
    island_secrets = [secrets.token_hex(16) for _ in range(islands)]
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        refs = []
        for i, secret in enumerate(island_secrets):  # a config names where each secret lives, never the secret
            path = Path(tmp) / f"secret-{i}"
            path.write_text(secret)
            refs.append(f"file:{path}")
        config = Path(tmp) / "load.toml"
        config.write_text(load_config_text(islands, rounds, refs))
        operator = secrets.token_hex(32)
        (Path(tmp) / "operator").write_text(operator)
        growing = [
            f"network.operator_secret=file:{Path(tmp) / 'operator'}",
            f"islands.max={islands + admit}",
            f"islands.admissions_per_minute={max(10, admit)}",
            "quorum.min_islands=1.0",
        ]
        overrides = [*(growing if admit else []), *overrides]
        cfg = load_config(config, overrides)
        t0 = time.monotonic()
        with _federation(config, overrides, run_dir) as fed:
            address = fed.start_coordinator()
            assert fed.coordinator is not None
            pid = fed.coordinator.pid
            started = Sample.of(pid)
            delta = SharedDelta(cfg.run.seed)
            traces = {name: ClientTrace() for name in cfg.islands.island_names}
            threads = [
                threading.Thread(
                    target=light_island,
                    args=(address, cfg, name, secret, delta, traces[name]),
                    name=f"light-{name}",
                    daemon=True,
                )
                for name, secret in zip(cfg.islands.island_names, island_secrets, strict=True)
            ]
            lead = traces[cfg.islands.island_names[0]]
            admitter = Admitter(lead, cfg, operator, [f"joiner-{i}" for i in range(admit)], delta)
            traces |= admitter.traces
            operating = threading.Thread(target=admitter.run, args=(address, max(rounds // 2, 1)), daemon=True)
            threads.append(operating)
            for thread in threads:
                thread.start()
            samples = _watch(
                fed,
                pid,
                lambda: [*threads, *admitter.threads],
                list(traces.values()),
                timeout_s,
                lambda: bool(admitter.error),
            )
            ended = Sample.of(pid)
            errors = [t.error for t in traces.values() if t.error] + ([admitter.error] if admitter.error else [])
            if errors:
                hint = CAPS_HINT if any("RESOURCE_EXHAUSTED" in e for e in errors) else ""
                raise BenchError(
                    f"{len(errors)} light island(s) failed, first: {errors[0]}{hint} (logs: {run_dir / 'logs'})"
                )
            summary = fed.wait_done(60.0)
            exit_code = fed.coordinator.wait(30)
            run = LoadRun(
                cfg,
                run_dir,
                fed.rounds(),
                fed.events("push"),
                traces,
                samples,
                started,
                ended,
                summary,
                exit_code,
                _payload_bytes(delta.tensors),
                time.monotonic() - t0,
                admitter.seconds,
            )
    return report(run)


def _push_to_commit(run: LoadRun) -> list[float]:
    """Per round: from the start of its last push to the first moment a client held the commit (module docstring)."""
    out = []
    for e in run.events:
        r = e["round"]
        traces = [t for t in run.traces.values() if r in t.push_start and r in t.pull_end]
        last_push_start = max(t.push_start[r] for t in traces)
        first_held = min(min(t.pull_end[r] for t in traces), max(t.push_end[r] for t in traces))
        out.append(first_held - last_push_start)
    return out


def _coordinator_side(run: LoadRun) -> tuple[list[float], list[float]]:
    """Per round, on the coordinator's clock: how far apart its pushes arrived (first to last accepted), and from
    the last accepted push to its `round` event (commit and evaluation; the checkpoint is saved after the event)."""
    spread, close = [], []
    for e in run.events:
        times = [p["t"] for p in run.pushes if p["round"] == e["round"]]
        spread.append(max(times) - min(times))
        close.append(e["t"] - max(times))
    return spread, close


def report(run: LoadRun) -> dict[str, Any]:
    """The benchmark's JSON: see the module docstring."""
    committed = {e["round"]: e["digest"] for e in run.events}
    mismatched = sorted({r for t in run.traces.values() for r, d in t.digests.items() if d != committed.get(r)})
    per_round = [run.samples[r] for r in sorted(run.samples)]
    cpu = [b.cpu_s - a.cpu_s for a, b in zip([run.started, *per_round], per_round, strict=False)]
    seconds = [e["seconds"] for e in run.events]
    latency = _push_to_commit(run)
    spread, close = _coordinator_side(run)
    mib = 1024.0
    return {
        "bench": "load",
        "run_dir": str(run.run_dir),
        "islands": run.cfg.islands.count,
        "rounds_planned": run.cfg.train.rounds,
        "rounds_committed": run.summary["rounds"],
        "param_count": run.summary["param_count"],
        "push_bytes": run.push_bytes,
        "round_seconds": seconds,
        "round_seconds_stats": _stats(seconds),
        "push_to_commit_s": [round(x, 4) for x in latency],
        "push_to_commit_stats": _stats(latency),
        "push_arrival_spread_s": [round(x, 4) for x in spread],
        "last_push_to_round_event_s": [round(x, 4) for x in close],
        "coordinator": {
            "rss_mib_start": round(run.started.rss_kib / mib, 1),
            "rss_mib_per_round": [round(s.rss_kib / mib, 1) for s in per_round],
            "rss_mib_end": round(run.ended.rss_kib / mib, 1),
            "rss_mib_peak": round(run.ended.hwm_kib / mib, 1),
            "cpu_s_startup": round(run.started.cpu_s, 2),
            "cpu_s_per_round": [round(c, 3) for c in cpu],
            "cpu_s_rounds": round(run.ended.cpu_s - run.started.cpu_s, 2),
            "cpu_s_total": round(run.ended.cpu_s, 2),
        },
        "bytes": {
            "up_clients": sum(t.bytes_up for t in run.traces.values()),
            "down_clients": sum(t.bytes_down for t in run.traces.values()),
            "up_coordinator": run.summary["bytes_up"],
            "down_coordinator": run.summary["bytes_down"],
        },
        "digest_mismatched_rounds": mismatched,
        "islands_admitted": run.summary.get("islands_admitted", 0),
        "admit_s_stats": _stats(run.admit_s),
        "islands_per_round": [len([p for p in run.pushes if p["round"] == e["round"]]) for e in run.events],
        "coordinator_exit_code": run.exit_code,
        "islands_lost": run.summary["islands_lost"],
        "rejected": run.summary["rejected"],
        "load_average_1m": round(os.getloadavg()[0], 2),
        "wall_s": round(run.wall_s, 1),
    }
