"""Table tests of an island's copy of the global θ (diloco/worker/global_copy.py): what a pulled commit does to it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from diloco.run.rounds import fragment_digest
from diloco.worker.global_copy import GlobalCopy, rolled_back
from floor.codec import CodecSpec, decode
from outer_optimizer.fragments import Fragments
from outer_optimizer.optimizers import apply_update
from pytrees.digest import tree_digest
from pytrees.encode import encode
from tests.reference_handler import fp32_tensor
from transport.handler import PullPayload

LIKE = {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}
THETA = {"a": np.array([1, 2], np.float32), "b": np.array([3, 4, 5], np.float32)}
U = {"a": np.array([0.5, -1], np.float32), "b": np.array([1, 1, 1], np.float32)}
"""An update û of every leaf; θ + û is exact in float32."""
WHOLE = Fragments.whole(["a", "b"])
SPLIT = Fragments((("a",), ("b",)))


def plus(theta: dict[str, np.ndarray], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {n: theta[n] + U[n] if n in names else theta[n] for n in theta}


def payload(kind: str, round_: int, fragment: int, arrays: dict[str, np.ndarray], digest: str) -> PullPayload:
    tensors = [fp32_tensor(n, a) for n, a in sorted(arrays.items())]
    return PullPayload(round_, fragment, kind, bytes.fromhex(digest), tensors)  # type: ignore[arg-type]


def at(fragments: Fragments, position: int) -> GlobalCopy:
    return GlobalCopy.whole(fragments, LIKE, THETA, position)


FULL = payload("full", 3, 0, THETA, tree_digest(THETA))
PLAIN_U = {n: U[n] for n in ("a", "b")}
PLAIN_NEXT = tree_digest(plus(THETA, ("a", "b")))
A_NEXT = tree_digest({"a": THETA["a"] + U["a"]})
WRONG = "00" * 16


@pytest.mark.parametrize(
    ("copy", "pulled", "position", "theta"),
    [
        # the full θ: taken at its position, whatever the copy held (none yet, or another round)
        (GlobalCopy(WHOLE, LIKE), FULL, 3, THETA),
        (at(WHOLE, 7), FULL, 3, THETA),
        (GlobalCopy(SPLIT, LIKE), FULL, 6, THETA),  # with P = 2 round 3 is position 6
        # ... unless it fails its digest
        (GlobalCopy(WHOLE, LIKE), payload("full", 3, 0, THETA, WRONG), None, None),
        # plain rounds: û of the next round, proved by θ's digest
        (at(WHOLE, 2), payload("update", 3, 0, PLAIN_U, PLAIN_NEXT), 3, plus(THETA, ("a", "b"))),
        (at(WHOLE, 2), payload("update", 3, 0, PLAIN_U, WRONG), None, None),
        (at(WHOLE, 1), payload("update", 3, 0, PLAIN_U, PLAIN_NEXT), None, None),  # a round skipped
        (at(WHOLE, 3), payload("update", 3, 0, PLAIN_U, PLAIN_NEXT), None, None),  # already there
        (GlobalCopy(WHOLE, LIKE), payload("update", 0, 0, PLAIN_U, PLAIN_NEXT), None, None),  # nothing to add to
        (at(WHOLE, 2), payload("update", 3, 0, {"a": U["a"]}, PLAIN_NEXT), None, None),  # a leaf missing
        # streaming: fragment 0's û moves position 4 (round 2, fragment 0) to 5, proved by that fragment's digest
        (at(SPLIT, 4), payload("update", 2, 1, {"a": U["a"]}, A_NEXT), 5, plus(THETA, ("a",))),
        (at(SPLIT, 4), payload("update", 2, 1, {"a": U["a"]}, WRONG), None, None),
        (at(SPLIT, 4), payload("update", 2, 1, {"b": U["b"]}, A_NEXT), None, None),  # another fragment's leaves
        (at(SPLIT, 5), payload("update", 2, 1, {"a": U["a"]}, A_NEXT), None, None),  # not the next position
    ],
)
def test_apply(copy: GlobalCopy, pulled: PullPayload, position: int | None, theta: dict | None) -> None:
    before = (copy.position, copy.digests)
    moved = copy.apply(pulled)
    assert (copy.position, copy.digests) == before  # a value: applying makes a new copy
    if position is None:
        assert moved is None
        return
    assert moved is not None and moved.position == position
    assert {n: moved.params[n].tolist() for n in moved.params} == {n: theta[n].tolist() for n in theta}
    assert moved.digests == GlobalCopy.whole(copy.fragments, LIKE, theta, position).digests


def test_a_streaming_update_changes_only_its_fragments_digest() -> None:
    copy = at(SPLIT, 4)
    moved = copy.apply(payload("update", 2, 1, {"a": U["a"]}, A_NEXT))
    assert moved is not None
    assert moved.digests == (A_NEXT, copy.digests[1])
    assert (copy.round, moved.round) == (2, 2)
    assert moved.fragment(1)["b"] is copy.fragment(1)["b"]  # the other fragment's leaves are not touched


@pytest.mark.parametrize(
    ("copy", "pulled", "applied"),
    [
        (at(SPLIT, 4), payload("update", 2, 1, {"a": U["a"]}, A_NEXT), True),
        (at(SPLIT, 4), payload("update", 2, 1, {"a": U["a"]}, WRONG), False),  # fails the digest
        (at(SPLIT, 4), FULL, False),  # not an update
        (GlobalCopy(SPLIT, LIKE), payload("update", 2, 1, {"a": U["a"]}, A_NEXT), False),  # no copy yet
        (at(WHOLE, 2), payload("update", 3, 0, PLAIN_U, PLAIN_NEXT), False),  # plain rounds apply it in `apply`
    ],
)
def test_ready_applies_a_streaming_update_ahead(copy: GlobalCopy, pulled: PullPayload, applied: bool) -> None:
    ready = copy.ready(pulled)
    assert (ready is not None) == applied
    if ready is not None:
        assert ready.position == 5 and ready.leaves["a"].tolist() == (THETA["a"] + U["a"]).tolist()


def test_apply_takes_a_ready_update_as_it_is_while_the_copy_holds_its_base() -> None:
    copy = at(SPLIT, 4)
    pulled = payload("update", 2, 1, {"a": U["a"]}, A_NEXT)
    ready = copy.ready(pulled)
    assert ready is not None
    taken = copy.apply(pulled, ready)
    assert taken is not None and taken.params["a"] is ready.leaves["a"]
    # The copy moved on (a restart from the full θ, equal values but new leaves): the update is redone on it.
    other = GlobalCopy.whole(SPLIT, LIKE, {n: v.copy() for n, v in THETA.items()}, 4)
    redone = other.apply(pulled, ready)
    assert redone is not None and redone.params["a"] is not ready.leaves["a"]
    assert redone.params["a"].tolist() == taken.params["a"].tolist()


@pytest.mark.parametrize(
    ("held", "taken", "back"),
    [
        (GlobalCopy(WHOLE, LIKE), at(WHOLE, 3), False),  # nothing held yet
        (at(WHOLE, 3), at(WHOLE, 3), False),  # the θ it held, taken again (a restart's full pull)
        (at(WHOLE, 2), at(WHOLE, 3), False),  # a lagging copy moved on
        (at(WHOLE, 4), at(WHOLE, 3), True),  # an earlier round: its commit of round 3 is forgotten
        (at(WHOLE, 3), GlobalCopy.whole(WHOLE, LIKE, plus(THETA, ("a",)), 3), True),  # round 3 with another θ
        (at(SPLIT, 5), at(SPLIT, 4), True),  # streaming: an earlier sync position
    ],
)
def test_rolled_back_says_when_a_full_theta_undoes_held_commits(
    held: GlobalCopy, taken: GlobalCopy, back: bool
) -> None:
    assert rolled_back(held, taken) is back


def test_an_update_sent_at_a_density_the_run_does_not_send_does_not_prove_out() -> None:
    """A sparse commit's density is a wire field (its header): the copy takes an update sent with a spec the run
    sends (`RunConfig.downlink_specs`) and refuses, as an update that does not prove out, one sent with another even
    when its digest is right (the island then pulls the full θ)."""
    run = CodecSpec("sparse", 2, density=0.5, sparse_bits=8)
    copy = replace(at(WHOLE, 0), downlink=(run,))
    for spec, taken in ((run, True), (run.union(2, 0.5), False)):
        tensors = [encode(n, U[n], spec) for n in sorted(U)]
        new = {**THETA, **apply_update(THETA, {t.name: decode(t) for t in tensors})}
        pulled = PullPayload(1, 0, "update", bytes.fromhex(fragment_digest(WHOLE, new, 0)), tensors)
        moved = copy.apply(pulled)
        assert (moved is not None) == taken, spec
        assert replace(copy, downlink=()).apply(pulled) is not None  # well formed: only the run's specs refuse it
