"""Admission: how many calls the server serves at once, in all and per island; beyond that, an immediate refusal.

The gRPC server is synchronous: a call holds one thread of the server's pool from the moment a worker picks it
up until its handler returns, including every second it waits for the client's next message. A client that
opens calls and sends nothing would otherwise hold every thread, and heartbeats queued behind them would miss
their leases. So every call takes a *slot* before it reads a byte, in its lane: ``stream`` (push, pull),
``unary`` (join, heartbeat, leave, status) or ``presence`` (attend: held for an island's whole membership,
transport/presence.py). A lane has a cap in all and a cap per island, and the pool has one
thread per slot of every lane (`TransportConfig.server_threads`), so no lane can take another's threads: idle
streams never starve a heartbeat, and one island cannot take the slots of the others.

A call beyond a cap is refused at once with UNAVAILABLE ("retry later": clients back off and retry), never
queued: a queued call would wait behind calls that may each stall for a whole timeout. How long a slot can be
held is bounded elsewhere (transport/watchdog.py: first-message, idle and progress timeouts).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import grpc

from transport.config import TransportConfig
from transport.errors import Rejected

STREAM = "stream"
UNARY = "unary"
PRESENCE = "presence"
PRESENCE_PER_ISLAND = 2
"""An island's presence stream and the one that replaces it: the new one may arrive before the server has noticed
that the old one's connection is gone (a keepalive timeout away)."""


@dataclass(frozen=True)
class Lane:
    """One kind of call and its caps."""

    name: str
    total: int
    per_island: int


def lanes_of(config: TransportConfig) -> tuple[Lane, ...]:
    """The lanes a server has, sized by its config."""
    return (
        Lane(STREAM, config.max_streams, config.max_streams_per_island),
        Lane(UNARY, config.max_unary_calls, config.max_unary_calls_per_island),
        Lane(PRESENCE, config.max_presence_streams, min(PRESENCE_PER_ISLAND, config.max_presence_streams)),
    )


class Slot:
    """A taken slot; `release` (or leaving the ``with`` block) gives it back, once however often it is called."""

    def __init__(self, admission: Admission, lane: str, island: str) -> None:
        self._admission = admission
        self._key = (lane, island)
        self._held = True
        self._lock = threading.Lock()

    def release(self) -> None:
        """Give the slot back (idempotent: a stream's handler and gRPC's end-of-call callback may both call it)."""
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._admission._give_back(*self._key)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """The slots of every lane; thread-safe. Counters of an island are dropped when it holds none, so a stream of
    invented names (where any name is allowed) leaves nothing behind."""

    def __init__(self, lanes: tuple[Lane, ...]) -> None:
        self._lanes = {lane.name: lane for lane in lanes}
        self._total: Counter[str] = Counter()
        self._per_island: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def take(self, lane: str, island: str) -> Slot:
        """A slot of ``lane`` for ``island``, or UNAVAILABLE (retry later) naming the cap that is reached."""
        cap = self._lanes[lane]
        with self._lock:
            if self._total[lane] >= cap.total:
                raise Rejected(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the server is serving its maximum of {cap.total} {lane} calls; retry later",
                )
            if self._per_island[lane, island] >= cap.per_island:
                raise Rejected(
                    grpc.StatusCode.UNAVAILABLE,
                    f"island {island!r} already holds its maximum of {cap.per_island} {lane} calls; retry later",
                )
            self._total[lane] += 1
            self._per_island[lane, island] += 1
        return Slot(self, lane, island)

    def in_use(self, lane: str) -> int:
        """Slots of ``lane`` taken now."""
        with self._lock:
            return self._total[lane]

    def _give_back(self, lane: str, island: str) -> None:
        with self._lock:
            self._total[lane] -= 1
            self._per_island[lane, island] -= 1
            if not self._per_island[lane, island]:
                del self._per_island[lane, island]
