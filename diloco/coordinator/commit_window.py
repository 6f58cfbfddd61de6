"""The commits a coordinator keeps for its pulls: the last `kept` by sync position, each with the stream its pulls
share, the islands it was sent to, and θ's digest after it.

`kept` is one commit per fragment (streaming: an island one sync behind in each fragment still gets an update), or
(asynchronous) the updates an island may have missed, `outer.max_staleness + 1`. Everything older is evicted with
the commit that pushes it out; an undone commit takes every later one with it (`undo_from`). Pure bookkeeping: no
lock, no clock.
"""

from __future__ import annotations

from diloco.run.rounds import Commit
from transport.service import SharedPull


class CommitWindow:
    """The last `kept` commits by sync position, and θ's digest at each of the last `kept` positions."""

    def __init__(self, kept: int, position: int, digest: str) -> None:
        """``position``: the open sync; ``digest``: θ's digest there (what the first commit is taken from)."""
        self.kept = kept
        self.commits: dict[int, Commit] = {}
        """What pulls answer with: the commit that closed each sync."""
        self.streams: dict[int, SharedPull] = {}
        """Each commit's update as its pulls send it, serialized (and hashed) once for them all."""
        self.served: dict[int, set[str]] = {}
        """The islands that have received each commit, as the transport tells once a pull's stream is over."""
        self.digests: dict[int, str] = {position: digest}
        """θ's digest at each position: what an asynchronous push's base is checked against."""

    def add(self, position: int, commit: Commit) -> None:
        """The commit that closed sync ``position``; the oldest falls out of the window."""
        self.commits[position] = commit
        self.streams[position] = SharedPull()
        for kept in (self.commits, self.streams, self.served):
            kept.pop(position - self.kept, None)
        self.digests[position + 1] = commit.digest
        self.digests.pop(position + 1 - self.kept, None)

    @property
    def last(self) -> Commit | None:
        return self.commits[max(self.commits)] if self.commits else None

    @property
    def last_position(self) -> int | None:
        return max(self.commits, default=None)

    def served_to(self, island: str, position: int) -> bool:
        """A pull that carried the commit of sync ``position`` (or a later θ) to ``island`` is over; False when that
        commit is no longer kept (`served` is bounded like `commits`)."""
        if position not in self.commits:
            return False
        self.served.setdefault(position, set()).add(island)
        return True

    def was_served(self, island: str, position: int) -> bool:
        return island in self.served.get(position, ())

    def undo_from(self, position: int) -> None:
        """The commit of sync ``position`` and every later one were undone: ``position`` is open again."""
        self.commits = {s: c for s, c in self.commits.items() if s < position}
        self.streams = {s: t for s, t in self.streams.items() if s < position}
        self.served = {s: n for s, n in self.served.items() if s < position}
        self.digests = {s: d for s, d in self.digests.items() if s <= position}
