"""An island's syncs on the wire (diloco/worker/island_sync.py), against a scripted client: no sockets, no coordinator.

Each sync's path is a table: what the coordinator answers to the push and to the pulls, and what the island then
sends and concludes."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from diloco.worker.island_sync import CoordinatorAway, IslandSync, Serial, Synced, retry_forever
from transport import diloco_pb2 as pb
from transport.errors import TransportError
from transport.handler import PullPayload

OK = "accepted"
GONE = grpc.StatusCode.FAILED_PRECONDITION
"""The coordinator holds no such push (a pull), or the sync closed without it (a push)."""
AWAY = grpc.StatusCode.UNAVAILABLE
COMMIT = PullPayload(1, 0, "update", b"", [])
FULL = PullPayload(2, 0, "full", b"", [])
WHO = {"run_id": "run", "island": "island-0"}


class ScriptedClient:
    """Answers each push and pull with the next outcome of its script; records every call."""

    def __init__(self, pushes: list[Any], pulls: list[Any]) -> None:
        self.pushes, self.pulls = deque(pushes), deque(pulls)
        self.calls: list[tuple] = []

    def push(self, meta: pb.PushMeta, tensors: list, on_sent: Callable[[], None] | None = None) -> pb.PushReply:
        self.calls.append(("push", meta.round, meta.fragment))
        outcome = self.pushes.popleft()
        if outcome != OK:
            raise TransportError(outcome, "scripted")
        if on_sent is not None:
            on_sent()
        return pb.PushReply(accepted=True, round=meta.round)

    def pull(self, req: pb.PullRequest) -> PullPayload:
        self.calls.append(("pull", req.have_round, req.fragment, req.full, req.after_push))
        outcome = self.pulls.popleft()
        if isinstance(outcome, grpc.StatusCode):
            raise TransportError(outcome, "scripted")
        return outcome


class Events:
    def __init__(self) -> None:
        self.names: list[str] = []

    def log(self, event: str, **fields: Any) -> None:
        self.names.append(event)


def wire(client: ScriptedClient, fragments: int = 1) -> tuple[IslandSync, Events]:
    events = Events()
    sync = IslandSync(client, events, WHO, fragments, give_up_s=60.0, prepare=lambda payload: None)  # type: ignore[arg-type]
    return sync, events


def done(value: Any) -> Future:
    out: Future = Future()
    out.set_result(value)
    return out


PUSH = SimpleNamespace(sent=SimpleNamespace(encoded=[], payload_nbytes=0))
"""A RoundPush as far as the wire reads it."""
META = pb.PushMeta(**WHO, round=0, fragment=0, loss=1.0)


@pytest.mark.parametrize(
    ("pushes", "pulls", "accepted", "payload", "calls", "events"),
    [
        # the pull goes out beside the push, as soon as its last chunk is on the wire
        ([OK], [COMMIT], True, COMMIT, ["push", "pull beside"], ["pushed"]),
        # the coordinator held no push of ours yet: asked again once the push's reply is in
        ([OK], [GONE, COMMIT], True, COMMIT, ["push", "pull beside", "pull"], ["pushed"]),
        # the sync closed without it: Δ is dropped, the commit pulled all the same
        ([GONE], [COMMIT], False, COMMIT, ["push", "pull"], ["push_dropped"]),
        # a coordinator that restarted lost the push: push again, then pull
        (
            [OK, OK],
            [GONE, GONE, COMMIT],
            True,
            COMMIT,
            ["push", "pull beside", "pull", "push", "pull"],
            ["pushed", "repush", "pushed"],
        ),
        # ... and refuses it again (the sync closed meanwhile): the full θ
        (
            [OK, GONE],
            [GONE, GONE, FULL],
            True,
            FULL,
            ["push", "pull beside", "pull", "push", "pull full"],
            ["pushed", "repush", "push_dropped"],
        ),
    ],
)
def test_a_sync(pushes, pulls, accepted, payload, calls, events) -> None:
    client = ScriptedClient(pushes, pulls)
    sync, log = wire(client)
    synced = sync.submit(0, META, done(PUSH)).result(timeout=30)
    assert synced == Synced(PUSH, accepted, payload, None)  # type: ignore[arg-type]

    def named(call: tuple) -> str:
        if call[0] == "push":
            return "push"
        return "pull full" if call[3] else "pull beside" if call[4] else "pull"

    assert [named(c) for c in client.calls] == calls
    assert log.names == events


def test_a_sync_hands_its_commit_to_prepare_on_its_pull_lane() -> None:
    client = ScriptedClient([OK], [COMMIT])
    seen: list[tuple[PullPayload, str]] = []
    ready = object()

    def prepare(payload: PullPayload) -> Any:
        seen.append((payload, threading.current_thread().name))
        return ready

    sync = IslandSync(client, Events(), WHO, 2, 60.0, prepare)  # type: ignore[arg-type]
    synced = sync.submit(1, pb.PushMeta(**WHO, round=0, fragment=1), done(PUSH)).result(timeout=30)
    assert synced is not None and synced.ready is ready
    assert seen == [(COMMIT, "pull-1")]
    assert client.calls[0] == ("push", 0, 1)


def test_a_sync_submitted_before_a_restart_is_dropped_unsent() -> None:
    client = ScriptedClient([], [])
    sync, _ = wire(client)
    gate = threading.Event()
    sync.lanes[0].submit(gate.wait)  # the lane is busy: the sync waits behind it
    stale = sync.submit(0, META, done(PUSH))
    sync.drop_queued()
    gate.set()
    assert stale.result(timeout=30) is None
    assert client.calls == []


def test_a_stop_drops_the_syncs_not_yet_on_the_wire() -> None:
    client = ScriptedClient([OK], [COMMIT])
    sync, _ = wire(client)
    encoding: Future = Future()
    queued = sync.submit(0, META, encoding)  # not encoded yet: not on the wire
    sync.let_land(0.0)
    encoding.set_result(PUSH)
    assert queued.result(timeout=30) is None  # the stop came first: never sent
    assert client.calls == []


@pytest.mark.parametrize(
    ("have", "full", "after_push", "asked"),
    [
        (5, False, False, (2, 1, False, False)),  # position 5 with P = 2: round 2, fragment 1
        (4, False, True, (2, 0, False, True)),
        (-1, True, False, (-1, 0, True, False)),  # the full θ
    ],
)
def test_a_pull_names_the_position_it_wants(have: int, full: bool, after_push: bool, asked: tuple) -> None:
    client = ScriptedClient([], [COMMIT])
    sync, _ = wire(client, fragments=2)
    assert sync.pull(have, full=full, after_push=after_push) is COMMIT
    assert client.calls == [("pull", *asked)]


@pytest.mark.parametrize(
    ("outcomes", "give_up_s", "result", "retries"),
    [
        (["ok"], 60.0, "ok", 0),
        ([AWAY, "ok"], 60.0, "ok", 1),  # the coordinator away for a moment: asked again, the retry counted
        ([grpc.StatusCode.ABORTED, "ok"], 0.0, "ok", 0),  # "not yet" is an answer: no patience spent, no retry counted
        ([AWAY], 0.0, CoordinatorAway, 0),  # away for longer than the island waits
        ([grpc.StatusCode.INVALID_ARGUMENT], 60.0, TransportError, 0),  # refused: never retried
    ],
)
@pytest.mark.slow
def test_retry_forever(outcomes: list, give_up_s: float, result: Any, retries: int) -> None:
    script = deque(outcomes)
    counted: list[None] = []

    def call() -> str:
        outcome = script.popleft()
        if isinstance(outcome, grpc.StatusCode):
            raise TransportError(outcome, "scripted")
        return outcome

    if isinstance(result, type):
        with pytest.raises(result):
            retry_forever(call, "call", give_up_s, lambda: counted.append(None))
    else:
        assert retry_forever(call, "call", give_up_s, lambda: counted.append(None)) == result
    assert len(counted) == retries


def test_serial_runs_jobs_in_order_on_one_daemon_thread() -> None:
    lane = Serial("lane")
    names: list[tuple[int, str, bool]] = []
    jobs = [
        lane.submit(lambda i=i: names.append((i, threading.current_thread().name, threading.current_thread().daemon)))
        for i in range(5)
    ]
    failed = lane.submit(lambda: 1 / 0)
    for job in jobs:
        job.result(timeout=30)
    assert names == [(i, "lane", True) for i in range(5)]
    assert isinstance(failed.exception(timeout=30), ZeroDivisionError)  # handed to whoever waits on it
    lane.shutdown()
