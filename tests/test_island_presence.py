"""An island's heartbeats and presence call (diloco/worker/island_presence.py), against a scripted client: no sockets."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from diloco.coordinator.membership import REJOIN
from diloco.worker.island_presence import PRESENCE_RETRY_S, IslandPresence, next_pause
from transport import diloco_pb2 as pb
from transport.client import NOT_A_MEMBER
from transport.errors import TransportError

SHORT, LONG = PRESENCE_RETRY_S
WHO = {"run_id": "run", "island": "island-0"}


@pytest.mark.parametrize(
    ("pause", "held_s", "then"),
    [
        (SHORT, 0.0, 2 * SHORT),  # a call that ended at once: wait longer before the next
        (2 * SHORT, 0.01, 4 * SHORT),
        (LONG, 0.0, LONG),  # ... up to the longest pause
        (LONG, LONG + 1, SHORT),  # a call that lasted (a blip): the next one at once
        (SHORT, LONG, 2 * SHORT),  # held exactly the longest pause: not yet "lasted"
    ],
)
def test_next_pause(pause: float, held_s: float, then: float) -> None:
    assert next_pause(pause, held_s) == pytest.approx(then)


class Call:
    """A presence call that ends with `why` at once, or (None) when closed."""

    def __init__(self, why: str | None) -> None:
        self.why, self.closed = why, threading.Event()

    def wait(self) -> str:
        if self.why is not None:
            return self.why
        self.closed.wait()
        return "closed"

    def close(self) -> None:
        self.closed.set()


class ScriptedClient:
    def __init__(self, beat: Any = None, calls: list[Call] | None = None) -> None:
        self.beat, self.calls = beat, list(calls or [])
        self.sent: list[tuple[str, Any]] = []
        self.attended = threading.Semaphore(0)
        self.beaten = threading.Event()

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        self.sent.append(("heartbeat", (req.round, req.step)))
        self.beaten.set()
        if isinstance(self.beat, grpc.StatusCode):
            raise TransportError(self.beat, "scripted")
        return pb.HeartbeatReply(round=4, state=self.beat)

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        self.sent.append(("join", req.last_round))
        return pb.JoinReply(round=4)

    def attend(self, req: pb.AttendRequest) -> Call:
        self.sent.append(("attend", req.island))
        self.attended.release()
        return self.calls.pop(0)


class Events:
    def __init__(self) -> None:
        self.logged: list[tuple[str, dict]] = []

    def log(self, event: str, **fields: Any) -> None:
        self.logged.append((event, fields))


def presence(client: ScriptedClient, events: Events, round_: int = 3) -> IslandPresence:
    return IslandPresence(client, events, WHO, lambda: (round_, 70), lambda: pb.JoinRequest(**WHO, last_round=round_))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reply", "round_", "state", "sent", "logged"),
    [
        ("running", 3, "running", [("heartbeat", (3, 70))], []),
        ("done", 3, "done", [("heartbeat", (3, 70))], []),
        ("running", -1, "running", [("heartbeat", (0, 70))], []),  # no round yet: round 0 is named
        # declared lost: join again with the round it holds, and the state stays what it was
        (
            REJOIN,
            3,
            "starting",
            [("heartbeat", (3, 70)), ("join", 3)],
            [("rejoined", {"round": 4, "island": "island-0"})],
        ),
        # the coordinator away: nothing changes (the training loop's retries notice)
        (grpc.StatusCode.UNAVAILABLE, 3, "starting", [("heartbeat", (3, 70))], []),
    ],
)
def test_a_heartbeat(reply: Any, round_: int, state: str, sent: list, logged: list) -> None:
    client, events = ScriptedClient(beat=reply), Events()
    island = presence(client, events, round_)
    island.heartbeat()
    assert island.state == state
    assert client.sent == sent
    assert events.logged == logged


def test_a_call_ended_for_a_non_member_asks_for_a_heartbeat_and_is_opened_again_until_the_end() -> None:
    held = Call(None)
    client = ScriptedClient(calls=[Call(NOT_A_MEMBER), held])
    island = presence(client, Events())
    attending = threading.Thread(target=island._attend)
    attending.start()
    assert client.attended.acquire(timeout=30) and client.attended.acquire(timeout=30)  # the second call is open
    assert island._beat.is_set()  # the heartbeat that joins again is due
    island.end()
    attending.join(timeout=30)
    assert not attending.is_alive() and held.closed.is_set()
    assert [s for s, _ in client.sent] == ["attend", "attend"]


def test_no_call_is_opened_after_the_end() -> None:
    client = ScriptedClient(calls=[])
    island = presence(client, Events())
    island.end()
    island._attend()  # returns at once: the island has left
    assert client.sent == []


def test_heartbeats_end_at_the_stop() -> None:
    client = ScriptedClient(beat="running")
    island = presence(client, Events())
    island.beat()
    beating = threading.Thread(target=island._heartbeats, args=(3600.0,))
    beating.start()
    assert client.beaten.wait(timeout=30)  # the beat asked for is sent at once, not after a third of the lease
    island.stop()
    beating.join(timeout=30)
    assert not beating.is_alive() and island.state == "running"
