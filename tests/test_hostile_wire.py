"""A hostile client against a real gRPC server: it can neither starve the server nor grow it, and every refusal
is a status with a reason, counted once.

Each limit of transport/admission.py, transport/watchdog.py and the byte budget is driven to its edge by raw
calls that do what no honest island does (open streams and send nothing, trickle, declare huge sizes, send
bytes that are not protobuf, invent island names, lie in the push metadata). No assertion here depends on how
fast the machine is: waits are bounded by generous client deadlines, never measured.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import struct
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
import pytest

from diloco.harness.procs import wait_until
from floor.codec import CodecSpec, EncodedTensor, decode, raw_payload_nbytes
from pytrees.encode import encode
from tests.reference_handler import ReferenceHandler, fp32_tensor
from tests.wire_helpers import push_chunks
from transport import chunking
from transport import diloco_pb2 as pb
from transport.auth import Authenticator, call_metadata
from transport.config import TransportConfig
from transport.errors import TransportError
from transport.grpc_client import GrpcTransport
from transport.grpc_server import RunningServer, start_server
from transport.service import DilocoService
from transport.watchdog import Watchdog

pytestmark = pytest.mark.timeout(120)

RUN = "hostile"
SECRETS = {"i0": "s0", "i1": "s1"}
PARAMS = {"w": np.ones((4, 4), np.float32), "b": np.ones(8, np.float32)}
PUSH = "/diloco.v1.Diloco/PushPseudoGrad"
CLIENT = TransportConfig(max_attempts=1, rpc_timeout_s=30)
DEADLINE_S = 60.0  # what a hostile client's calls may take at most here (its own deadline, never reached)


class Server:
    """A live server around the reference handler, recording every `on_rejected` call."""

    def __init__(self, config: TransportConfig, secrets: dict[str, str] | None = SECRETS, **service: Any) -> None:
        self.handler = ReferenceHandler(RUN, PARAMS)
        self.rejections: list[tuple[str, str]] = []
        service.setdefault("islands", SECRETS)
        self.service = DilocoService(
            self.handler,
            RUN,
            self.handler.model_spec(),
            authenticator=Authenticator(secrets),
            config=config,
            on_rejected=lambda island, reason: self.rejections.append((island, reason)),
            **service,
        )
        self.server: RunningServer = start_server(self.service)
        self.channel = grpc.insecure_channel(self.server.address, options=config.grpc_options())
        self._release = threading.Event()
        self._clients: list[GrpcTransport] = []

    def raw(self, method: str, response: Any = None) -> grpc.StreamUnaryMultiCallable:
        """A call to ``method`` that sends whatever request stream it is given, as bytes or messages."""
        return self.channel.stream_unary(
            method,
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=response.FromString if response is not None else None,
        )

    def stalled(self, *sent: Any) -> Iterator[Any]:
        """A request stream that sends ``sent`` and then nothing, until the test ends."""
        yield from sent
        self._release.wait()

    def client(self, island: str = "i0", secret: str | None = None) -> GrpcTransport:
        c = GrpcTransport(self.server.address, island, SECRETS.get(island) if secret is None else secret, config=CLIENT)
        self._clients.append(c)
        return c

    def reasons(self, code: grpc.StatusCode) -> list[str]:
        return [reason for _, reason in self.rejections if reason.startswith(f"{code.name}: ")]

    def close(self) -> None:
        self._release.set()
        for c in self._clients:
            c.close()
        self.channel.close()
        self.server.stop(0)


@contextmanager
def serving(config: TransportConfig, **kw: Any) -> Iterator[Server]:
    s = Server(config, **kw)
    try:
        yield s
    finally:
        s.close()


def meta(island: str = "i0", **kw: Any) -> pb.PushMeta:
    return pb.PushMeta(**{"run_id": RUN, "island": island, "round": 0, "fragment": 0, "tokens": 100, **kw})


def delta(value: float = 0.25) -> list:
    return [fp32_tensor(k, np.full(v.shape, value, np.float32)) for k, v in sorted(PARAMS.items())]


def code_of(future: grpc.Future) -> grpc.StatusCode:
    return future.exception(timeout=DEADLINE_S).code()


# -- admission: idle calls never starve heartbeats and Status --------------------------------------------------------


def test_idle_push_streams_do_not_block_heartbeat_or_status():
    config = TransportConfig(first_message_timeout_s=600, idle_timeout_s=600)
    names = {f"x{i}": "" for i in range(64)} | SECRETS
    with serving(config, secrets=None, islands=names) as s:
        raw = s.raw(PUSH, pb.PushReply)
        calls = [raw.future(s.stalled(), metadata=call_metadata(f"x{i}", None), timeout=DEADLINE_S) for i in range(64)]
        wait_until(lambda: sum(c.done() for c in calls) == 64 - config.max_streams, "the refusals", DEADLINE_S)
        assert s.server.admission.in_use("stream") == config.max_streams
        assert {code_of(c) for c in calls if c.done()} == {grpc.StatusCode.UNAVAILABLE}
        c = s.client("i0")
        assert c.heartbeat(pb.HeartbeatRequest(run_id=RUN, island="i0")).state == "training"
        assert c.status().run_id == RUN
        assert len(s.reasons(grpc.StatusCode.UNAVAILABLE)) == 64 - config.max_streams


def test_calls_that_never_send_their_request_hold_only_their_islands_slots():
    config = TransportConfig(first_message_timeout_s=600)
    with serving(config) as s:
        raw = s.raw("/diloco.v1.Diloco/Heartbeat", pb.HeartbeatReply)
        md = call_metadata("i1", "s1")  # a compromised island: valid credentials, hostile client
        calls = [raw.future(s.stalled(), metadata=md, timeout=DEADLINE_S) for _ in range(32)]
        wait_until(
            lambda: sum(c.done() for c in calls) == 32 - config.max_unary_calls_per_island, "the refusals", DEADLINE_S
        )
        assert s.server.admission.in_use("unary") == config.max_unary_calls_per_island
        assert {code_of(c) for c in calls if c.done()} == {grpc.StatusCode.UNAVAILABLE}
        assert s.client("i0").heartbeat(pb.HeartbeatRequest(run_id=RUN, island="i0")).round == 0


def test_without_credentials_nothing_is_held():
    with serving(TransportConfig(first_message_timeout_s=600)) as s:
        raw = s.raw(PUSH, pb.PushReply)
        calls = [raw.future(s.stalled(), metadata=call_metadata("i0", "wrong"), timeout=DEADLINE_S) for _ in range(40)]
        assert {code_of(c) for c in calls} == {grpc.StatusCode.UNAUTHENTICATED}
        assert s.server.admission.in_use("stream") == 0


# -- timeouts: a quiet client is cancelled and what it held is freed ------------------------------------------------


def _expired(s: Server, call: grpc.Future, words: str, lane: str = "stream") -> None:
    assert code_of(call) == grpc.StatusCode.CANCELLED
    wait_until(lambda: s.server.admission.in_use(lane) == 0, "the slot to come back", DEADLINE_S)
    assert s.service.budget.used == 0
    reasons = s.reasons(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert len(reasons) == 1 and words in reasons[0], s.rejections
    assert len(s.rejections) == 1, "an expired stream is reported once"


@pytest.mark.parametrize("method, lane", [(PUSH, "stream"), ("/diloco.v1.Diloco/Join", "unary")])
@pytest.mark.slow
def test_first_message_timeout_cancels_a_silent_call(method, lane):
    with serving(TransportConfig(first_message_timeout_s=0.3)) as s:
        call = s.raw(method).future(s.stalled(), metadata=call_metadata("i0", "s0"), timeout=DEADLINE_S)
        _expired(s, call, "within 0.3 s of the call", lane)


def test_idle_timeout_cancels_a_stream_that_stops_and_frees_its_buffer():
    with serving(TransportConfig(idle_timeout_s=0.3, chunk_bytes=1024)) as s:
        chunks = list(push_chunks(meta(), delta(), 32))  # 96 payload bytes in 3 chunks; only the first is sent
        call = s.raw(PUSH, pb.PushReply).future(
            s.stalled(chunks[0]), metadata=call_metadata("i0", "s0"), timeout=DEADLINE_S
        )
        _expired(s, call, "for 0.3 s")
        assert s.handler.applied == []


def test_a_trickling_stream_is_cut_by_the_progress_deadline():
    config = TransportConfig(idle_timeout_s=600, rpc_timeout_s=0.3, min_bandwidth_mbps=1e4)
    with serving(config) as s:
        chunks = list(push_chunks(meta(), delta(), 1))  # one byte a chunk

        def trickle() -> Iterator[pb.PushChunk]:
            for c in chunks:
                yield c
                if s._release.wait(0.05):
                    return

        call = s.raw(PUSH, pb.PushReply).future(trickle(), metadata=call_metadata("i0", "s0"), timeout=DEADLINE_S)
        _expired(s, call, "fell below")


@pytest.mark.slow
def test_a_pull_the_client_does_not_read_is_cancelled():
    big = {"w": np.ones(4 << 20, np.float32)}  # 16 MiB: far more than the flow-control windows hold
    config = TransportConfig(idle_timeout_s=0.5)
    with serving(config) as s:
        s.handler.params = dict(big)
        # A client whose receive window never grows past the initial 64 KiB unless the application reads.
        reader = grpc.insecure_channel(s.server.address, options=[("grpc.http2.bdp_probe", 0)])
        call = reader.unary_stream("/diloco.v1.Diloco/PullGlobal")(
            pb.PullRequest(run_id=RUN, island="i0", have_round=-1).SerializeToString(),
            metadata=call_metadata("i0", "s0"),
            timeout=DEADLINE_S,
        )
        next(call)  # the first chunk; then the client stops reading
        wait_until(lambda: s.server.admission.in_use("stream") == 0, "the pull to be cancelled", DEADLINE_S)
        reasons = s.reasons(grpc.StatusCode.DEADLINE_EXCEEDED)
        assert len(reasons) == 1 and "the client took no message" in reasons[0]
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        reader.close()


def test_watchdog_fires_only_armed_deadlines():
    dog = Watchdog()
    fired: list[str] = []
    done = threading.Event()
    try:
        quiet = dog.watch(lambda: None, lambda why: (fired.append(why), done.set()))
        calm = dog.watch(lambda: None, fired.append)
        calm.arm(600, "never")
        calm.disarm()
        quiet.arm(0.05, "quiet")
        assert done.wait(DEADLINE_S)
        assert fired == ["quiet"] and dog.armed() == 0
    finally:
        dog.close()


# -- memory: sizes are checked before anything is allocated; rejected streams leave nothing -------------------------


class Buffers:
    """Every receive buffer the server maps (address, size, weak reference), to see what a stream really holds.

    The process's total RSS would tell little: it also moves with glibc's heap, which keeps the freed 1 MiB
    message buffers of gRPC for reuse. Resident pages are counted from /proc/self/pagemap (bit 63: present)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.maps: list[tuple[int, int, weakref.ref]] = []
        fresh = chunking._fresh

        def recording(nbytes: int) -> Any:
            buf = fresh(nbytes)
            if isinstance(buf, mmap.mmap):
                view = ctypes.c_char.from_buffer(buf)
                self.maps.append((ctypes.addressof(view), nbytes, weakref.ref(buf)))
                del view
            return buf

        monkeypatch.setattr(chunking, "_fresh", recording)

    @staticmethod
    def resident(address: int, nbytes: int) -> int:
        pages = -(-nbytes // 4096)
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // 4096 * 8)
            entries = f.read(8 * pages)
        return 4096 * sum(e >> 63 for e in struct.unpack(f"<{pages}Q", entries))

    def alive(self) -> list[tuple[int, int]]:
        """(size, resident bytes) of each buffer still mapped."""
        return [(n, self.resident(a, n)) for a, n, ref in self.maps if ref() is not None]


def test_declared_sizes_must_match_shape_and_codec():
    with serving(TransportConfig(max_payload_mb=64, max_buffered_mb=64)) as s:
        raw = s.raw(PUSH, pb.PushReply)
        md = call_metadata("i0", "s0")
        cases = {
            "fp32 size": lambda t: setattr(t, "nbytes", 32 << 20),
            "zstd bound": lambda t: (setattr(t, "zstd_level", 3), setattr(t, "nbytes", 1 << 20)),
            "block size": lambda t: (setattr(t, "codec", "int8"), setattr(t, "block_size", 0)),
            "dimensions": lambda t: t.shape.extend([1] * 40),
        }
        for label, mutate in cases.items():
            first = next(push_chunks(meta(), delta(), 1 << 20))
            mutate(first.header.tensors[0])
            first.header.total_bytes = sum(t.nbytes for t in first.header.tensors)
            call = raw.future(s.stalled(first), metadata=md, timeout=DEADLINE_S)
            assert code_of(call) == grpc.StatusCode.INVALID_ARGUMENT, label
        assert s.service.budget.used == 0
        assert len(s.reasons(grpc.StatusCode.INVALID_ARGUMENT)) == len(cases)


def test_buffered_bytes_are_bounded_and_given_back_on_rejection(monkeypatch):
    mib = 1 << 20
    buffers = Buffers(monkeypatch)
    config = TransportConfig(max_payload_mb=48, max_buffered_mb=64, chunk_bytes=mib, idle_timeout_s=600)
    with serving(config, secrets=None, islands=None) as s:
        s.service.model_spec = None  # any shapes: this test is about bytes
        chunks = list(push_chunks(meta("a"), [fp32_tensor("big", np.full(12 * mib, 0.5, np.float32))], mib))
        raw = s.raw(PUSH, pb.PushReply)
        gate = threading.Event()

        def first_32_mib_then_a_bad_chunk() -> Iterator[pb.PushChunk]:
            yield from chunks[:32]
            gate.wait(DEADLINE_S)
            yield pb.PushChunk(index=7, data=b"x")  # out of order: the stream is rejected

        holder = raw.future(first_32_mib_then_a_bad_chunk(), metadata=call_metadata("a", None), timeout=DEADLINE_S)
        wait_until(lambda: s.service.budget.used == 48 * mib, "the first stream's reservation", DEADLINE_S)
        second = raw.future(s.stalled(chunks[0]), metadata=call_metadata("a", None), timeout=DEADLINE_S)
        assert code_of(second) == grpc.StatusCode.UNAVAILABLE  # 48 + 48 MiB > 64 MiB: busy, retry later
        assert "would exceed" in s.reasons(grpc.StatusCode.UNAVAILABLE)[0]
        wait_until(lambda: sum(r for _, r in buffers.alive()) >= 32 * mib, "the first 32 MiB to land", DEADLINE_S)
        [(size, resident)] = buffers.alive()
        assert size == 48 * mib and resident <= 34 * mib, "the 16 MiB not written yet cost nothing"
        gate.set()
        assert code_of(holder) == grpc.StatusCode.INVALID_ARGUMENT
        assert s.service.budget.used == 0
        wait_until(lambda: buffers.alive() == [], "the rejected stream's buffer to be unmapped", DEADLINE_S)


# -- identity, bytes that are not protobuf, and lies in the push metadata ------------------------------------------


@pytest.mark.parametrize("secrets", [SECRETS, None], ids=["auth", "no-auth"])
def test_unknown_island_names_are_refused_before_anything_is_read(secrets):
    with serving(TransportConfig(), secrets=secrets) as s:
        evil = s.client("evil", secret="s0")
        want = grpc.StatusCode.UNAUTHENTICATED if secrets else grpc.StatusCode.PERMISSION_DENIED
        for call in (
            lambda: evil.join(pb.JoinRequest(run_id=RUN, island="evil")),
            lambda: evil.heartbeat(pb.HeartbeatRequest(run_id=RUN, island="evil")),
            lambda: evil.leave(pb.LeaveRequest(run_id=RUN, island="evil")),
            lambda: evil.push(meta("evil"), delta()),
            lambda: evil.pull(pb.PullRequest(run_id=RUN, island="evil", have_round=-1)),
        ):
            with pytest.raises(TransportError) as info:
                call()
            assert info.value.code == want
        assert evil.attend(pb.AttendRequest(run_id=RUN, island="evil")).wait().startswith(want.name)
        assert s.handler.applied == [] and s.handler.members == {} and len(s.rejections) == 6
        assert s.service.presences.attending() == frozenset()
        if secrets is None:  # without secrets, a known name may not act as another either
            with pytest.raises(TransportError) as info:
                s.client("i1").push(meta("i0"), delta())
            assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_join_bigger_than_a_config_and_a_release_name_is_invalid_argument():
    with serving(TransportConfig()) as s:
        client = s.client("i0")
        for req, words in (
            (pb.JoinRequest(run_id=RUN, island="i0", config_json="x" * ((1 << 20) + 1)), "config_json is 1048577"),
            (pb.JoinRequest(run_id=RUN, island="i0", release="9" * 201), "release is 201 characters, at most 200"),
        ):
            with pytest.raises(TransportError) as info:
                client.join(req)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.reason, info.value
        assert s.handler.members == {} and len(s.reasons(grpc.StatusCode.INVALID_ARGUMENT)) == 2


def test_undecodable_bytes_are_invalid_argument_and_counted():
    with serving(TransportConfig()) as s:
        md = call_metadata("i0", "s0")
        garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, a length far beyond the message
        for method, reply in (
            ("/diloco.v1.Diloco/Join", pb.JoinReply),
            ("/diloco.v1.Diloco/Heartbeat", pb.HeartbeatReply),
            (PUSH, pb.PushReply),
        ):
            call = s.raw(method, reply).future(iter([garbage]), metadata=md, timeout=DEADLINE_S)
            assert code_of(call) == grpc.StatusCode.INVALID_ARGUMENT, method
        pull = s.channel.unary_stream("/diloco.v1.Diloco/PullGlobal")(garbage, metadata=md, timeout=DEADLINE_S)
        with pytest.raises(grpc.RpcError) as info:
            list(pull)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        reasons = s.reasons(grpc.StatusCode.INVALID_ARGUMENT)
        assert len(reasons) == 4 and all("undecodable" in r for r in reasons)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"loss": NAN}, "loss"),
        ({"loss": -INF}, "loss"),
        ({"loss": 1e-40}, "loss"),  # subnormal in float32
        ({"compute_s": -1.0}, "compute_s"),
        ({"compute_s": INF}, "compute_s"),
        ({"wall_s": 1e300}, "wall_s"),
        ({"wall_s": 5e-324}, "wall_s"),  # subnormal
        ({"tokens": 0}, "tokens"),
        ({"fragment": 3}, "unknown fragment 3"),
        ({"codec": "int4"}, "codec.uplink"),
    ],
)
def test_bad_push_metadata_is_refused(fields, words):
    with serving(TransportConfig(), uplink=CodecSpec(kind="fp32")) as s:
        fields = dict(fields)
        tensors = delta()
        if fields.pop("codec", None) == "int4":  # a well-formed int4 payload (zero scales and codes)
            tensors = [
                EncodedTensor(
                    t.name, "int4", "float32", t.shape, 256, 0, bytes(raw_payload_nbytes("int4", t.numel, 256))
                )
                for t in tensors
            ]
        with pytest.raises(TransportError) as info:
            s.client().push(meta(**fields), tensors)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.reason
        assert s.handler.applied == [] and len(s.rejections) == 1


@pytest.mark.parametrize(
    ("run", "sent", "words"),
    [
        (
            CodecSpec(kind="fp32"),
            CodecSpec(kind="fp32", zstd_level=3),
            "is 'fp32' (zstd level 3); this run's islands send 'fp32' (no zstd)",
        ),
        (CodecSpec(kind="int8", zstd_level=3), CodecSpec(kind="int8"), "is 'int8' (blocks of 256, no zstd)"),
        (CodecSpec(kind="int8", zstd_level=3), CodecSpec(kind="int8", zstd_level=1), "zstd level 1"),
        (CodecSpec(kind="int4"), CodecSpec(kind="int4", block_size=128), "blocks of 128"),
    ],
)
@pytest.mark.slow
def test_a_push_encoded_otherwise_than_the_run_says_is_refused(run, sent, words):
    """Kind, block size and zstd level are the run's (codec.*): a push that decodes but was encoded otherwise is not a
    push of this run, and is refused with a reason naming both encodings."""
    with serving(TransportConfig(), uplink=run) as s:
        tensors = [encode(t.name, decode(t), sent) for t in delta()]
        with pytest.raises(TransportError) as info:
            s.client().push(meta(), tensors)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.reason, info.value.reason
        assert "codec.zstd_level" in info.value.reason and s.handler.applied == []
        assert s.client().push(meta(), [encode(t.name, decode(t), run) for t in delta()]).accepted


def test_subnormal_values_reach_the_handler_as_zeros():
    with serving(TransportConfig(), uplink=CodecSpec(kind="fp32")) as s:
        b = np.full(8, 0.5, np.float32)
        b[[1, 5]] = np.float32(1e-40)
        assert b[1] != 0
        received: dict[str, np.ndarray] = {}
        apply = s.handler.push
        s.handler.push = lambda m, tensors, arrays, digest: (
            received.update(arrays),
            apply(m, tensors, arrays, digest),
        )[1]
        assert s.client().push(meta(), [fp32_tensor("b", b), fp32_tensor("w", np.zeros((4, 4), np.float32))]).accepted
        assert received["b"].tolist() == [0.5, 0, 0.5, 0.5, 0.5, 0, 0.5, 0.5]


def test_attacker_text_is_bounded_and_escaped_in_reasons():
    with serving(TransportConfig()) as s:
        forged = "\x1b[31m" + "r" * 100_000
        with pytest.raises(TransportError) as info:
            s.client().heartbeat(pb.HeartbeatRequest(run_id=forged, island="i0"))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        [(island, reason)] = s.rejections
        assert island == "i0" and len(reason) < 260 and "\x1b" not in reason and "\\x1b" in reason
        assert len(info.value.reason) <= 200 and "\x1b" not in info.value.reason


def test_a_handler_bug_is_internal_with_a_generic_reason_logged_once(caplog):
    with serving(TransportConfig()) as s:

        def broken(req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
            raise KeyError("private detail")

        s.handler.heartbeat = broken
        c = s.client()
        with caplog.at_level(logging.ERROR, logger="transport.service"):
            for _ in range(3):
                with pytest.raises(TransportError) as info:
                    c.heartbeat(pb.HeartbeatRequest(run_id=RUN, island="i0"))
                assert info.value.code == grpc.StatusCode.INTERNAL and "private" not in info.value.reason
        assert len([r for r in caplog.records if r.name == "transport.service"]) == 1
        assert len(s.reasons(grpc.StatusCode.INTERNAL)) == 3
        assert c.status().run_id == RUN  # the server goes on
