"""`diloco bench sync`'s critical path, by hand: which island's sync waits for nobody, and where its time went."""

from __future__ import annotations

import pytest

from diloco.bench.sync import critical_path

pytestmark = pytest.mark.timeout(30)


def _start(round_: int, sync: float, encode: float, waited: float, adopt: float) -> dict:
    return {"round": round_, "sync_s": sync, "encode_s": encode, "waited_s": waited, "adopt_s": adopt}


def test_the_last_island_to_push_is_each_rounds_critical_path() -> None:
    pushes = [  # the coordinator's arrival order: b last in round 1, a last in round 2
        {"round": 0, "island": "a"},
        {"round": 0, "island": "b"},
        {"round": 1, "island": "a"},
        {"round": 1, "island": "b"},
        {"round": 2, "island": "b"},
        {"round": 2, "island": "a"},
    ]
    starts = {
        "a": [_start(1, 9.0, 0.1, 8.0, 0.2), _start(2, 2.0, 0.1, 1.5, 0.2), _start(3, 0.5, 0.05, 0.3, 0.1)],
        "b": [_start(1, 9.0, 0.1, 8.0, 0.2), _start(2, 0.6, 0.1, 0.35, 0.1), _start(3, 1.9, 0.1, 1.6, 0.1)],
    }
    pushed = {
        "a": [{"round": r, "push_s": 0.1} for r in range(3)],
        "b": [{"round": 0, "push_s": 0.1}, {"round": 1, "push_s": 0.25}, {"round": 2, "push_s": 0.1}],
    }
    rows = critical_path(pushes, starts, pushed)
    # Round 0 compiles and is left out. Round 1: b pushed last; its train_start of round 2 holds the sync.
    assert [(r["round"], r["island"], r["sync_s"]) for r in rows] == [(1, "b", 0.6), (2, "a", 0.5)]
    b = rows[0]
    assert (b["encode"], b["push"], b["pull"], b["adopt"]) == pytest.approx((0.1, 0.25, 0.35 - 0.25, 0.1))
    assert b["rest"] == pytest.approx(0.6 - 0.1 - 0.35 - 0.1)  # encode + waited (push + pull) + adopt, then the rest


def test_a_round_without_its_events_is_left_out() -> None:
    pushes = [{"round": 1, "island": "a"}, {"round": 2, "island": "a"}]
    starts = {"a": [_start(2, 0.5, 0.1, 0.3, 0.1)]}  # no train_start of round 3: the run ended
    pushed = {"a": [{"round": 1, "push_s": 0.1}]}  # no pushed of round 2: refused
    assert [r["round"] for r in critical_path(pushes, starts, pushed)] == [1]
