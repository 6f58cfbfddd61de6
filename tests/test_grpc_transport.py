"""Transport behaviour over a live gRPC server on 127.0.0.1:0 and over the in-process transport.

Both run the same tests (parametrized) because both must apply the same checks: validation before state,
idempotent pushes, retries of retryable codes only, link shaping and LinkDown -> UNAVAILABLE -> retry.
"""

import time

import grpc
import numpy as np
import pytest

from floor.codec import CodecSpec, decode
from pytrees.encode import encode
from tests.reference_handler import ReferenceHandler, fp32_tensor, params_digest
from tests.wire_helpers import push_chunks
from transport import diloco_pb2 as pb
from transport import diloco_pb2_grpc as pb_grpc
from transport.auth import Authenticator, call_metadata
from transport.config import TransportConfig, TransportConfigError
from transport.errors import TransportError
from transport.grpc_client import GrpcTransport
from transport.grpc_server import start_server
from transport.inprocess import InProcessTransport
from transport.service import DilocoService
from transport.shaper import LinkProfile, LinkShaper

RUN = "run-t"
SECRETS = {"i0": "s0", "i1": "s1"}
PARAMS = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros(70_000, np.float32)}
FAST = TransportConfig(chunk_bytes=64 * 1024, backoff_initial_s=0.0, backoff_max_s=0.0, max_attempts=3)


class Env:
    def __init__(self, kind: str, config: TransportConfig = FAST):
        self.kind = kind
        self.config = config
        self.handler = ReferenceHandler(RUN, PARAMS)
        self.rejections: list[tuple[str, str]] = []
        self.service = DilocoService(
            self.handler,
            RUN,
            self.handler.model_spec(),
            authenticator=Authenticator(SECRETS),
            config=config,
            on_rejected=lambda island, reason: self.rejections.append((island, reason)),
        )
        self.server = start_server(self.service) if kind == "grpc" else None
        self.clients = []

    def client(self, island="i0", secret=None, **kw):
        secret = SECRETS[island] if secret is None else secret
        kw.setdefault("config", self.config)
        if self.kind == "grpc":
            c = GrpcTransport(self.server.address, island, secret, **kw)
        else:
            c = InProcessTransport(self.service, island, secret, **kw)
        self.clients.append(c)
        return c

    def close(self):
        for c in self.clients:
            c.close()
        if self.server is not None:
            self.server.stop(0)


@pytest.fixture(params=["grpc", "inprocess"])
def env(request):
    e = Env(request.param)
    yield e
    e.close()


def delta(value=0.25, codec="int8"):
    return [encode(k, np.full(v.shape, value, np.float32), CodecSpec(codec)) for k, v in sorted(PARAMS.items())]


def meta(island="i0", round_=0, **kw):
    return pb.PushMeta(run_id=RUN, island=island, round=round_, fragment=0, tokens=kw.pop("tokens", 1000), **kw)


def test_both_clients_are_island_clients(env):
    from transport.client import IN_PROCESS_TARGET, IslandClient

    c = env.client()
    assert isinstance(c, IslandClient)
    assert c.target == (env.server.address if env.kind == "grpc" else IN_PROCESS_TARGET)


def test_call_once_is_the_one_failure_mapping():
    from transport.client_core import call_once
    from transport.errors import Rejected
    from transport.shaper import LinkDown

    def failing(exc):
        def fn():
            raise exc

        return fn

    cases = [
        (LinkDown("cut"), grpc.StatusCode.UNAVAILABLE, "link down: cut"),
        (Rejected(grpc.StatusCode.INVALID_ARGUMENT, "bad shape"), grpc.StatusCode.INVALID_ARGUMENT, "bad shape"),
        (grpc.RpcError("no status"), grpc.StatusCode.UNKNOWN, "no status"),
    ]
    for exc, code, reason in cases:
        with pytest.raises(TransportError) as info:
            call_once(None, failing(exc))
        assert (info.value.code, info.value.reason) == (code, reason)
    assert call_once(None, lambda: 7) == 7


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(TransportError) as info:
        fn()
    return info.value.code


def test_unary_rpcs(env):
    c = env.client()
    reply = c.join(pb.JoinRequest(run_id=RUN, island="i0", last_round=-1))
    assert reply.needs_full_params and reply.round == 0
    assert c.heartbeat(pb.HeartbeatRequest(run_id=RUN, island="i0")).state == "training"
    assert [i.name for i in c.status().islands] == ["i0"]
    assert c.leave(pb.LeaveRequest(run_id=RUN, island="i0")).ok
    assert c.status().islands == []
    assert code_of(lambda: c.join(pb.JoinRequest(run_id="other", island="i0"))) == (grpc.StatusCode.FAILED_PRECONDITION)


def test_push_then_pull_round_trip(env):
    c = env.client()
    reply = c.push(meta(), delta(0.25))
    assert reply.accepted and len(reply.digest) == 32
    np.testing.assert_allclose(env.handler.params["b"], -0.25, rtol=1e-2)
    pulled = c.pull(pb.PullRequest(run_id=RUN, island="i0", have_round=-1))
    assert pulled.kind == "full" and pulled.round == 0
    got = {t.name: decode(t) for t in pulled.tensors}
    assert params_digest(got) == pulled.param_digest == params_digest(env.handler.params)


def test_duplicate_push_is_applied_once(env):
    c = env.client()
    first = c.push(meta(), delta(0.5))
    again = c.push(meta(), delta(0.5))  # e.g. a retry after the reply was lost
    assert again == first
    assert env.handler.applied == [("i0", 0, 0, 1000)]
    assert code_of(lambda: c.push(meta(), delta(0.75))) == grpc.StatusCode.ALREADY_EXISTS
    assert len(env.handler.applied) == 1
    env.handler.round = 1  # a duplicate still gets its reply after the round moved on
    assert c.push(meta(), delta(0.5)) == first


def test_rejections_never_touch_state(env):
    c = env.client()
    before = env.handler.state_digest()
    nan = delta(0.1, "fp32")
    arr = np.full(PARAMS["b"].shape, 0.1, np.float32)
    arr[5] = np.nan
    nan[0] = fp32_tensor("b", arr)
    bad_shape = [fp32_tensor("b", np.zeros(10, np.float32)), fp32_tensor("w", np.zeros((3, 4), np.float32))]
    missing = [fp32_tensor("w", np.zeros((3, 4), np.float32))]
    cases = [
        (lambda: c.push(meta(), nan), grpc.StatusCode.INVALID_ARGUMENT, "finite"),
        (lambda: c.push(meta(), bad_shape), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        (lambda: c.push(meta(), missing), grpc.StatusCode.INVALID_ARGUMENT, "missing tensors"),
        (lambda: c.push(meta(round_=1), delta()), grpc.StatusCode.FAILED_PRECONDITION, "future"),
        (lambda: c.push(meta(tokens=0), delta()), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
        (lambda: c.push(meta(island="i1"), delta()), grpc.StatusCode.PERMISSION_DENIED, "cannot act"),
    ]
    for fn, code, words in cases:
        with pytest.raises(TransportError) as info:
            fn()
        assert info.value.code == code and words in info.value.reason
        assert info.value.attempts == 1, "non-retryable codes must not be retried"
    env.handler.round = 2
    assert code_of(lambda: c.push(meta(round_=1), delta())) == grpc.StatusCode.FAILED_PRECONDITION
    env.handler.round = 0
    assert env.handler.state_digest() == before
    assert len(env.rejections) == len(cases) + 1
    assert all(island == "i0" for island, _ in env.rejections)


def test_oversized_payload_is_resource_exhausted(env):
    small = TransportConfig(chunk_bytes=64 * 1024, max_payload_mb=0.1, max_attempts=1)
    env.service.config = small
    before = env.handler.state_digest()
    c = env.client(config=FAST)
    with pytest.raises(TransportError) as info:
        c.push(meta(), delta(codec="fp32"))  # 280 KB > 0.1 MiB
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "exceeds the maximum" in info.value.reason
    assert env.handler.state_digest() == before


def test_shaped_push_takes_link_time_and_linkdown_is_retried(env):
    profile = LinkProfile(up_mbps=20.0, down_mbps=20.0)
    shaper = LinkShaper(profile, seed=1)
    c = env.client(shaper=shaper)
    payload = delta(0.1, "fp32")  # ~280 KB -> ~0.11 s at 20 Mbit/s
    t0 = time.monotonic()
    c.push(meta(), payload)
    assert time.monotonic() - t0 >= 0.9 * 280_048 * 8 / 20e6 - 0.07  # 64 KiB bucket may go early
    assert shaper.bytes_sent["up"] == sum(len(t.payload) for t in payload)

    sleeps: list[float] = []

    def heal(s):  # the link comes back while the client backs off
        sleeps.append(s)
        shaper.set_partitioned(False)

    c2 = env.client("i1", shaper=shaper, sleep=heal)
    shaper.set_partitioned(True)
    assert c2.push(meta("i1"), payload).accepted
    assert len(sleeps) == 1
    shaper.set_partitioned(True)
    c3 = env.client("i1", shaper=shaper, sleep=sleeps.append)
    with pytest.raises(TransportError) as info:
        c3.heartbeat(pb.HeartbeatRequest(run_id=RUN, island="i1"))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.attempts == FAST.max_attempts


def test_a_shaped_rpc_pays_a_round_trip_and_a_lost_reply_is_retried(env):
    """Every RPC pays the request's latency up and its reply's down (one RTT, transport.client_core.call_once); a
    reply lost on its way back makes the call UNAVAILABLE, and the push retried then gets the same reply without
    being applied twice."""
    from transport.shaper import LinkDown

    class Recording:
        def __init__(self, lose_reply: bool = False):
            self.messages: list[str] = []
            self.lose_reply = lose_reply

        def start_message(self, direction):
            self.messages.append(direction)
            if direction == "down" and self.lose_reply:
                self.lose_reply = False
                raise LinkDown("reply lost")

        def transmit(self, nbytes, direction):
            pass

    rec = Recording()
    c = env.client(shaper=rec)
    c.heartbeat(pb.HeartbeatRequest(run_id=RUN, island="i0"))
    c.pull(pb.PullRequest(run_id=RUN, island="i0", have_round=-1))
    assert rec.messages == ["up", "down", "up", "down"]
    # A pull sent right behind a push rides with the push's bytes: its request pays no latency of its own.
    rec.messages.clear()
    c.pull(pb.PullRequest(run_id=RUN, island="i0", have_round=-1, after_push=True))
    assert rec.messages == ["down"]

    lossy = Recording(lose_reply=True)
    sleeps: list[float] = []
    first = env.client("i1", shaper=lossy, sleep=sleeps.append).push(meta("i1"), delta(0.5, "fp32"))
    assert first.accepted and len(sleeps) == 1 and lossy.messages == ["up", "down", "up", "down"]
    assert env.handler.applied == [("i1", 0, 0, 1000)], "the push whose reply was lost is applied once"

    timed = LinkShaper(LinkProfile(up_mbps=0, down_mbps=0, latency_ms=60.0), seed=1)
    t0 = time.monotonic()
    env.client(shaper=timed).heartbeat(pb.HeartbeatRequest(run_id=RUN, island="i0"))
    assert time.monotonic() - t0 >= 2 * 0.060 * 0.99  # no jitter: exactly two one-way latencies, at least


def test_on_sent_is_told_once_the_last_chunk_is_on_the_wire(env):
    """`IslandClient.push(..., on_sent)`: the island's cue to ask for the commit without waiting for the reply."""
    sent_after: list[int] = []

    class Counting:
        chunks = 0

        def start_message(self, direction):
            pass

        def transmit(self, nbytes, direction):
            Counting.chunks += 1

    config = TransportConfig(chunk_bytes=64 * 1024, max_attempts=2, backoff_initial_s=0.01, rpc_timeout_s=10)
    c = env.client(shaper=Counting(), config=config)
    assert c.push(meta(), delta(0.5, "fp32"), on_sent=lambda: sent_after.append(Counting.chunks)).accepted
    assert Counting.chunks > 1 and sent_after == [Counting.chunks], "told once, after the last of several chunks"


def test_linkdown_mid_stream_is_retried_and_applied_once(env):
    class FlakyShaper:
        """Goes down after a few chunks on the first attempt only."""

        def __init__(self):
            self.chunks = 0

        def start_message(self, direction):
            pass

        def transmit(self, nbytes, direction):
            from transport.shaper import LinkDown

            self.chunks += 1
            if self.chunks == 3:
                raise LinkDown("test outage")

    c = env.client(shaper=FlakyShaper())
    assert c.push(meta(), delta(0.5, "fp32")).accepted
    assert env.handler.applied == [("i0", 0, 0, 1000)]
    assert env.rejections == [], "a link failure is not a rejected message"


def test_concurrent_duplicates_are_applied_once(env):
    from concurrent.futures import ThreadPoolExecutor

    payload = delta(0.5, "fp32")
    clients = [env.client() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda c: c.push(meta(), payload), clients))
    assert all(r.accepted for r in replies) and len({r.SerializeToString() for r in replies}) == 1
    assert env.handler.applied == [("i0", 0, 0, 1000)]


def test_server_down_is_unavailable_after_retries():
    e = Env("grpc")
    address = e.server.address
    e.close()
    sleeps: list[float] = []
    cfg = TransportConfig(max_attempts=4, backoff_initial_s=0.01, backoff_max_s=0.05, rpc_timeout_s=2)
    c = GrpcTransport(address, "i0", "s0", config=cfg, sleep=sleeps.append)
    with pytest.raises(TransportError) as info:
        c.status()
    c.close()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.attempts == 4
    assert len(sleeps) == 3 and all(0 <= s <= 0.05 for s in sleeps)


def test_raw_stream_faults_and_message_limit():
    e = Env("grpc")
    try:
        channel = grpc.insecure_channel(e.server.address, options=FAST.grpc_options())
        stub = pb_grpc.DilocoStub(channel)
        md = call_metadata("i0", "s0")
        chunks = list(push_chunks(meta(), delta(0.5, "fp32"), 64 * 1024))
        assert len(chunks) == 5
        for bad in (
            [],
            chunks[1:],
            chunks[:-1],
            [chunks[0], chunks[2], chunks[1], *chunks[3:]],
            chunks + chunks,
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.PushPseudoGrad(iter(bad), metadata=md, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A single message above grpc.max_receive_message_length is refused by gRPC itself.
        huge = pb.PushChunk(index=0, meta=meta(), header=chunks[0].header, data=b"\0" * (5 * 1024 * 1024))
        raw = grpc.insecure_channel(e.server.address, options=[("grpc.max_send_message_length", 64 << 20)])
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.DilocoStub(raw).PushPseudoGrad(iter([huge]), metadata=md, timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.handler.applied == []
        raw.close()
        channel.close()
    finally:
        e.close()


def test_config_validation_names_the_key():
    with pytest.raises(TransportConfigError, match="transport.max_attempts"):
        TransportConfig(max_attempts=0)
    with pytest.raises(TransportConfigError, match="transport.max_message_bytes"):
        TransportConfig(chunk_bytes=4 << 20, max_message_bytes=4 << 20)
    assert ("grpc.max_receive_message_length", 4 << 20) in TransportConfig().grpc_options()
    for bad, key in (
        ({"max_streams": 4, "max_streams_per_island": 5}, "max_streams_per_island"),
        ({"max_unary_calls_per_island": 0}, "max_unary_calls_per_island"),
        ({"max_payload_mb": 100, "max_buffered_mb": 99}, "max_buffered_mb"),
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"keepalive_timeout_s": 0}, "keepalive_timeout_s"),
        ({"keepalive_s": -1}, "keepalive_s"),
        ({"max_presence_streams": 0}, "max_presence_streams"),
        ({"max_streams": 300}, "max_pending_calls"),  # fewer pending calls than threads: a slot never usable
    ):
        with pytest.raises(TransportConfigError, match=f"transport.{key} "):
            TransportConfig(**bad)
    assert TransportConfig().server_threads == 16 + 16 + 16 + 2  # streams, unary calls, presence calls, spares
    options = dict(TransportConfig(keepalive_s=1.5, keepalive_timeout_s=2.5).server_options())
    assert options["grpc.keepalive_time_ms"] == 1500 and options["grpc.http2.ping_timeout_ms"] == 2500
    assert TransportConfig().server_options() == TransportConfig().grpc_options()  # keepalive is off by default


@pytest.mark.parametrize(
    ("islands", "fragments", "streams", "per_island"),
    [
        (3, 1, 16, 4),  # plain rounds: one push and one pull an island, with room for a retry; the defaults hold
        (3, 5, 30, 12),  # Streaming DiLoCo, P = 5: a push and a pull per fragment at once, and a retry
        (1, 8, 18, 18),  # the server as a whole holds at least what one island may
        (20, 1, 40, 4),  # many islands: two streams each
    ],
)
def test_for_islands_makes_room_for_every_honest_islands_streams(islands, fragments, streams, per_island):
    cfg = TransportConfig().for_islands(islands, fragments)
    assert (cfg.max_streams, cfg.max_streams_per_island) == (streams, per_island)
    assert cfg.max_pending_calls >= cfg.server_threads  # a valid config: every thread's call can be queued


@pytest.mark.slow
@pytest.mark.multiprocess
def test_transport_bench_small():
    from diloco.bench.transport import run_transport_bench

    r = run_transport_bench(payload_mb=8, shaped_mbps=40.0, shaped_mb=1, rss_payload_mb=8, tensor_mb=1)
    assert r["unshaped_gbps"] > 0 and 0.5 < r["shaped_fraction"] < 1.2
    assert r["rss_before_mb"] < r["peak_rss_mb"]
    assert set(r["targets_met"]) == {"unshaped_gbps>=0.4", "shaped_fraction>=0.9", "peak_rss<=2x+200MB"}
    with pytest.raises(ValueError, match="payload_mb must be > 0"):
        run_transport_bench(payload_mb=0)


def test_round_window_and_fragment_specs():
    from transport.errors import Rejected
    from transport.validate import check_round, spec_for

    check_round(5, 5)
    check_round(4, 5, max_staleness=1)  # async mode: one round late is still accepted
    for round_, staleness, words in ((4, 0, "stale"), (3, 1, "stale"), (6, 3, "future")):
        with pytest.raises(Rejected, match=words) as info:
            check_round(round_, 5, staleness)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    specs = [{"a": ((2,), "float32")}, {"b": ((3,), "float32")}]
    assert spec_for(specs.__getitem__, 1) == specs[1]
    with pytest.raises(Rejected, match="unknown fragment 7"):
        spec_for(specs.__getitem__, 7)


def test_status_can_require_credentials():
    e = Env("inprocess")
    e.service.status_requires_auth = True
    assert e.client().status().run_id == RUN
    assert code_of(lambda: e.client(secret="nope").status()) == grpc.StatusCode.UNAUTHENTICATED
    e.service.status_requires_auth = False
    assert e.client(secret="nope").status().run_id == RUN
