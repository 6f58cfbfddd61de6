"""Presence (transport/presence.py): an island's Attend call breaks when its process or host is gone, and the
coordinator hears of it at once, not a lease later.

The rules of `Presences` as a table; then a real server and real island processes: one SIGKILLed (its kernel closes
the connection), one SIGSTOPped (it answers nothing, as a host that froze or a link that went silent: only the
server's keepalive pings notice). Waits are bounded by generous limits, never measured: that a live island's presence
holds is seen once it has answered several of the server's keepalive pings (counted by a relay on the connection),
not after a fixed time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from diloco.harness.procs import wait_until
from tests.reference_handler import ReferenceHandler
from transport import diloco_pb2 as pb
from transport.admission import PRESENCE
from transport.client import NOT_A_MEMBER, IslandClient, Presence
from transport.config import TransportConfig
from transport.grpc_client import GrpcTransport
from transport.grpc_server import RunningServer, start_server
from transport.inprocess import InProcessTransport
from transport.presence import Presences
from transport.service import DilocoService

pytestmark = pytest.mark.timeout(120)

RUN = "presence"
ISLANDS = ("i0", "i1")
# Keepalive on (it is off by default): pings after 0.3 s of silence, a connection closed 1 s after an unanswered one,
# so a frozen peer is noticed in about a second and a half here.
CONFIG = TransportConfig(keepalive_s=0.3, keepalive_timeout_s=1.0, max_attempts=1)
WAIT_S = 30.0


# -- the rules --------------------------------------------------------------------------------------------------


def _play(steps: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Run `Presences` through ``steps`` (("hold", island): a new call; ("end", island): that island's oldest
    open call ends; ("withdraw", island): it is withdrawn; ("stop", ""): the server stops); return the breaks
    reported and the calls cancelled."""
    breaks: list[str] = []
    cancelled: list[str] = []
    presences = Presences(breaks.append)
    open_calls: dict[str, list] = {}
    for n, (what, island) in enumerate(steps):
        if what == "hold":
            call = presences.hold(island, lambda tag=f"{island}#{n}": cancelled.append(tag))
            call.__enter__()
            open_calls.setdefault(island, []).append(call)
        elif what == "end":
            open_calls[island].pop(0).__exit__(None, None, None)
        elif what == "withdraw":
            open_calls[island].pop(0).withdraw()
        else:
            presences.stop()
    return breaks, cancelled


@pytest.mark.parametrize(
    ("steps", "breaks", "cancelled"),
    [
        # the island's call ends while it is its current one: a break, reported once
        ([("hold", "a"), ("end", "a")], ["a"], []),
        # two islands: each break is its own
        ([("hold", "a"), ("hold", "b"), ("end", "b"), ("end", "a")], ["b", "a"], []),
        # a newer call replaces the older, which is cancelled; the older one's end is no break (the island came back)
        ([("hold", "a"), ("hold", "a"), ("end", "a")], [], ["a#0"]),
        # ... and the newer one's end is
        ([("hold", "a"), ("hold", "a"), ("end", "a"), ("end", "a")], ["a"], ["a#0"]),
        # a call withdrawn (its island is no member) ends without a break, yet it replaced the older one
        ([("hold", "a"), ("hold", "a"), ("end", "a"), ("withdraw", "a")], [], ["a#0"]),
        # the server stops: every call ends, none is a break
        ([("hold", "a"), ("hold", "b"), ("stop", ""), ("end", "a"), ("end", "b")], [], []),
    ],
)
def test_presences(steps: list[tuple[str, str]], breaks: list[str], cancelled: list[str]) -> None:
    assert _play(steps) == (breaks, cancelled)


# -- a real server, real island processes ------------------------------------------------------------------------


def _service(config: TransportConfig = CONFIG) -> tuple[ReferenceHandler, DilocoService]:
    handler = ReferenceHandler(RUN, {"w": np.zeros(4, np.float32)})
    return handler, DilocoService(handler, RUN, handler.model_spec(), config=config, islands=ISLANDS)


@pytest.fixture
def server() -> Iterator[tuple[RunningServer, ReferenceHandler, DilocoService]]:
    handler, service = _service()
    running = start_server(service)
    yield running, handler, service
    running.stop(grace_s=0)


def _open(client: IslandClient, service: DilocoService, island: str = "i0") -> tuple[Presence, threading.Thread, list]:
    """A presence call of ``island``, waited on by a thread that appends why it ended; returned once it is held."""
    presence = client.attend(pb.AttendRequest(run_id=RUN, island=island))
    ended: list[str] = []
    waiter = threading.Thread(target=lambda: ended.append(presence.wait()))
    waiter.start()
    wait_until(lambda: island in service.presences.attending(), f"{island}'s call", WAIT_S)
    return presence, waiter, ended


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP2_PING, HTTP2_ACK = 0x6, 0x1


class PingCountingRelay:
    """A TCP relay between one client and `upstream` (plaintext HTTP/2) that counts the PING acknowledgements the
    client sends: the server's keepalive pings the client answered. It closes each side when the other closes, so a
    client killed or a server that gives up on a frozen client is seen through it as without it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.acks = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._serve, daemon=True)]
        self._threads[0].start()

    def _serve(self) -> None:
        client, _ = self._listener.accept()
        host, port = self.upstream.rsplit(":", 1)
        server = socket.create_connection((host, int(port)))
        down = threading.Thread(target=self._pump, args=(server, client, None), daemon=True)
        down.start()
        self._threads.append(down)
        self._pump(client, server, self._count_acks)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, observe: Callable[[bytes], bytes] | None) -> None:
        buffered = b""
        while data := _recv(source):
            sink.sendall(data)
            if observe is not None:
                buffered = observe(buffered + data)
        for sock in (sink, source):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _count_acks(self, data: bytes) -> bytes:
        """Count the whole frames of ``data`` (after the connection preface); return the partial frame left over."""
        if data.startswith(HTTP2_PREFACE):
            data = data[len(HTTP2_PREFACE) :]
        while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
            length, kind, flags = int.from_bytes(data[:3], "big"), data[3], data[4]
            self.acks += kind == HTTP2_PING and bool(flags & HTTP2_ACK)
            data = data[9 + length :]
        return data

    def close(self) -> None:
        self._listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


ISLAND_PROCESS = textwrap.dedent(
    """
    import sys
    from transport import diloco_pb2 as pb
    from transport.config import TransportConfig
    from transport.grpc_client import GrpcTransport

    client = GrpcTransport(sys.argv[1], sys.argv[2], config=TransportConfig(max_attempts=1))
    client.join(pb.JoinRequest(run_id=sys.argv[3], island=sys.argv[2]))
    print(client.attend(pb.AttendRequest(run_id=sys.argv[3], island=sys.argv[2])).wait(), flush=True)
    """
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_an_island_process_gone_or_frozen_breaks_its_presence(server, how: signal.Signals) -> None:
    running, handler, service = server
    relay = PingCountingRelay(running.address)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    island = subprocess.Popen([sys.executable, "-c", ISLAND_PROCESS, relay.address, "i1", RUN], env=env)
    try:
        wait_until(lambda: "i1" in service.presences.attending(), "presence call from i1", WAIT_S)
        # held while the island lives: it answers the server's pings, more of them than span keepalive_timeout_s
        answered = 2 + int(CONFIG.keepalive_timeout_s / CONFIG.keepalive_s)
        wait_until(lambda: relay.acks >= answered, f"{answered} keepalive pings answered by i1", WAIT_S)
        assert handler.absences == [], "a live island's presence broke"
        island.send_signal(how)
        wait_until(lambda: handler.absences == ["i1"], "break of i1's presence", WAIT_S)
        assert "i1" not in service.presences.attending()
    finally:
        island.kill()
        island.wait(timeout=WAIT_S)
        relay.close()


def test_a_replaced_call_is_no_break_and_a_closed_one_is(server) -> None:
    running, handler, service = server
    client = GrpcTransport(running.address, "i0", config=CONFIG)
    try:
        client.join(pb.JoinRequest(run_id=RUN, island="i0"))
        _, first, first_ended = _open(client, service)
        second, _, _ = _open(client, service)
        first.join(WAIT_S)
        assert first_ended and first_ended[0].startswith("CANCELLED"), first_ended  # the server ended the older call
        wait_until(lambda: "i0" in service.presences.attending(), "i0's second call", WAIT_S)
        assert handler.absences == []
        second.close()
        wait_until(lambda: handler.absences == ["i0"], "break of i0's presence", WAIT_S)
    finally:
        client.close()


def test_a_non_member_is_told_to_join_and_an_unknown_island_is_refused(server) -> None:
    running, handler, service = server
    client = GrpcTransport(running.address, "i0", config=CONFIG)
    stranger = GrpcTransport(running.address, "mallory", config=CONFIG)
    try:
        assert client.attend(pb.AttendRequest(run_id=RUN, island="i0")).wait() == NOT_A_MEMBER
        why = stranger.attend(pb.AttendRequest(run_id=RUN, island="mallory")).wait()
        assert why.startswith(grpc.StatusCode.PERMISSION_DENIED.name) and "not on this run's roster" in why, why
        forged = client.attend(pb.AttendRequest(run_id=RUN, island="i1")).wait()  # i0's call naming i1
        assert forged.startswith(grpc.StatusCode.PERMISSION_DENIED.name), forged
        assert handler.absences == [] and service.presences.attending() == frozenset()
    finally:
        client.close()
        stranger.close()


def test_calls_ending_as_the_server_stops_are_no_break() -> None:
    handler, service = _service()
    running = start_server(service)
    client = GrpcTransport(running.address, "i0", config=CONFIG)
    try:
        client.join(pb.JoinRequest(run_id=RUN, island="i0"))
        _, waiter, ended = _open(client, service)
        running.stop(grace_s=0)
        waiter.join(WAIT_S)
        assert ended and handler.absences == []
    finally:
        client.close()


def test_a_flood_of_calls_holds_one_slot_and_breaks_nothing(server) -> None:
    running, handler, service = server
    client = GrpcTransport(running.address, "i0", config=CONFIG)
    try:
        client.join(pb.JoinRequest(run_id=RUN, island="i0"))
        calls = [client.attend(pb.AttendRequest(run_id=RUN, island="i0")) for _ in range(20)]
        ended: list[str] = []
        waiters = [threading.Thread(target=lambda c=c: ended.append(c.wait())) for c in calls]
        for w in waiters:
            w.start()
        # Each call replaced the one before (or was refused at the island's cap): one is left, holding one slot.
        wait_until(lambda: len(ended) == len(calls) - 1, "all but one call ended", WAIT_S)
        assert all(why.startswith(("CANCELLED", "UNAVAILABLE")) for why in ended), ended
        wait_until(lambda: running.admission.in_use(PRESENCE) == 1, "one presence slot", WAIT_S)
        assert service.presences.attending() == {"i0"} and handler.absences == []
        for c in calls:
            c.close()
        for w in waiters:
            w.join(WAIT_S)
        wait_until(lambda: handler.absences == ["i0"], "the last call's break", WAIT_S)
        wait_until(lambda: running.admission.in_use(PRESENCE) == 0, "no presence slot", WAIT_S)
    finally:
        client.close()


@pytest.mark.slow
def test_a_call_that_sends_nothing_or_garbage_is_ended() -> None:
    handler, service = _service(TransportConfig(first_message_timeout_s=0.5, max_attempts=1))
    running = start_server(service)
    channel = grpc.insecure_channel(running.address)
    method = channel.stream_stream("/diloco.v1.Diloco/Attend", request_serializer=lambda b: b)
    md = (("x-diloco-island", "i0"),)
    release = threading.Event()

    def nothing() -> Iterator[bytes]:
        release.wait()
        yield from ()

    try:
        for requests, code in (
            (nothing(), grpc.StatusCode.CANCELLED),  # the watchdog's first-message deadline
            (iter([b"\x0a\xff\xff\xff\xff\x0f"]), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as info:
                list(method(requests, metadata=md, timeout=WAIT_S))
            assert info.value.code() == code
        wait_until(lambda: running.admission.in_use(PRESENCE) == 0, "the slots back", WAIT_S)
        assert handler.absences == [] and service.presences.attending() == frozenset()
    finally:
        release.set()
        channel.close()
        running.stop(grace_s=0)


def test_in_process_presence_is_the_same_registration() -> None:
    handler, service = _service()
    client = InProcessTransport(service, "i0")
    assert client.attend(pb.AttendRequest(run_id=RUN, island="i0")).wait() == NOT_A_MEMBER
    client.join(pb.JoinRequest(run_id=RUN, island="i0"))
    presence, waiter, ended = _open(client, service)
    presence.close()
    waiter.join(WAIT_S)
    assert ended == ["closed"] and handler.absences == ["i0"]
