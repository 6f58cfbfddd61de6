"""Table tests of the pure membership / quorum decision."""

from __future__ import annotations

import pytest

from diloco.coordinator.membership import (
    Action,
    PullKind,
    PullView,
    QuorumConfig,
    RoundView,
    adaptive_deadline,
    answer_pull,
    decide,
)

CFG = QuorumConfig(min_islands=2, lease_s=10, reconnect_grace_s=1, deadline_k=3, min_deadline_s=5, max_deadline_s=100)
SEEN = {"a": 95.0, "b": 95.0, "c": 95.0}
SEEN_49 = {"a": 49.0, "b": 49.0, "c": 49.0}


LEASE = "lease expired"
BROKE = "its connection broke"


@pytest.mark.parametrize(
    ("now", "seen", "broken", "pushed", "durations", "action", "reason", "lost"),
    [
        # everyone live pushed: close at once
        (100, SEEN, {}, {"a", "b", "c"}, (), Action.CLOSE, "all 3 live islands pushed", {}),
        # below min_islands: wait however late it is
        (1000, {"a": 999.0, "b": 999.0}, {}, {"a"}, (), Action.WAIT, "1 of min_islands=2 pushed; waiting for b", {}),
        # c is silent past its lease: lost, and the round closes with the live ones
        (100, {**SEEN, "c": 80.0}, {}, {"a", "b"}, (), Action.CLOSE, "all 2 live islands pushed", {"c": LEASE}),
        # c is live but slow; no history yet, so the deadline is max_deadline_s (100 s from opened_at = 0)
        (50, SEEN | {"a": 49.0, "b": 49.0, "c": 49.0}, {}, {"a", "b"}, (), Action.WAIT, "waiting for c", {}),
        (100, SEEN, {}, {"a", "b"}, (), Action.CLOSE, "deadline 100.0s passed with 2 of 3 live islands; late: c", {}),
        # with history the deadline adapts: median 20, MAD 1 -> 23 s
        (
            24,
            {"a": 24.0, "b": 24.0, "c": 24.0},
            {},
            {"a", "b"},
            (19, 20, 21, 20, 22),
            Action.CLOSE,
            "deadline 23.0s",
            {},
        ),
        (
            22,
            {"a": 22.0, "b": 22.0, "c": 22.0},
            {},
            {"a", "b"},
            (19, 20, 21, 20, 22),
            Action.WAIT,
            "deadline in 1.0s",
            {},
        ),
        # a lost island that already pushed still counts toward the round
        (
            100,
            {**SEEN, "a": 50.0},
            {},
            {"a", "b", "c"},
            (),
            Action.CLOSE,
            "all 2 live islands pushed (3 contributions)",
            {"a": LEASE},
        ),
        # c's presence call broke 0.5 s ago, inside the 1 s grace: still live (a blip may reconnect), so the round waits
        (50, SEEN_49, {"c": 49.5}, {"a", "b"}, (), Action.WAIT, "waiting for c", {}),
        # ... 2 s ago, past the grace and long before its lease (9 s left): lost, and the round closes without it
        (
            50,
            SEEN_49,
            {"c": 48.0},
            {"a", "b"},
            (),
            Action.CLOSE,
            "all 2 live islands pushed",
            {"c": f"{BROKE} 2.0s ago"},
        ),
        # a broken call and an expired lease: the lease is named (it is the older fact)
        (
            50,
            {**SEEN_49, "c": 30.0},
            {"c": 35.0},
            {"a", "b"},
            (),
            Action.CLOSE,
            "all 2 live islands pushed",
            {"c": LEASE},
        ),
        # below min_islands once c is gone: wait for a, however long
        (
            50,
            {"a": 49.0, "c": 45.0},
            {"c": 40.0},
            {"c"},
            (),
            Action.WAIT,
            "1 of min_islands=2 pushed; waiting for a",
            {"c": BROKE},
        ),
    ],
)
def test_decide(now, seen, broken, pushed, durations, action, reason, lost) -> None:
    view = RoundView(opened_at=0.0, last_seen=seen, pushed=frozenset(pushed), durations=durations, broken=broken)
    d = decide(now, view, CFG)
    assert d.action is action
    assert reason in d.reason
    assert set(d.lost) == set(lost) and d.live == frozenset(seen) - set(lost)
    for name, why in lost.items():
        assert why in d.lost[name], (name, d.lost[name])


FIVE = {n: 99.0 for n in "abcde"}


@pytest.mark.parametrize(
    ("min_islands", "seen", "pushed", "late", "action", "reason"),
    [
        # a fraction of the live islands, rounded up: half of 5 live is 3
        (0.5, FIVE, {"a", "b"}, set(), Action.WAIT, "2 of 3 (min_islands=0.5 of 5 live) pushed"),
        (0.5, FIVE, {"a", "b", "c"}, set(), Action.WAIT, "waiting for d, e (deadline in"),
        # the same fraction of a roster that shrank to 2: one push is enough once the other is not waited for
        (0.5, {"a": 99.0, "b": 99.0}, {"a"}, {"b"}, Action.CLOSE, "all 2 live islands pushed (1 contributions)"),
        # 1.0 is everyone live, however many that is
        (1.0, FIVE, {"a", "b", "c", "d"}, set(), Action.WAIT, "4 of 5 (min_islands=1.0 of 5 live) pushed"),
        # a count stays a count
        (2, FIVE, {"a", "b"}, set(), Action.WAIT, "waiting for c, d, e"),
        # a joiner that arrived without the round's θ is not waited for ...
        (2, FIVE, {"a", "b", "c", "d"}, {"e"}, Action.CLOSE, "all 5 live islands pushed (4 contributions)"),
        # ... though its push counts toward the quorum if it comes
        (2, {"a": 99.0, "e": 99.0}, {"a", "e"}, {"e"}, Action.CLOSE, "all 2 live islands pushed (2 contributions)"),
        # ... and the quorum still waits for pushes, naming the late ones when nobody else is left to wait for
        (2, {"a": 99.0, "e": 99.0}, {"a"}, {"e"}, Action.WAIT, "1 of min_islands=2 pushed; waiting for e"),
    ],
)
def test_quorum_scales_with_the_live_roster_and_never_waits_for_a_joiner(
    min_islands, seen, pushed, late, action, reason
) -> None:
    cfg = QuorumConfig(min_islands=min_islands, max_deadline_s=600)
    view = RoundView(opened_at=0.0, last_seen=seen, pushed=frozenset(pushed), late=frozenset(late))
    d = decide(100.0, view, cfg)
    assert (d.action, reason in d.reason) == (action, True), d.reason


@pytest.mark.parametrize(
    ("now", "seen", "pushed", "action", "reason"),
    [
        # a resumed coordinator waits for the island that took part before, though it has not joined yet ...
        (5.0, {"a": 4.0}, {"a"}, Action.WAIT, "waiting for b (deadline in"),
        # ... once it joined it is a member like any other
        (5.0, {"a": 4.0, "b": 4.5}, {"a", "b"}, Action.CLOSE, "all 2 live islands pushed"),
        # ... and a lease after the restart without a word from it, it is waited for no more
        (16.0, {"a": 15.5}, {"a"}, Action.CLOSE, "all 1 live islands pushed (1 contributions)"),
    ],
)
def test_a_restart_alone_drops_no_island_from_a_round(now, seen, pushed, action, reason) -> None:
    cfg = QuorumConfig(min_islands=1.0, lease_s=10.0, min_deadline_s=30.0, max_deadline_s=60.0)
    view = RoundView(opened_at=0.0, last_seen=seen, pushed=frozenset(pushed), awaited={"a": 0.0, "b": 0.0})
    d = decide(now, view, cfg)
    assert (d.action, reason in d.reason) == (action, True), d.reason
    assert d.live == frozenset(seen) and not d.lost  # awaited is no member: never counted live, never lost


def test_deadline_is_clamped_and_robust_to_one_outlier() -> None:
    assert adaptive_deadline([1, 1, 1, 1], CFG) == 5  # min clamp
    assert adaptive_deadline([500, 600, 700], CFG) == 100  # max clamp
    assert adaptive_deadline([10, 10, 11, 10, 90], CFG) == pytest.approx(10 + 3 * 0)  # MAD ignores one outlier


def test_quorum_config_validation() -> None:
    with pytest.raises(ValueError, match="quorum.min_islands must be >= 1"):
        QuorumConfig(min_islands=0)
    for fraction in (0.0, 1.5, -0.5):
        with pytest.raises(ValueError, match=r"as a fraction of the live islands must be in \(0, 1\]"):
            QuorumConfig(min_islands=fraction)
    with pytest.raises(ValueError, match="max_deadline_s must be >= quorum.min_deadline_s"):
        QuorumConfig(min_deadline_s=10, max_deadline_s=5)


def _pull(have, *, full=False, round_=5, done=False, pushed=True, arriving=False, last=4, kept=1) -> PullView:
    return PullView(
        have_round=have,
        full=full,
        round=round_,
        done=done,
        pushed=pushed,
        last_commit_round=last,
        arriving=arriving,
        kept=kept,
    )


@pytest.mark.parametrize(
    ("view", "kind", "reason"),
    [
        # the usual path: the island holds θ_4, round 4 was just committed here -> its update
        (_pull(4), PullKind.UPDATE, "update of round 4"),
        # it asked for everything, or holds nothing (new, restarted)
        (_pull(4, full=True), PullKind.FULL, "asked for"),
        (_pull(-1), PullKind.FULL, "holds no parameters"),
        # behind by two rounds: only the last update is kept
        (_pull(3), PullKind.FULL, "keeps only the last 1 update(s)"),
        # a coordinator restarted from its checkpoint has committed nothing since: full θ
        (_pull(4, last=None), PullKind.FULL, "keeps only the last 1 update(s)"),
        # streaming keeps one commit per fragment: an island whose overlapped merge lags one sync gets that sync's
        # update (which brings it to θ_4, and it asks again), not the whole θ; two behind with P = 2 is too far
        (_pull(3, kept=2), PullKind.UPDATE, "update of round 3"),
        (_pull(2, kept=2), PullKind.FULL, "keeps only the last 2 update(s)"),
        # an early push of the next fragment's sync (within the P syncs the coordinator holds): wait for it in turn;
        # one it never received, or beyond that window, means the coordinator went back: resync
        (_pull(6, kept=2), PullKind.WAIT, "queued behind round 5"),
        (_pull(6, kept=2, pushed=False), PullKind.RESYNC, "restarted at round 5"),
        (_pull(7, kept=2), PullKind.RESYNC, "restarted at round 5"),
        # its round is still open and it pushed: wait for the commit
        (_pull(5), PullKind.WAIT, "round 5 is still open"),
        # ... but it has not pushed (the coordinator restarted and lost the push): push first
        (_pull(5, pushed=False), PullKind.PUSH_FIRST, "no pseudo-gradient from the island"),
        # ... unless that push is still streaming in (the island asked as soon as its push was on the wire): its
        # outcome decides, so wait; the same for an early push of a later fragment's sync
        (_pull(5, pushed=False, arriving=True), PullKind.WAIT, "push for round 5 is still arriving"),
        (_pull(6, kept=2, pushed=False, arriving=True), PullKind.WAIT, "queued behind round 5"),
        # a push arriving for a position beyond the window does not make a coordinator that went back wait
        (_pull(7, kept=2, pushed=False, arriving=True), PullKind.RESYNC, "restarted at round 5"),
        # the run is complete: whoever holds the last round gets the full θ instead of waiting
        (_pull(5, done=True), PullKind.FULL, "full θ_5"),
        # ahead of a coordinator that restarted behind it: resync, never wait (it would deadlock)
        (_pull(7), PullKind.RESYNC, "restarted at round 5"),
        (_pull(7, full=True), PullKind.FULL, "asked for"),
    ],
)
def test_answer_pull(view, kind, reason) -> None:
    answer = answer_pull(view)
    assert answer.kind is kind
    assert reason in answer.reason
