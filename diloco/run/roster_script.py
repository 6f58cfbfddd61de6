"""A roster script: islands that join, retire or are killed at named rounds, for `simulate` and `launch` alike.

    [[roster.events]]
    round = 3
    join = "eu-2"        # admitted: its first push is round 3's, trained from θ_3 with a fresh inner state
    [[roster.events]]
    round = 5
    retire = "island-1"  # retired: its last push is round 4's
    [[roster.events]]
    round = 6
    kill = "island-0"    # SIGKILLed before its push of round 6: it misses round 6 and is back in round 7

Each event means what the live federation does at that point (docs/architecture.md, "Churn by script"), placed where
its outcome is deterministic, so `simulate` and `launch` of one script end with one parameter digest. Everything
here is pure: the script's validation (`script_refusal`, one line naming the event) and the changes a round opens
with (`changes_at`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transport.auth import is_island_name

KINDS = ("join", "retire", "kill")
"""What an event does to its island, one per event."""


@dataclass(frozen=True)
class RosterEvent:
    """One `[[roster.events]]` entry: at round `round`, one of `join`, `retire`, `kill` names an island."""

    round: int = -1
    join: str = ""
    retire: str = ""
    kill: str = ""

    @property
    def kinds(self) -> list[str]:
        """The kinds this entry sets (exactly one in a valid script)."""
        return [kind for kind in KINDS if getattr(self, kind)]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    @property
    def island(self) -> str:
        return getattr(self, self.kind)


@dataclass(frozen=True)
class RosterConfig:
    """`[roster]`: the churn a run goes through (empty: the configured islands, every round)."""

    events: tuple[RosterEvent, ...] = field(default=())
    """Joins, retirements and kills by round (module docstring); in any order, applied by round."""


@dataclass(frozen=True)
class RoundChanges:
    """What round r opens with: islands admitted, retired, killed at it, and back from a kill at round r - 1."""

    joins: tuple[str, ...] = ()
    retires: tuple[str, ...] = ()
    kills: tuple[str, ...] = ()
    restarts: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.joins or self.retires or self.kills or self.restarts)

    @property
    def arriving(self) -> tuple[str, ...]:
        """The islands that come into round r once it is open: those back from a kill at r - 1, then the joiners."""
        return (*self.restarts, *self.joins)


def _ordered(events: Sequence[RosterEvent]) -> list[tuple[int, RosterEvent]]:
    """The events with their index in the script, by round (and by index within a round)."""
    return sorted(enumerate(events), key=lambda item: (item[1].round, item[0]))


def changes_at(events: Sequence[RosterEvent], round_: int) -> RoundChanges:
    """The changes round `round_` opens with, in the script's order (a valid script: `script_refusal` said None)."""

    def named(kind: str, at: int) -> tuple[str, ...]:
        return tuple(e.island for _, e in _ordered(events) if e.round == at and e.kind == kind)

    kills = named("kill", round_)
    return RoundChanges(named("join", round_), named("retire", round_), kills, named("kill", round_ - 1))


def script_refusal(
    events: Sequence[RosterEvent], configured: Sequence[str], rounds: int, max_islands: int
) -> str | None:
    """Why the script cannot run against `configured` islands over `rounds` rounds (one line naming the event), or
    None. Replayed round by round: a join names an island not enrolled then (a retired name may come again, as a
    new island), a retire or kill an enrolled one; no island joins and is killed or retired in one round, none is
    killed while it comes back from a kill, at most `max_islands` are enrolled, and some island pushes every round."""
    for i, event in enumerate(events):
        key = f"roster.events[{i}]"
        if len(event.kinds) != 1:
            got = ", ".join(event.kinds) or "none"
            return f"{key} sets exactly one of join, retire, kill (got {got})"
        if not is_island_name(event.island):
            return f"{key}.{event.kind} must be an [A-Za-z0-9_-] name of 1 to 64 characters (got {event.island!r})"
        if not 0 <= event.round < rounds:
            return f"{key}.round must be a round of the run, 0 to {rounds - 1} (got {event.round})"
        if event.kind == "join" and event.round == 0:
            return f"{key}: an island that trains from round 0 is configured: list {event.island!r} in islands.names"
    enrolled = list(configured)
    killed_before: set[str] = set()
    by_round: dict[int, list[tuple[int, RosterEvent]]] = {}
    for i, event in _ordered(events):
        by_round.setdefault(event.round, []).append((i, event))
    for r in range(rounds):
        touched: dict[str, str] = {}
        killed: set[str] = set()
        for i, event in by_round.get(r, []):
            key, name = f"roster.events[{i}] (round {r}, {event.kind} {event.island!r})", event.island
            if name in touched:
                return f"{key}: {name!r} already {touched[name]}s at round {r}: one event per island and round"
            touched[name] = event.kind
            if event.kind == "join":
                if name in enrolled:
                    return f"{key}: {name!r} is on the roster already at round {r}"
                if len(enrolled) >= max_islands:
                    return f"{key}: {len(enrolled)} islands are enrolled at round {r}, islands.max is {max_islands}"
                enrolled.append(name)
                continue
            if name not in enrolled:
                return f"{key}: {name!r} is not on the roster at round {r}"
            if name in killed_before:
                return f"{key}: {name!r} comes back at round {r} from its kill at round {r - 1}"
            if event.kind == "retire":
                enrolled.remove(name)
            else:
                killed.add(name)
        pushing = [n for n in enrolled if n not in killed]
        if not pushing:
            return f"roster.events: no island pushes in round {r} (every island is retired or killed there)"
        killed_before = killed
    return None


def enrolled_at(events: Sequence[RosterEvent], configured: Sequence[str], round_: int) -> list[str]:
    """The islands on the roster while round `round_` is open, its joiners included and its retirees not (a valid
    script), in order of enrolment."""
    enrolled = list(configured)
    for r in range(round_ + 1):
        changes = changes_at(events, r)
        enrolled = [n for n in enrolled if n not in changes.retires] + list(changes.joins)
    return enrolled


def leasing_at(events: Sequence[RosterEvent], configured: Sequence[str], round_: int) -> list[str]:
    """The islands that lease round `round_`'s chunks (data.sampling = "chunks"), in the order `simulate` and
    `launch` both lease them (docs/architecture.md, "Churn by script"): those on the roster as the round opens, its
    retirees and killees among them, in order of enrolment; then those that arrive (`RoundChanges.arriving`). A
    valid script. The ledger hands a returned chunk, or a joiner's fresh one, to whoever asks first, so one order of
    the leases is what makes one digest of a run under churn."""
    arriving = changes_at(events, round_).arriving
    opening = enrolled_at(events, configured, round_ - 1)
    return [name for name in opening if name not in arriving] + list(arriving)


def rounds_changed(events: Sequence[RosterEvent]) -> list[int]:
    """The rounds that open with a change: an event's round, and the round after a kill (its island comes back)."""
    return sorted({e.round for e in events} | {e.round + 1 for e in events if e.kill})
