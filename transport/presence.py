"""Presence: which open Attend call is each island's, and the report when one breaks.

A joined island holds one Attend call open for as long as it runs (transport/diloco.proto). Nothing travels on it
after the first reply; what carries information is that it *ends*. An island's process that dies has its
connection closed by its kernel at once; a host or link gone silent, when the server's keepalive pings are on
(`TransportConfig.keepalive_s`; off by default, see there), stops answering them, which closes the connection a
few seconds later. Either way gRPC ends the call, and the coordinator hears of it here long before the island's
lease would expire (docs/architecture.md, "Presence").

The rules, for `Presences`:

* a newer call of an island replaces the older one, which is cancelled: its end is not a break, since the island
  is plainly there (a link that blipped reconnects with a new call, possibly before the server noticed the old
  connection was gone);
* a call that ends while it is still its island's current one is a break, reported once to ``on_break(island)``,
  unless it is withdrawn (the coordinator does not count the island a member: nothing to break);
* once the server is stopping, no end is a break (every call ends then, for reasons of the server's own).

An island that ends its call on purpose has left first (a Leave), so its break finds no member to drop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType


class Presences:
    """The current Attend call of every island; thread-safe."""

    def __init__(self, on_break: Callable[[str], None]) -> None:
        self._on_break = on_break
        self._current: dict[str, Attendance] = {}
        self._stopping = False
        self._lock = threading.Lock()

    def hold(self, island: str, cancel: Callable[[], None]) -> Attendance:
        """``island``'s call from now on (its previous one is cancelled); leave the ``with`` block when it ended.
        ``cancel`` ends the call (gRPC's ``context.cancel``), for when a newer one replaces it."""
        attendance = Attendance(self, island, cancel)
        with self._lock:
            replaced = self._current.get(island)
            self._current[island] = attendance
        if replaced is not None:
            replaced.cancel()  # outside the lock: gRPC may run the call's callbacks on this thread
        return attendance

    def attending(self) -> frozenset[str]:
        """Islands whose call is open now."""
        with self._lock:
            return frozenset(self._current)

    def stop(self) -> None:
        """The server is stopping: the calls that end from now on are not breaks."""
        with self._lock:
            self._stopping = True

    def _ended(self, attendance: Attendance, broke: bool) -> None:
        with self._lock:
            if self._current.get(attendance.island) is not attendance:
                return  # replaced by a newer call of the island
            del self._current[attendance.island]
            broke = broke and not self._stopping
        if broke:
            self._on_break(attendance.island)


class Attendance:
    """One island's Attend call, registered with `Presences.hold`; its ``with`` block is the call's life."""

    def __init__(self, presences: Presences, island: str, cancel: Callable[[], None]) -> None:
        self._presences = presences
        self.island = island
        self.cancel = cancel

    def __enter__(self) -> Attendance:
        return self

    def withdraw(self) -> None:
        """The call is not the island's presence after all (the island is no member): it ends without a break."""
        self._presences._ended(self, broke=False)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._presences._ended(self, broke=True)
