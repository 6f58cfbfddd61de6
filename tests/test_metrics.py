"""Operations: Prometheus /metrics of the coordinator and islands, the gRPC health check, `diloco status --watch`.

What an operator relies on: the numbers move while a real federation trains (scraped over HTTP, twice); no client
can grow the label sets by inventing island names or refusal texts (1,000 hostile calls, then the exposition text
is parsed); health says NOT_SERVING while a coordinator restores its checkpoint and SERVING once it accepts islands
(a real restart, checked with the standard health stub); `diloco status` shows the health and `--watch` ends on
Ctrl+C with exit code 0 and no traceback.
"""

from __future__ import annotations

import math
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from diloco.config import load_config
from diloco.harness.procs import Federation
from diloco.ops.metrics import (
    CODES,
    METHODS,
    PULL_KINDS,
    UNKNOWN,
    CoordinatorMetrics,
    IslandMetrics,
    metrics_port,
    serve_metrics,
)
from diloco.ops.status import show_status, status_view
from diloco.run.rundir import RunDir
from floor.codec import CodecSpec
from pytrees.encode import encode_named
from pytrees.naming import flatten_named
from tests.conftest import ENV, FAST, JAX_CACHE, REPO, WAIT_S, child_env
from tests.reference_handler import ReferenceHandler
from tests.wire_helpers import push_chunks
from transport import diloco_pb2 as pb
from transport.auth import call_metadata
from transport.config import TransportConfig
from transport.grpc_client import GrpcTransport
from transport.grpc_server import RunningServer, start_server
from transport.service import DilocoService

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_ports(n: int) -> int:
    """A base port P with P .. P+n-1 free right now (the metrics port rule gives island i port P + 1 + i)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            held = []
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError("no run of free ports")


def scrape(url: str) -> tuple[Samples, str]:
    """Every sample of a /metrics page by (name, labels), and the page itself."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, text


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), math.nan)


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def label_values(samples: Samples) -> dict[str, set[str]]:
    """Every label name seen on the page and all its values."""
    seen: dict[str, set[str]] = defaultdict(set)
    for _, labels in samples:
        for key, val in labels:
            seen[key].add(val)
    return seen


def health_status(address: str, service: str = "") -> str:
    """The standard health check on a fresh channel (a channel that failed to connect waits out its reconnect
    backoff, which would hide a coordinator that has just come up)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# -- ports and the island's own numbers (no sockets) -----------------------------------------------------------------


def test_metrics_ports_follow_one_rule(tiny_config: Path) -> None:
    cfg = load_config(tiny_config, ["network.metrics_port=9100"])
    assert metrics_port(cfg) == 9100
    assert [metrics_port(cfg, name) for name in cfg.islands.island_names] == [9101, 9102]
    assert metrics_port(cfg, "island-1", flag=7000) == 7000
    assert metrics_port(load_config(tiny_config, []), "island-0") == 0  # off by default


@pytest.mark.slow
def test_island_metrics_from_runs_and_events(tiny_config: Path, tmp_path: Path) -> None:
    class Run:
        def __init__(self, losses: list[float], tokens: int, seconds: float) -> None:
            self.losses, self.tokens, self.seconds = np.array(losses), tokens, seconds

    clock = iter([10.0, 12.0])
    m = IslandMetrics(clock=lambda: next(clock))
    rd = RunDir(tmp_path / "run", load_config(tiny_config, []))
    try:
        rd.observers.append(m.on_event)
        m.trained(Run([3.0, 2.5], tokens=512, seconds=0.5))
        m.trained(Run([2.0, 1.5], tokens=512, seconds=1.0))  # 1 s of steps in the 2 s since the last run ended
        rd.log("synced", round=4, island="island-0", kind="update")
        rd.log("digest_mismatch", round=4, island="island-0")
    finally:
        rd.close()
    page = scrape_registry(m)
    assert value(page, "diloco_island_loss") == 1.5
    assert value(page, "diloco_island_tokens_per_second") == 512.0
    assert value(page, "diloco_island_compute_utilization") == 0.5
    assert value(page, "diloco_island_inner_step_seconds_count") == 2
    assert value(page, "diloco_island_round") == 4
    assert value(page, "diloco_island_digest_checks_total", result="ok") == 1
    assert value(page, "diloco_island_digest_checks_total", result="mismatch") == 1


def scrape_registry(m: IslandMetrics) -> Samples:
    """The island's page over real HTTP, from prometheus_client's own server."""
    server = serve_metrics(m.registry, "127.0.0.1", free_ports(1))
    assert server is not None
    try:
        return scrape(server.url)[0]
    finally:
        server.stop()


# -- run totals across a coordinator restart -------------------------------------------------------------------------


RUN_TOTALS = (
    ("diloco_islands_joined_total", {}),
    ("diloco_islands_retired_total", {}),
    ("diloco_bytes_up_total", {"island": "island-0"}),
    ("diloco_bytes_up_total", {"island": "island-1"}),
    ("diloco_eval_loss", {}),
    ("diloco_round", {}),
)
"""The metrics that claim a run total (or the newest kept θ's figure): a resumed coordinator restores them."""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_resumed_coordinator_restores_the_run_totals_it_exports(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds committed, bytes received by island, islands joined and retired, the kept θ's eval loss: after a restart
    from the checkpoint they read as before it (from the checkpoint's totals and the records kept), not 0."""
    import diloco.coordinator.settler as settler_module
    from diloco import RELEASE
    from diloco.coordinator.coordinator import Coordinator
    from diloco.run.setup import build_setup
    from transport.chunking import payload_digest

    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)  # no island pulls: each commit is evaluated at once
    cfg = load_config(tiny_config, ["islands.count=3", "islands.names=[island-0,island-1,island-2]"]
                      + ["quorum.min_islands=1", "train.checkpoint_every=1", "outer.aggregate=mean"])  # fmt: skip

    def started() -> Coordinator:
        return Coordinator(cfg, RunDir(tmp_path / "run", cfg), build_setup(cfg, islands=()))

    def totals(coord: Coordinator) -> list[float | None]:
        return [coord.metrics.registry.get_sample_value(name, labels) for name, labels in RUN_TOTALS]

    coord = started()
    try:
        for island in ("island-0", "island-1"):
            coord.join(pb.JoinRequest(run_id=coord.run_id, island=island, last_round=-1, config_digest=coord.digest,
                                      release=RELEASE))  # fmt: skip
        coord.retire(pb.RetireRequest(run_id=coord.run_id, island="island-2", reason="test"), by="operator")
        for round_ in range(2):
            for island, fill in (("island-0", 1e-3), ("island-1", 2e-3)):
                named = {k: np.full(np.shape(v), fill, np.float32) for k, v in flatten_named(coord.loop.params).items()}  # fmt: skip
                tensors = encode_named(named, CodecSpec(kind="fp32"))
                fields = {"run_id": coord.run_id, "island": island, "round": round_, "tokens": 128, "loss": 1.0}
                fields["base_digest"] = bytes.fromhex(coord.world.params_digest)
                assert coord.push(pb.PushMeta(**fields), tensors, named, payload_digest(tensors)).accepted
            assert coord.settled(60) and coord.world.totals.rounds == round_ + 1
        before = totals(coord)
    finally:
        coord.close()
        coord.rd.close()
    assert before[:2] == [2.0, 1.0] and before[2] and before[3] and math.isfinite(before[4]) and before[5] == 2.0
    coord = started()
    try:
        assert coord.loop.round == 2, "the restart resumed from round 2's checkpoint"
        assert totals(coord) == before
    finally:
        coord.close()
        coord.rd.close()


# -- a hostile client cannot grow the label sets ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_thousand_invented_island_names_leave_the_labels_bounded(tiny_config: Path, tmp_path: Path) -> None:
    from diloco.coordinator.coordinator import Coordinator
    from diloco.run.setup import build_setup

    cfg = load_config(tiny_config, ["train.checkpoint_every=0"])
    rd = RunDir(tmp_path / "run", cfg)
    coord = Coordinator(cfg, rd, build_setup(cfg, islands=()))
    # islands=None: invented names get past the transport's name check and reach the coordinator's own checks, the
    # deepest any of them can go; the server still tells `on_call` whatever name the metadata claims.
    service = DilocoService(coord, cfg.run.name, coord.model_spec, on_rejected=coord.on_rejected, islands=None)
    server = start_server(service, on_call=coord.metrics.call)
    metrics = serve_metrics(coord.metrics.registry, "127.0.0.1", free_ports(1))
    assert metrics is not None
    channel = grpc.insecure_channel(server.address)
    try:
        join = channel.stream_unary(
            "/diloco.v1.Diloco/Join",
            request_serializer=pb.JoinRequest.SerializeToString,
            response_deserializer=pb.JoinReply.FromString,
        )
        push = channel.stream_unary(
            "/diloco.v1.Diloco/PushPseudoGrad",
            request_serializer=pb.PushChunk.SerializeToString,
            response_deserializer=pb.PushReply.FromString,
        )
        zeros = {k: np.zeros(np.shape(v), np.float32) for k, v in flatten_named(coord.loop.params).items()}
        tensors = encode_named(zeros, CodecSpec(kind="fp32"))
        for i in range(500):
            name = f"rogue-{i}-" + "x" * (i % 50)
            req = pb.JoinRequest(run_id=cfg.run.name, island=name, config_digest=coord.digest, devices=1)
            with pytest.raises(grpc.RpcError) as refused:
                join(iter([req]), metadata=call_metadata(name, None), timeout=30)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            meta = pb.PushMeta(
                run_id=cfg.run.name,
                island=name,
                round=0,
                tokens=1,
                loss=1.0,
                base_digest=bytes.fromhex(coord.world.params_digest),
            )
            with pytest.raises(grpc.RpcError) as refused:
                push(push_chunks(meta, tensors, 1 << 20), metadata=call_metadata(name, None), timeout=30)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # What else carries a name or a text in: refusals reported with any text, pulls of any kind.
        for i in range(200):
            coord.on_rejected(f"rogue-{i}", f"MADE_UP_{i}: anything at all {i}")
            coord.metrics.pulled(f"rogue-{i}", f"kind-{i}", 10)
        samples, text = scrape(metrics.url)
    finally:
        channel.close()
        server.stop(0)
        metrics.stop()
        coord.close()
        rd.close()

    labels = label_values(samples)
    names = set(cfg.islands.island_names)
    assert labels["island"] <= names | {UNKNOWN}, labels["island"]
    assert labels["reason"] <= CODES | {"other"} and "MADE_UP_0" not in text
    assert labels["method"] <= METHODS
    assert labels["kind"] <= PULL_KINDS | {"other"}
    assert labels["outcome"] <= {"accepted"} | {c.lower() for c in CODES}
    assert "rogue" not in text
    assert len(samples) < 400, len(samples)  # the whole page: a fixed set of series, whatever came in
    assert value(samples, "diloco_pushes_total", island=UNKNOWN, outcome="permission_denied") == 500
    assert value(samples, "diloco_rejected_total", reason="NOT_FOUND") == 500
    assert value(samples, "diloco_rejected_total", reason="other") == 200
    assert value(samples, "diloco_rpc_duration_seconds_count", method="Join") == 500
    assert value(samples, "diloco_bytes_down_total", island=UNKNOWN) == 2000


# -- health and `diloco status` without JAX ----------------------------------------------------------------------------


@contextmanager
def reference_server(on_call: Callable[..., None] | None = None) -> Iterator[tuple[RunningServer, DilocoService]]:
    """A server started without its service (a coordinator restoring its checkpoint), and the service to attach."""
    handler = ReferenceHandler("ops", {"w": np.ones((2, 2), np.float32)})
    service = DilocoService(handler, "ops", handler.model_spec(), islands=("island-0", "island-1"))
    server = start_server(None, config=TransportConfig(), on_call=on_call)
    try:
        yield server, service
    finally:
        server.stop(0)


def test_a_retired_islands_labels_go_with_it() -> None:
    """A label per island ever enrolled would grow under churn: a retired island's series and tally are dropped, and
    a call in its name from then on counts under "unknown"."""
    metrics = CoordinatorMetrics(["a"])

    def labelled(name: str) -> int:
        return sum(
            1
            for family in metrics.registry.collect()
            for sample in family.samples
            if sample.labels.get("island") == name
        )

    for cycle in range(3):
        name = f"x{cycle}"
        metrics.enroll(name)
        metrics.on_event("push", {"island": name, "bytes_up": 10})
        metrics.pulled(name, "update", 20)
        metrics.call("PushPseudoGrad", name, grpc.StatusCode.OK, 0.01)
        assert labelled(name) > 0 and name in metrics.tally
        metrics.retire(name)
        assert labelled(name) == 0 and name not in metrics.tally and metrics.island(name) == UNKNOWN
    metrics.on_event("push", {"island": "a", "bytes_up": 1})
    assert labelled("a") > 0 and metrics.islands == ("a", UNKNOWN)


def test_status_names_the_newest_retired_and_counts_them_all() -> None:
    """The Status answer lists a bounded tail of the retired (diloco/coordinator/enrollment.py): the view shows the
    newest and how many were retired in all, not only those listed."""
    from rich.console import Console

    listed = {f"x{i}": {"round": i, "reason": "churn"} for i in range(32)}
    detail = {"roster": {"admitted": [], "retired": listed, "retired_total": 1000}}
    console = Console(width=400, record=True)
    console.print(status_view(pb.StatusReply(run_id="r", round=3, state="training"), detail, "SERVING"))
    line = next(x for x in console.export_text().splitlines() if x.startswith("retired:"))
    assert "x31 (round 31: churn)" in line and "x0 " not in line and line.endswith("and 992 more"), line


def test_health_is_not_serving_until_the_service_is_attached(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[str, str, grpc.StatusCode]] = []
    with reference_server(lambda method, island, code, s: calls.append((method, island, code))) as (server, service):
        for name in ("", "diloco.v1.Diloco"):
            assert health_status(server.address, name) == "NOT_SERVING"
        client = GrpcTransport(server.address, "island-0", config=TransportConfig(max_attempts=1, rpc_timeout_s=5))
        with client, pytest.raises(Exception) as starting:
            client.join(pb.JoinRequest(run_id="ops", island="island-0"))
        assert "UNAVAILABLE" in str(starting.value) and "starting" in str(starting.value)
        assert show_status(server.address) == 1
        assert "health NOT_SERVING" in capsys.readouterr().out

        server.attach(service)
        assert health_status(server.address) == "SERVING"
        with GrpcTransport(server.address, "island-0", config=TransportConfig(max_attempts=1)) as client:
            client.join(pb.JoinRequest(run_id="ops", island="island-0"))
            assert client.health() == "SERVING"
        assert show_status(server.address) == 0
        out = capsys.readouterr().out
        assert "health SERVING" in out and "island-0" in out

        with grpc.insecure_channel(server.address) as channel:  # Watch would hold a thread: refused
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
            with pytest.raises(grpc.RpcError) as refused:
                next(watch)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert ("Join", "island-0", grpc.StatusCode.UNAVAILABLE) in calls and (
        "Join",
        "island-0",
        grpc.StatusCode.OK,
    ) in calls


def test_status_watch_redraws_until_ctrl_c(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with reference_server() as (server, service):
        server.attach(service)
        with GrpcTransport(server.address, "island-1", config=TransportConfig(max_attempts=1)) as client:
            client.join(pb.JoinRequest(run_id="ops", island="island-1"))
        frames = []

        def sleep(seconds: float) -> None:
            frames.append(seconds)
            if len(frames) == 3:
                raise KeyboardInterrupt

        monkeypatch.setattr("diloco.ops.status._pause", sleep)
        assert show_status(server.address, watch=True) == 0
    assert len(frames) == 3 and frames[0] == 2.0
    out = capsys.readouterr().out
    assert "island-1" in out and "health SERVING" in out


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_status_watch_ends_on_sigint_with_exit_code_0() -> None:
    statuses = threading.Semaphore(0)
    with reference_server(lambda method, *_: statuses.release() if method == "Status" else None) as (server, service):
        server.attach(service)
        proc = subprocess.Popen(
            [sys.executable, "-m", "diloco.cli", "status", server.address, "--watch"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=REPO,
        )
        try:
            # A second Status call: the watch drew its first frame and is in its loop.
            assert statuses.acquire(timeout=60) and statuses.acquire(timeout=60), "the watch never asked twice"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


# -- a real federation: numbers that move, health across a coordinator restart ---------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_metrics_move_during_a_run_and_health_flips_across_a_restart(tiny_config: Path, tmp_path: Path) -> None:
    base = free_ports(3)
    overrides = [*FAST, "train.rounds=8", "quorum.min_islands=2", f"network.metrics_port={base}"]
    fed = Federation(tiny_config, overrides, tmp_path / "fed", cwd=REPO, env=ENV, jax_cache=JAX_CACHE)
    coordinator_url = f"http://127.0.0.1:{base}/metrics"
    island_url = f"http://127.0.0.1:{base + 1}/metrics"  # island-0: P + 1 + 0

    def both() -> tuple[Samples, Samples] | None:
        try:
            return scrape(coordinator_url)[0], scrape(island_url)[0]
        except OSError:  # not listening yet
            return None

    def at_round(n: int) -> tuple[Samples, Samples] | None:
        pages = both()
        ok = pages is not None and value(pages[0], "diloco_round") >= n and value(pages[1], "diloco_island_round") >= n
        return pages if ok else None

    with fed:
        fed.start()
        first_c, first_i = fed.wait_for(lambda: at_round(1), WAIT_S, "round 1 on both /metrics pages", poll_s=0.2)

        def moved() -> tuple[Samples, Samples] | None:
            pages = at_round(value(first_c, "diloco_round") + 1)
            if pages is None or value(pages[0], "diloco_eval_loss") == value(first_c, "diloco_eval_loss"):
                return None
            return pages if value(pages[1], "diloco_island_loss") != value(first_i, "diloco_island_loss") else None

        second_c, second_i = fed.wait_for(moved, WAIT_S, "a later round, eval and island loss on both pages", 0.2)
        assert value(second_c, "diloco_round") > value(first_c, "diloco_round")
        assert total(second_c, "diloco_bytes_up_total") > total(first_c, "diloco_bytes_up_total") > 0
        assert total(second_c, "diloco_bytes_down_total") > total(first_c, "diloco_bytes_down_total")
        assert value(second_c, "diloco_islands_alive") == 2
        assert value(second_c, "diloco_eval_loss") != value(first_c, "diloco_eval_loss")
        assert math.isfinite(value(second_c, "diloco_eval_loss"))
        assert value(second_c, "diloco_round_duration_seconds_count") >= 1
        assert value(second_c, "diloco_pushes_total", island="island-0", outcome="accepted") >= 1
        assert label_values(second_c)["island"] <= {"island-0", "island-1"}
        assert value(second_i, "diloco_island_round") > value(first_i, "diloco_island_round")
        assert value(second_i, "diloco_island_loss") != value(first_i, "diloco_island_loss")
        assert math.isfinite(value(second_i, "diloco_island_loss"))
        assert value(second_i, "diloco_island_digest_checks_total", result="ok") > value(
            first_i, "diloco_island_digest_checks_total", result="ok"
        )
        assert value(second_i, "diloco_island_tokens_per_second") > 0

        # Kill the coordinator; its restart listens at once and says NOT_SERVING while it restores its checkpoint.
        fed.kill("coordinator")
        seen: list[str] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                status = health_status(fed.address)
                if not seen or seen[-1] != status:
                    seen.append(status)
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            fed.start_coordinator()  # returns once coordinator.addr is written: after it attached its service
            fed.wait_for(lambda: seen and seen[-1] == "SERVING", WAIT_S, "health SERVING after the restart")
        finally:
            stop.set()
            poller.join(timeout=10)
        assert "NOT_SERVING" in seen and seen.index("NOT_SERVING") < seen.index("SERVING"), seen
        restored = fed.wait_for(lambda: both(), WAIT_S, "the restarted coordinator's /metrics")[0]
        assert value(restored, "diloco_round") >= value(first_c, "diloco_round")
        fed.wait_done(WAIT_S * 2)
