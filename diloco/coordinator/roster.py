"""The membership table: which of the run's islands are members now, and what each last said.

An island becomes a member by joining and stays one while it is heard from (join, heartbeat, push, presence call);
it stops being one when it leaves or when the pure `diloco.coordinator.membership.decide` says it is lost (its lease
ran out, or its presence call broke `quorum.reconnect_grace_s` ago). This class applies those facts and answers
questions about them; it decides nothing and holds no lock (the coordinator calls it under its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from diloco.coordinator.membership import RoundView


class Roster:
    """Members by the time each was last heard from, with their broken presence calls, rounds and losses."""

    def __init__(self) -> None:
        self.last_seen: dict[str, float] = {}
        self.broken: dict[str, float] = {}
        """Member -> when its presence call broke (transport/presence.py), until it is heard from again."""
        self.working: dict[str, int] = {}
        """The round each island last said (by heartbeat) it is training on."""
        self.last_loss: dict[str, float] = {}
        """Each island's loss in its last push (kept after it leaves, until it is retired: the divergence vote reads
        it)."""
        self.late: dict[str, int] = {}
        """Member -> the sync it joined during without that sync's θ: that sync does not wait for it."""
        self.gone: dict[str, float] = {}
        """Island that took part and is no member -> since when (it left, was lost, or, for a coordinator that resumed
        a run, has not come back since it started): what retirement after `islands.retire_after_s` reads. An island
        that never came is not gone (a region slow to start is not retired for it). Forgotten when it joins or is
        retired."""
        self.awaited: dict[str, float] = {}
        """Island that took part before this coordinator resumed the run and has not joined it -> since when: rounds
        wait for it a lease long (diloco/coordinator/membership.py). Forgotten when it joins, leaves or is retired."""

    def __contains__(self, island: str) -> bool:
        return island in self.last_seen

    def __len__(self) -> int:
        return len(self.last_seen)

    @property
    def live(self) -> list[str]:
        return sorted(self.last_seen)

    def heard_from(self, island: str, now: float) -> None:
        """A sign of life from a member: renews its lease and forgives a broken presence call (its process is
        there: a blipped link, or a call not yet replaced)."""
        self.last_seen[island] = now
        self.broken.pop(island, None)

    def expect(self, islands: Iterable[str], now: float) -> None:
        """Islands that took part before (a resumed run's) and have not joined this coordinator yet: awaited, and
        gone since `now` as far as retirement is concerned."""
        for island in islands:
            if island not in self.last_seen:
                self.gone.setdefault(island, now)
                self.awaited.setdefault(island, now)

    def join(self, island: str, now: float, late_for: int | None = None) -> bool:
        """The island joins (or rejoins); True when it was not a member. `late_for`: the sync it arrives during
        without that sync's θ (it is not waited for there)."""
        new = island not in self.last_seen
        self.heard_from(island, now)
        self.gone.pop(island, None)
        self.awaited.pop(island, None)
        if late_for is None:
            self.late.pop(island, None)
        else:
            self.late[island] = late_for
        return new

    def beat(self, island: str, round_: int, now: float) -> bool:
        """A member's heartbeat, naming the round it trains on; True when that round is news."""
        self.heard_from(island, now)
        if self.working.get(island) == round_:
            return False
        self.working[island] = round_
        return True

    def pushed(self, island: str, loss: float, now: float) -> None:
        self.heard_from(island, now)
        self.last_loss[island] = loss

    def broke(self, island: str, now: float) -> None:
        """A member's presence call broke (no effect on an island that is no member)."""
        if island in self.last_seen:
            self.broken[island] = now

    def leave(self, island: str, now: float) -> bool:
        """The island leaves; True when it was a member."""
        self.broken.pop(island, None)
        self.late.pop(island, None)
        self.awaited.pop(island, None)
        if self.last_seen.pop(island, None) is None:
            return False
        self.gone[island] = now
        return True

    def lose(self, lost: Iterable[str], now: float) -> None:
        """The members `decide` counts lost."""
        for island in lost:
            self.leave(island, now)

    def retire(self, island: str) -> bool:
        """The island is retired: no member any more, nothing of it is waited for, and nothing of it is kept (the
        table is bounded by the roster, not by every island ever enrolled); True when it was a member."""
        member = self.leave(island, 0.0)
        for table in (self.gone, self.working, self.last_loss):
            table.pop(island, None)
        return member

    def round_view(
        self, opened_at: float, pushed: Iterable[str], durations: Sequence[float], sync: int = -1
    ) -> RoundView:
        """What `decide` reads about the open sync (`sync`: its position, to know who joined it late)."""
        return RoundView(
            opened_at=opened_at,
            last_seen=dict(self.last_seen),
            pushed=frozenset(pushed),
            durations=durations,
            broken=dict(self.broken),
            late=frozenset(n for n, s in self.late.items() if s == sync),
            awaited=dict(self.awaited),
        )

    def moved_past(self, island: str, round_: int) -> bool:
        """The island said by heartbeat that it trains on a round after ``round_``."""
        return self.working.get(island, -1) > round_

    def losses(self, islands: Iterable[str]) -> list[float]:
        """The last reported losses of ``islands`` (in their order), skipping islands that never pushed."""
        return [self.last_loss[n] for n in islands if n in self.last_loss]

    def seen_ago(self, island: str, now: float) -> float:
        """Seconds since the member was heard from; -1 for an island that is no member."""
        return now - self.last_seen[island] if island in self.last_seen else -1.0
