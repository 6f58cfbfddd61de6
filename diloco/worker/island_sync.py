"""An island's syncs on the wire: each push on its fragment's lane, the wait for its commit on that fragment's pull
lane, and the pulls that move the island's global copy (diloco/worker/global_copy.py).

    submit(s, meta, Δ) -> lane p:       push Δ of sync s (once encoded), unless a restart made it stale
                          pull lane p:  pull s's commit as soon as the push is on the wire; prepare it -> Synced
    pull(s)            -> the commit of position s, or the full θ
    push(meta, Δ)      -> accepted, or dropped (the sync closed without it)

While the coordinator is away every call is retried with backoff (`retry_forever`) until the island's patience
(network.coordinator_wait_s) runs out. The island's worker (diloco/worker/island_worker.py) decides what the results
mean for its θ; this part only moves bytes, in order, off the training thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, InvalidStateError
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import grpc

from diloco.run.rundir import RunDir
from diloco.worker.global_copy import Ready
from floor.errors import WaitedTooLong
from islands.island import RoundPush, TakenDelta
from transport import diloco_pb2 as pb
from transport.client import IslandClient
from transport.errors import TransportError
from transport.handler import PullPayload

T = TypeVar("T")


class CoordinatorAway(WaitedTooLong, ConnectionError):
    """The coordinator did not answer for longer than the island is willing to wait (exit 69: a supervisor starts
    the island again, which then waits as long again)."""


def retry_forever(fn: Callable[[], T], what: str, give_up_s: float, on_retry: Callable[[], None] | None = None) -> T:
    """Call fn until it succeeds; retryable failures (coordinator away) are retried until give_up_s, each such
    retry told to `on_retry` (the island's retries_total metric)."""
    deadline = time.monotonic() + give_up_s
    delay = 0.5
    while True:
        try:
            return fn()
        except TransportError as exc:
            if not exc.retryable:
                raise
            if exc.code == grpc.StatusCode.ABORTED:  # the coordinator answered "not yet": it is not away
                deadline = time.monotonic() + give_up_s
            elif time.monotonic() > deadline:
                raise CoordinatorAway(f"{what}: coordinator did not answer for {give_up_s:.0f}s ({exc})") from None
            elif on_retry is not None:
                on_retry()
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


class Serial(Executor):
    """An executor of one daemon thread: jobs run one after the other, in the order they were submitted (an
    island's encodes, or one fragment's pushes or commit waits).

    ThreadPoolExecutor(max_workers=1) runs jobs the same way, but its thread is not a daemon: the interpreter joins
    it at exit, so a push or pull blocked on an absent coordinator would keep a dying island alive until its retries
    give up. One long-lived thread rather than one per job, because starting a thread waits until it is scheduled,
    which on shared cores takes a streaming island's training thread a share of its time."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        out: Future[T] = Future()
        self._jobs.put((partial(fn, *args, **kwargs), out))
        return out

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """The thread ends after the jobs already submitted (`wait` and `cancel_futures` are not supported: a job
        may block for as long as the coordinator is away)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, out = item
            try:
                out.set_result(job())
            except BaseException as exc:  # handed to whoever waits on it, who re-raises it in the training thread
                out.set_exception(exc)


@dataclass(frozen=True)
class Synced:
    """One sync's outcome on its pull lane: was Δ accepted, what the pull after it brought, and (streaming) that
    update already applied to its fragment (None: the training thread applies it, or it was not an update)."""

    push: RoundPush
    accepted: bool
    payload: PullPayload
    ready: Ready | None = None


class IslandSync:
    """The island's end of the wire: its pushes and pulls, each fragment's on lanes of its own."""

    def __init__(
        self,
        client: IslandClient,
        rd: RunDir,
        who: dict[str, str],
        fragments: int,
        give_up_s: float,
        prepare: Callable[[PullPayload], Ready | None],
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        """`who`: the run and island every request names. `prepare`: what a pull lane does with a commit once it
        has landed (apply it ahead: `GlobalCopy.ready`), so the training thread finds it done at the merge."""
        self.client, self.rd, self.who = client, rd, who
        self.P, self.give_up_s = fragments, give_up_s
        self._prepare, self._on_retry = prepare, on_retry
        self.wire = Serial("wire")
        """Encodes (streaming), in sync order."""
        self.lanes = [Serial(f"push-{p}") for p in range(self.P)]
        """One push lane per fragment. Pushes of different fragments are on the wire together, as concurrent RPCs
        share one HTTP/2 connection: each pays the link's latency once, side by side, rather than P one-way latencies
        in a row. A fragment's next push follows its merge, so a lane never holds more than one push of its own."""
        self.pulls = [Serial(f"pull-{p}") for p in range(self.P)]
        """One lane per fragment for the wait on its commits and the prepare of each (`_collect`): like `lanes`, a
        long-lived thread, and a fragment's commits are waited for in order."""
        self._generation = 0
        """Bumped by `drop_queued`: a sync submitted before it is dropped unsent."""
        self._last_push: dict[int, Future[bool | None]] = {}
        """Each lane's newest push: a stop gives them time to land (`let_land`)."""

    def pull(self, have: int, full: bool = False, after_push: bool = False) -> PullPayload:
        """The commit of sync position `have` (its round, and fragment when streaming), or the full θ (-1, `full`).
        `after_push`: this island's push for `have` has just gone out (`_collect`)."""
        round_, fragment = divmod(have, self.P) if have >= 0 else (-1, 0)
        req = pb.PullRequest(**self.who, have_round=round_, fragment=fragment, full=full, after_push=after_push)
        return retry_forever(lambda: self.client.pull(req), "pull", self.give_up_s, self._on_retry)

    def push(
        self, meta: pb.PushMeta, push: RoundPush, on_sent: Callable[[], None] | None = None
    ) -> pb.PushReply | None:
        """Push Δ; None when the round closed without it (a slow island, a restarted coordinator) or (async) it was
        too stale: Δ is dropped. `on_sent`: told once the push's last chunk is on the wire (`_collect`)."""
        where = {"round": meta.round, "island": self.who["island"], **self.fragment_field(meta.fragment)}
        t0 = time.perf_counter()
        try:
            reply = retry_forever(
                lambda: self.client.push(meta, push.sent.encoded, on_sent), "push", self.give_up_s, self._on_retry
            )
        except TransportError as exc:
            if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                raise
            self.rd.log("push_dropped", **where, reason=exc.reason)
            return None
        self.rd.log(
            "pushed",
            **where,
            bytes_up=push.sent.payload_nbytes,
            loss=meta.loss,
            push_s=round(time.perf_counter() - t0, 4),
        )
        return reply

    def encode(self, taken: TakenDelta) -> Future[RoundPush]:
        """Δ encoded on the wire thread, after the syncs before it (the training thread goes on meanwhile), kept as
        it goes on the wire (`RoundPush.for_the_wire`)."""
        return self.wire.submit(lambda: taken.encode().for_the_wire())

    def submit(self, sync: int, meta: pb.PushMeta, pending: Future[RoundPush]) -> Future[Synced | None]:
        """Sync `sync`: its push to its fragment's lane once encoded, the wait for its commit to its pull lane; the
        result is None when `drop_queued` made the sync stale before it was sent."""
        p = meta.fragment
        on_wire: Future[bool] = Future()
        sent = self.lanes[p].submit(self._send, meta, pending, self._generation, on_wire)
        self._last_push[p] = sent
        return self.pulls[p].submit(self._collect, sync, meta, pending, sent, on_wire)

    def drop_queued(self) -> None:
        """Syncs submitted until now and not yet sent are dropped (they belong to a schedule the island left)."""
        self._generation += 1

    def let_land(self, wait_s: float) -> None:
        """On a stop: syncs not yet sent are dropped, a push already on the wire gets `wait_s` to land (a push
        after the Leave would make the coordinator count the island alive again)."""
        self.drop_queued()
        deadline = time.monotonic() + wait_s
        for push in self._last_push.values():
            with contextlib.suppress(TimeoutError):
                push.exception(timeout=max(0.0, deadline - time.monotonic()))

    def await_replies(self) -> None:
        """Wait until every push sent so far is answered (accepted, refused, or dropped unsent): the claims the
        coordinator's ledger holds of this island are then all it will hold (data.sampling = "chunks" leases after
        them). A push that failed says so where its sync is collected, not here."""
        for push in list(self._last_push.values()):
            push.exception()

    def fragment_field(self, p: int) -> dict[str, int]:
        """An event's `fragment` field, with streaming."""
        return {"fragment": p} if self.P > 1 else {}

    def _send(self, meta: pb.PushMeta, push: Future[RoundPush], generation: int, on_wire: Future[bool]) -> bool | None:
        """Push Δ (on its fragment's lane, once encoded); None when a restart made it stale first. `on_wire` says
        True once the push's last chunk is on the wire, False if the push is done with before (stale, or it failed):
        its pull waits for one or the other."""

        def settle(out: bool) -> None:
            with contextlib.suppress(InvalidStateError):  # told once: by the first attempt that got out, or here
                on_wire.set_result(out)

        try:
            if generation != self._generation:
                return None
            return self.push(meta, push.result(), partial(settle, True)) is not None
        finally:
            settle(False)

    def _collect(
        self,
        sync: int,
        meta: pb.PushMeta,
        pending: Future[RoundPush],
        sent: Future[bool | None],
        on_wire: Future[bool],
    ) -> Synced | None:
        """Wait for sync `sync`'s commit once its push went out (the worker takes the result at its merge).

        Each push leaves on its fragment's lane as soon as it is encoded, beside the other fragments' (`lanes`);
        the coordinator holds a push for a later fragment's sync until that sync opens (`PushAdmission.early`), and
        the pulls wait for their commits side by side, so a sync's round trip never holds up the next fragment's
        push. The pull goes out as soon as the push is on the wire (`on_wire`), not once its reply is back: its
        request crosses the link beside the push's last bytes, which saves one round trip a sync (the push's
        reply comes back while the commit is made), and the coordinator holds it until the push has landed
        (`PullRequest.after_push`). Should the coordinator still hold no push of ours, the usual path decides once
        the push's reply is in (`_pull_after_push`: push again, or resync)."""
        early = self._pull_beside_push(sync) if on_wire.result() else None
        accepted = sent.result()
        if accepted is None:
            return None
        push = pending.result()
        payload = early if early is not None else self._pull_after_push(sync, meta, push)
        return Synced(push, accepted, payload, self._prepare(payload))

    def _pull_after_push(self, sync: int, meta: pb.PushMeta, push: RoundPush) -> PullPayload:
        """Wait for sync `sync` (round, or round and fragment) to close. A coordinator that restarted and lost our
        push says so: push again.

        When the push is refused too (the sync closed meanwhile, or the coordinator restarted at an older round
        than ours), this Δ is of no use any more: resync with the full parameters.
        """
        for _ in range(10):
            try:
                return self.pull(sync)
            except TransportError as exc:
                if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self.rd.log("repush", round=meta.round, island=self.who["island"], reason=exc.reason)
                if self.push(meta, push) is None:
                    break
        return self.pull(-1, full=True)

    def _pull_beside_push(self, sync: int) -> PullPayload | None:
        """The pull `_collect` sends while its push is still on the wire; None when the coordinator holds no push
        of ours for `sync` (it did not land, was refused, or a restarted coordinator lost it)."""
        try:
            return self.pull(sync, after_push=True)
        except TransportError as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return None
