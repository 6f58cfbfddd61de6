"""Logging refused messages without letting an attacker fill the disk: truncated, sampled, counted.

Every refused message counts (`Totals.rejected`), but a client that sends thousands of bad messages a second must
not turn each into a line of metrics.jsonl, and a reason that quotes an attacker's string (a 3.5 MB run id) must
not be written in full. `RejectionLog.admit(now, island, reason)` is a pure decision over a little state:

  * a reason is cut to `MAX_REASON_CHARS` characters, non-printable characters escaped, and so is the island name;
  * per kind of refusal (the gRPC status code the reason starts with) at most `burst` events are written in every
    `window_s` seconds; the rest are only counted;
  * when a window ends with suppressed events, one `rejected_suppressed` event says how many of each kind
    (`flush`, called by the coordinator's ticker, or the next `admit`).

So metrics.jsonl grows by at most (kinds × burst + kinds) short lines per window, whatever the attack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAX_REASON_CHARS = 200
"""Longest reason (and island name) written to metrics.jsonl."""


def clip(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text` made safe to log: non-printable characters escaped, cut to `limit` characters with a marker."""
    safe = text if text.isprintable() else text.encode("unicode_escape", errors="replace").decode("ascii")
    return safe if len(safe) <= limit else f"{safe[:limit]}... ({len(safe)} chars)"


def kind_of(reason: str) -> str:
    """The refusal's kind: the status code a `Rejected` reason starts with ("UNAUTHENTICATED: ..."), else "other"."""
    head, sep, _ = reason.partition(":")
    return head if sep and head.isupper() and head.replace("_", "").isalpha() else "other"


@dataclass(frozen=True)
class Admitted:
    """What to write for one refusal: its event (None when suppressed) and the suppressed counts of the window that
    just ended (empty when none)."""

    event: dict[str, str] | None
    suppressed: dict[str, int]


@dataclass
class RejectionLog:
    burst: int = 5
    """Events of one kind written per window."""
    window_s: float = 60.0
    """Length of a window in seconds."""
    _window_start: float | None = None
    _written: dict[str, int] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def flush(self, now: float) -> dict[str, int]:
        """If the window has ended: the counts it suppressed (a new window starts); else nothing. Call it now and then
        (the coordinator's ticker does), so the counts of an attack that stopped are written too."""
        if self._window_start is not None and now - self._window_start < self.window_s:
            return {}
        ended, self._suppressed, self._written = self._suppressed, {}, {}
        self._window_start = now
        return ended

    def admit(self, now: float, island: str, reason: str, kind: str | None = None) -> Admitted:
        """Whether this event is written; `kind` is its bucket (default: the status code `reason` starts with)."""
        ended = self.flush(now)
        kind = kind_of(reason) if kind is None else kind
        if self._written.get(kind, 0) >= self.burst:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return Admitted(None, ended)
        self._written[kind] = self._written.get(kind, 0) + 1
        return Admitted({"island": clip(island), "kind": kind, "reason": clip(reason)}, ended)


MEMBERSHIP_BURST = 10
"""`island_joined` (or `island_left`) events of one island written a minute: a supervised island that restarts
several times a minute still has each one logged; an insider's Join/Leave loop is counted, not logged."""


class ThrottledEvents:
    """The coordinator's events a caller can multiply at will, each kind written at most a burst a minute: refusals
    (`rejected`, then `rejected_suppressed`) and membership changes (`island_joined` / `island_left`, then
    `membership_suppressed`). An insider with one island's secret can send Join and Leave in turn, each accepted:
    without the cap every pair would be two lines of metrics.jsonl. The islands are the run's (checked before), so
    the counts are bounded."""

    def __init__(self, log: Callable[..., None]) -> None:
        """``log(event, **fields)``: the run directory's event log."""
        self.log = log
        self.rejections = RejectionLog()
        self.memberships = RejectionLog(burst=MEMBERSHIP_BURST)

    def refused(self, now: float, round_: int, island: str, reason: str) -> None:
        admitted = self.rejections.admit(now, island, reason)
        self._rejections_suppressed(round_, admitted.suppressed)
        if admitted.event is not None:
            self.log("rejected", round=round_, **admitted.event)

    def membership_logged(self, now: float, event: str, round_: int, island: str) -> bool:
        """Whether this `island_joined` or `island_left` event of ``island`` is written (the caller writes it)."""
        admitted = self.memberships.admit(now, island, "", kind=f"{event} {island}")
        self._memberships_suppressed(round_, admitted.suppressed)
        return admitted.event is not None

    def flush(self, now: float, round_: int) -> None:
        """Write the counts of windows that ended (the coordinator's ticker calls it)."""
        self._rejections_suppressed(round_, self.rejections.flush(now))
        self._memberships_suppressed(round_, self.memberships.flush(now))

    def _rejections_suppressed(self, round_: int, counts: dict[str, int]) -> None:
        if counts:
            self.log("rejected_suppressed", round=round_, counts=counts)

    def _memberships_suppressed(self, round_: int, counts: dict[str, int]) -> None:
        if counts:
            self.log("membership_suppressed", round=round_, counts=counts)
