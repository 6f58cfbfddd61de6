"""Timeouts on the client's side of a call: a call whose client goes quiet is cancelled, and what it held is freed.

A synchronous gRPC server reads a request stream by blocking in ``next(request_iterator)``, which takes no
timeout, and sends a response by blocking until the client has taken it. The call's deadline is the client's
to set, and a hostile client sets none: opening a call and sending nothing (or a byte now and then, or never
reading a pull) would hold the call's thread, its admission slot and its buffer for ever. The server-side
tool gRPC offers is ``context.cancel()`` (``grpc.RpcContext``; gRPC's own cancellation example frees servicer
threads with it), which may be called from any thread: a ``next()`` blocked on the cancelled call then raises
``grpc.RpcError`` (or ends the iteration, when the pending receive completes first), a blocked send returns,
and the handler unwinds, closing its stream and returning its slot and buffer.

So one `Watchdog` thread per server holds every armed deadline and cancels a call when its deadline passes.
A handler arms a deadline right before each wait on its client and disarms it as soon as the client has
delivered, so our own work (decoding, the coordinator's lock) never counts against the client. The deadline
of one wait (`deadline_s`) is ``first_message_timeout_s`` for a call's first message, then the sooner of
``idle_timeout_s`` and the stream's progress deadline: ``rpc_timeout_s`` plus the bytes so far and one more
message at ``min_bandwidth_mbps`` since the stream began, the rule the client's own stream deadline follows
(`TransportConfig.stream_deadline_s`). A client slower than the slowest link we plan for is cut, and one that
trickles a byte per idle period cannot hold a slot and a share of the byte budget for hours.

The client of a cancelled call sees CANCELLED (a call cancelled by the server carries no status of ours);
the server reports DEADLINE_EXCEEDED with the reason through ``on_expired`` (the service's ``on_rejected``),
once, from the watchdog thread. The handler then sees the stream end with `StreamExpired`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc

from transport.config import TransportConfig

T = TypeVar("T")
LOG = logging.getLogger(__name__)


class StreamExpired(Exception):
    """The watchdog cancelled the call while its handler waited on the client; it has been reported already."""


class Watch:
    """The deadline of one call: armed around each wait on its client, cancelled by the `Watchdog` when it passes."""

    def __init__(self, dog: Watchdog, cancel: Callable[[], None], on_expired: Callable[[str], None]) -> None:
        self._dog = dog
        self.cancel = cancel
        self.on_expired = on_expired
        self.deadline = math.inf
        self.reason = ""
        self.expired = False

    def arm(self, seconds: float, reason: str) -> None:
        """From now on, cancel the call unless `disarm` comes within ``seconds``; ``reason`` is what is reported."""
        self._dog.set(self, self._dog.clock() + seconds, reason)

    def disarm(self) -> None:
        """The client delivered: stop the clock. Raises `StreamExpired` if the call was cancelled meanwhile."""
        self._dog.set(self, math.inf, "")
        if self.expired:
            raise StreamExpired(self.reason)

    def receive(
        self, messages: Iterable[T], config: TransportConfig, size: Callable[[T], int] | None = None
    ) -> Iterator[T]:
        """``messages``, each awaited under `deadline_s`; ``size`` (payload bytes of a message) turns the progress
        deadline on. A client failure (it cancelled, its link broke) comes out as it came in."""
        it = iter(messages)
        pace = Pace(config, self._dog.clock) if size is not None else None
        first = True
        while True:
            self.arm(*deadline_s(config, pace, first, "no message from the client"))
            try:
                message = next(it)
            except StopIteration:
                self.disarm()
                return
            except grpc.RpcError:
                self.disarm()
                raise
            self.disarm()
            first = False
            if pace is not None and size is not None:
                pace.add(size(message))
            yield message

    def send(self, messages: Iterable[T], config: TransportConfig, size: Callable[[T], int]) -> Iterator[T]:
        """``messages`` handed to gRPC, each of which the client must take under `deadline_s` (making the next one
        is our work, not counted)."""
        pace = Pace(config, self._dog.clock)
        for message in messages:
            self.arm(*deadline_s(config, pace, False, "the client took no message"))
            yield message  # gRPC resumes this generator once the message has been sent
            self.disarm()
            pace.add(size(message))

    def close(self) -> None:
        """Forget this call (its handler is done)."""
        self._dog.set(self, math.inf, "")

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Pace:
    """The slowest a stream may go: its bytes so far, at ``min_bandwidth_mbps``, after ``rpc_timeout_s``."""

    def __init__(self, config: TransportConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._start = clock()
        self._bytes = 0

    def add(self, nbytes: int) -> None:
        """``nbytes`` more went through."""
        self._bytes += nbytes

    def left_s(self) -> float:
        """Seconds until the stream falls behind, counting one more message of the largest size."""
        allowed = self._config.stream_deadline_s(self._bytes + self._config.max_message_bytes)
        return self._start + allowed - self._clock()


def deadline_s(config: TransportConfig, pace: Pace | None, first: bool, what: str) -> tuple[float, str]:
    """How long the next wait on a client may last, and the reason reported when it lasts longer."""
    if first:
        return config.first_message_timeout_s, f"{what} within {config.first_message_timeout_s:g} s of the call"
    idle = (config.idle_timeout_s, f"{what} for {config.idle_timeout_s:g} s")
    if pace is None or pace.left_s() >= idle[0]:
        return idle
    bandwidth = config.min_bandwidth_mbps
    return max(0.0, pace.left_s()), f"{what}: the stream fell below {bandwidth:g} Mbit/s (transport.min_bandwidth_mbps)"


class Watchdog:
    """One thread that cancels the calls whose armed deadline has passed. ``clock`` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._armed: set[Watch] = set()
        self._cond = threading.Condition()
        self._wake_at = math.inf
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="diloco-watchdog", daemon=True)
        self._thread.start()

    def watch(self, cancel: Callable[[], None], on_expired: Callable[[str], None]) -> Watch:
        """A new, disarmed `Watch`: ``cancel`` ends the call, ``on_expired(reason)`` reports it."""
        return Watch(self, cancel, on_expired)

    def set(self, watch: Watch, deadline: float, reason: str) -> None:
        """Arm (a finite ``deadline``) or disarm ``watch``."""
        with self._cond:
            watch.deadline, watch.reason = deadline, reason or watch.reason
            if deadline == math.inf:
                self._armed.discard(watch)
                return
            self._armed.add(watch)
            if deadline < self._wake_at:  # only a sooner deadline needs the thread awake earlier
                self._cond.notify()

    def armed(self) -> int:
        """Calls with a running clock now."""
        with self._cond:
            return len(self._armed)

    def close(self) -> None:
        """Stop the thread (the server is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self.clock()
                due = [w for w in self._armed if w.deadline <= now]
                for w in due:
                    self._armed.discard(w)
                    w.expired = True
                if not due:
                    self._wake_at = min((w.deadline for w in self._armed), default=math.inf)
                    self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)
                    continue
            for w in due:  # outside the lock: cancelling and reporting call into gRPC and the coordinator
                _expire(w)


def _expire(watch: Watch) -> None:
    """Report, then cancel: whoever sees the call end (its client, its handler) sees it reported already."""
    try:
        watch.on_expired(watch.reason)
        watch.cancel()
    except Exception:  # the watchdog must outlive anything a callback does
        LOG.exception("cancelling an expired call failed")


def message_size(message: Any) -> int:
    """Payload bytes of a chunk message (pre-serialized chunks count whole); 0 for anything without data."""
    if isinstance(message, bytes | bytearray | memoryview):
        return len(message)
    data = getattr(message, "data", b"")
    return len(data)
