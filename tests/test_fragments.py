"""Streaming DiLoCo's fragments and schedule (outer_optimizer/fragments.py): pure functions, checked as tables."""

from __future__ import annotations

import pytest

from outer_optimizer.fragments import (
    FragmentError,
    Fragments,
    check_schedule,
    merging_fragment,
    next_event,
    syncing_fragment,
)

# A 4-block model as the transformer names its leaves: 10 elements per block leaf, plus embeddings and a final norm.
SIZES = {f"blocks/{k}/{leaf}": 10 for k in range(4) for leaf in ("attn/wo", "ff/w1")}
SIZES |= {"embed/tok": 30, "embed/pos": 5, "final_norm/scale": 2}


def blocks_of(fragments: Fragments) -> list[list[int]]:
    return [sorted({int(n.split("/")[1]) for n in names if n.startswith("blocks/")}) for names in fragments.names]


@pytest.mark.parametrize(
    "count, layout, blocks",
    [
        (1, "strided", [[0, 1, 2, 3]]),
        (2, "strided", [[0, 2], [1, 3]]),  # each fragment spans the whole depth
        (4, "strided", [[0], [1], [2], [3]]),
        (2, "contiguous", [[0, 1], [2, 3]]),
    ],
)
def test_blocks_go_to_fragments_by_layout(count: int, layout: str, blocks: list[list[int]]) -> None:
    fragments = Fragments.split(SIZES, count, layout)
    assert blocks_of(fragments) == blocks
    every = [name for names in fragments.names for name in names]
    assert sorted(every) == sorted(SIZES), "every leaf in exactly one fragment"


def test_other_leaves_join_the_smallest_fragment_largest_first() -> None:
    # Blocks give 40 elements to each of 2 fragments; embed/tok (30) -> f0 (tie: the first), embed/pos (5) -> f1,
    # final_norm/scale (2) -> f1 (45 < 70).
    fragments = Fragments.split(SIZES, 2, "strided")
    assert [n for n in fragments.names[0] if not n.startswith("blocks/")] == ["embed/tok"]
    assert [n for n in fragments.names[1] if not n.startswith("blocks/")] == ["embed/pos", "final_norm/scale"]


@pytest.mark.parametrize(
    "count, layout, words",
    [(0, "strided", "must be >= 1"), (2, "diagonal", "stream.layout"), (9, "strided", "at most 7 parts")],
)
def test_impossible_splits_say_why(count: int, layout: str, words: str) -> None:
    with pytest.raises(FragmentError, match=words):
        Fragments.split(SIZES, count, layout)


# H = 4, P = 2 (S = 2): fragment 0 syncs after steps 2, 6, 10; fragment 1 after 4, 8, 12.
@pytest.mark.parametrize("step, syncing", [(0, None), (1, None), (2, 0), (3, None), (4, 1), (6, 0), (8, 1), (10, 0)])
def test_fragments_sync_in_turn(step: int, syncing: int | None) -> None:
    assert syncing_fragment(step, 4, 2) == syncing


@pytest.mark.parametrize("step, merging", [(2, None), (3, 0), (4, None), (5, 1), (7, 0)])
def test_a_fragment_is_merged_tau_steps_after_its_sync(step: int, merging: int | None) -> None:
    assert merging_fragment(step, 4, 2, overlap_steps=1) == merging


@pytest.mark.parametrize(
    "step, tau, event",
    [(0, 0, 2), (2, 0, 4), (0, 1, 2), (2, 1, 3), (3, 1, 4), (4, 1, 5), (0, 3, 2), (2, 3, 4), (4, 3, 5), (5, 3, 6)],
)
def test_training_stops_at_every_sync_and_every_merge(step: int, tau: int, event: int) -> None:
    assert next_event(step, 4, 2, tau) == event


@pytest.mark.parametrize(
    "H, P, tau, words",
    [(4, 2, 0, None), (4, 2, 3, None), (5, 2, 0, "multiple of stream.fragments"), (4, 2, 4, "overlap_steps")],
)
def test_schedules_that_cannot_run_say_why(H: int, P: int, tau: int, words: str | None) -> None:
    why = check_schedule(H, P, tau)
    assert (why is None) if words is None else (words in why)


def test_plain_diloco_is_one_fragment_synced_every_h_steps() -> None:
    fragments = Fragments.split(SIZES, 1)
    assert fragments.names == (tuple(sorted(SIZES)),)
    assert [s for s in range(1, 13) if syncing_fragment(s, 4, 1) is not None] == [4, 8, 12]
    assert [next_event(s, 4, 1, 0) for s in (0, 4, 5)] == [4, 8, 8]
