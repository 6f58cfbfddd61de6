"""Membership and quorum as one pure function, `decide(now, round_view, cfg) -> Decision`, and what a pull
returns as another, `answer_pull(pull_view) -> PullAnswer`.

The coordinator calls it whenever something happens (a push, a heartbeat, a tick) and does what it says. It
holds no state and reads no clock, so every branch is table-tested. Rules:
  * an island is live while its lease (renewed by heartbeats and pushes) has not expired, and its presence call
    has not broken (process, host or link gone: transport/presence.py) more than `reconnect_grace_s` ago
    without it being heard from since;
  * a round closes as soon as every live island it waits for has pushed, provided `min_islands` have; it does
    not wait for a joiner that arrived without the open round's θ after the run's first round (it must pull θ and
    train H steps first: a joiner never blocks the round that is open when it arrives), though it takes its push
    should one come before the close;
  * `min_islands` is a count, or a fraction of the live islands the round waits for (a float: 0.5 = half of them,
    rounded up; a joiner that arrived late is not counted in it);
  * a coordinator that resumed a run waits for the islands that took part before as for live ones (`awaited`)
    until each joins it, or `lease_s` after its start passes without a word from it (the rule that loses a
    member that went silent): a restart alone never drops an island's work from a round;
  * otherwise it closes at the deadline once `min_islands` have pushed, dropping the late ones;
  * the deadline adapts to observed round times: median + k·MAD of recent rounds, clamped to
    [min_deadline_s, max_deadline_s], so nobody has to guess a constant for their WAN;
  * below `min_islands` it waits, however long, and says so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class QuorumConfig:
    min_islands: int | float = 1
    """A round never closes with fewer pseudo-gradients than this: a count (an integer, e.g. 2), or a fraction of
    the live islands (a float in (0, 1], e.g. 0.5: half of them, rounded up, at least one), so the quorum scales with
    a roster that grows and shrinks (`required`)."""
    lease_s: float = 15.0
    """An island that has not been heard from (heartbeat or push) for this long is considered lost."""
    reconnect_grace_s: float = 1.0
    """An island whose presence call broke is lost after this long unless it is heard from again: long enough for
    an island whose connection blipped to call again, short beside the lease (docs/architecture.md, "Presence")."""
    deadline_k: float = 4.0
    """Deadline = median + k·MAD of recent round durations."""
    min_deadline_s: float = 5.0
    """The adaptive deadline is never shorter than this."""
    max_deadline_s: float = 600.0
    """... nor longer than this; also the deadline before enough rounds have been observed."""
    history: int = 20
    """How many recent round durations the deadline is computed from."""

    def __post_init__(self) -> None:
        if isinstance(self.min_islands, float) and not 0 < self.min_islands <= 1:
            raise ValueError(
                f"quorum.min_islands as a fraction of the live islands must be in (0, 1] (got {self.min_islands}); "
                "a count is an integer"
            )
        if isinstance(self.min_islands, int) and self.min_islands < 1:
            raise ValueError(f"quorum.min_islands must be >= 1 (got {self.min_islands})")
        for key in ("lease_s", "reconnect_grace_s", "min_deadline_s", "max_deadline_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"quorum.{key} must be > 0 (got {getattr(self, key)})")
        if self.max_deadline_s < self.min_deadline_s:
            raise ValueError("quorum.max_deadline_s must be >= quorum.min_deadline_s")
        if self.deadline_k < 0 or self.history < 1:
            raise ValueError("quorum.deadline_k must be >= 0 and quorum.history >= 1")

    def required(self, live: int) -> int:
        """How many pushes a round needs with `live` islands live: the count, or the fraction of them rounded up."""
        if isinstance(self.min_islands, float):
            return max(1, math.ceil(self.min_islands * live - 1e-9))
        return self.min_islands


REJOIN = "rejoin"
"""Heartbeat state telling an island whose lease expired to join again (it keeps its own state)."""


class Action(Enum):
    WAIT = "wait"
    CLOSE = "close"


@dataclass(frozen=True)
class RoundView:
    """What the coordinator knows about the open round, as plain values."""

    opened_at: float
    """When the round opened (the previous commit, or the first join)."""
    last_seen: Mapping[str, float]
    """Every member island -> when it was last heard from."""
    pushed: frozenset[str]
    """Islands whose pseudo-gradient for this round was accepted."""
    durations: Sequence[float] = ()
    """Durations of recently closed rounds, oldest first."""
    broken: Mapping[str, float] = field(default_factory=dict)
    """Member -> when its presence call broke, for those not heard from since."""
    late: frozenset[str] = frozenset()
    """Members that joined during this round without its θ: not waited for (a push from one still counts)."""
    awaited: Mapping[str, float] = field(default_factory=dict)
    """Islands that took part before a coordinator restart and have not joined the new one -> since when (its
    start): waited for while `lease_s` has not passed since."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    live: frozenset[str]
    lost: Mapping[str, str]
    """Members no longer live -> why (the coordinator drops them and logs island_lost with it)."""
    deadline_s: float


def adaptive_deadline(durations: Sequence[float], cfg: QuorumConfig) -> float:
    recent = list(durations)[-cfg.history :]
    if len(recent) < 3:
        return cfg.max_deadline_s
    median = statistics.median(recent)
    mad = statistics.median(abs(d - median) for d in recent)
    return min(cfg.max_deadline_s, max(cfg.min_deadline_s, median + cfg.deadline_k * mad))


def why_lost(now: float, name: str, view: RoundView, cfg: QuorumConfig) -> str | None:
    """Why member ``name`` is no longer live, or None while it is."""
    if now - view.last_seen[name] > cfg.lease_s:
        return "lease expired"
    broke = view.broken.get(name)
    if broke is not None and now - broke > cfg.reconnect_grace_s:
        return f"its connection broke {now - broke:.1f}s ago and it did not call again (process, host or link gone)"
    return None


def decide(now: float, view: RoundView, cfg: QuorumConfig) -> Decision:
    reasons = {name: why_lost(now, name, view, cfg) for name in view.last_seen}
    lost = {name: why for name, why in reasons.items() if why is not None}
    live = frozenset(reasons) - frozenset(lost)
    deadline = adaptive_deadline(view.durations, cfg)
    pushed = view.pushed
    back = {n for n, since in view.awaited.items() if n not in view.last_seen and now - since <= cfg.lease_s}
    waiting_for = sorted((live - pushed - view.late) | back)
    elapsed = now - view.opened_at

    def out(action: Action, reason: str) -> Decision:
        return Decision(action, reason, live, lost, deadline)

    expected = live - view.late
    needed = cfg.required(len(expected))
    if len(pushed) < needed:
        of = f"min_islands={cfg.min_islands}"
        if isinstance(cfg.min_islands, float):
            of = f"{needed} ({of} of {len(expected)} live)"
        others = sorted(live - pushed)
        return out(
            Action.WAIT,
            f"{len(pushed)} of {of} pushed; waiting for {', '.join(waiting_for or others) or 'islands'}",
        )
    if not waiting_for:
        return out(Action.CLOSE, f"all {len(live)} live islands pushed ({len(pushed)} contributions)")
    if elapsed >= deadline:
        return out(
            Action.CLOSE,
            f"deadline {deadline:.1f}s passed with {len(pushed)} of {len(live)} live islands; "
            f"late: {', '.join(waiting_for)}",
        )
    return out(Action.WAIT, f"waiting for {', '.join(waiting_for)} (deadline in {deadline - elapsed:.1f}s)")


# ---------------------------------------------------------------------------------------------------------------
# What a pull returns: `answer_pull(request, coordinator view) -> PullAnswer`, as pure as `decide`.


class PullKind(Enum):
    UPDATE = "update"
    """û of the round just closed: the island holds θ_r and applies θ_{r+1} = θ_r + û (the cheap, usual path)."""
    FULL = "full"
    """The whole θ: the island is new, restarted, behind by more than one round, or asked for it."""
    WAIT = "wait"
    """The island's round is still open: hold the call until it closes (then decide again), or tell it to retry."""
    PUSH_FIRST = "push_first"
    """The open round has no push from this island (a restarted coordinator lost it): push again, then pull."""
    RESYNC = "resync"
    """The island is ahead of the coordinator (restarted from an older checkpoint): it must pull the full θ."""


@dataclass(frozen=True)
class PullView:
    """A pull request and what the coordinator knows, as plain values.

    Positions count syncs: without streaming a sync is a round, so they are round numbers; with Streaming DiLoCo's
    P fragments, sync s is fragment s mod P of round s // P (`OuterLoop.sync`), and "θ_s" is θ with the commits of
    syncs 0 .. s-1 applied.
    """

    have_round: int
    """The position whose θ the island holds (-1: none)."""
    full: bool
    """The island asked for the full parameters."""
    round: int
    """The coordinator's open position: it holds θ_round."""
    done: bool
    """Every planned round is committed."""
    pushed: bool
    """This island's pseudo-gradient for the position it holds was accepted (the open one, or with streaming a
    later one the coordinator holds until it opens)."""
    last_commit_round: int | None
    """The position whose û this coordinator committed last in this process (None: none since it started)."""
    arriving: bool = False
    """This island's push for the position it holds is still streaming in: an island asks for the commit as soon as
    its push is on the wire, not once the push's reply is back, so the pull's request travels beside the push's
    last bytes instead of a round trip after them (`IslandSync._collect`)."""
    kept: int = 1
    """How many commits up to `last_commit_round` the coordinator keeps for pulls (one per fragment: an island whose
    overlapped merges lag a sync or two behind still gets the update it needs, not the whole θ)."""


@dataclass(frozen=True)
class PullAnswer:
    kind: PullKind
    reason: str


def answer_pull(v: PullView) -> PullAnswer:
    if not v.full and v.round < v.have_round < v.round + v.kept and (v.pushed or v.arriving):
        # Streaming: the island pushed a later fragment's sync early (the coordinator holds it until that sync
        # opens); its commit comes in turn.
        return PullAnswer(PullKind.WAIT, f"round {v.have_round} is queued behind round {v.round}")
    if not v.full and v.have_round > v.round:
        # Only when this coordinator restarted from a checkpoint older than what it had sent (checkpoint_every > 1):
        # waiting would deadlock, since the island never pushes for our round.
        return PullAnswer(
            PullKind.RESYNC,
            f"the island is at round {v.have_round} but the coordinator restarted at round {v.round}; "
            "pull the full parameters",
        )
    if not v.full and v.have_round == v.round and not v.done:
        if v.arriving and not v.pushed:  # the push is on its way: its outcome decides, so hold the pull for it
            return PullAnswer(PullKind.WAIT, f"the island's push for round {v.round} is still arriving")
        if not v.pushed:
            reason = f"round {v.round} has no pseudo-gradient from the island; push it first"
            return PullAnswer(PullKind.PUSH_FIRST, reason)
        return PullAnswer(PullKind.WAIT, f"round {v.round} is still open")
    last = v.last_commit_round
    if not v.full and last is not None and last - v.kept < v.have_round <= last == v.round - 1:
        return PullAnswer(PullKind.UPDATE, f"the island holds θ_{v.have_round}: the update of round {v.have_round}")
    if v.full:
        why = "asked for"
    elif v.have_round < 0:
        why = "the island holds no parameters"
    else:
        why = f"the island holds θ_{v.have_round} and this coordinator keeps only the last {v.kept} update(s)"
    return PullAnswer(PullKind.FULL, f"full θ_{v.round}: {why}")
