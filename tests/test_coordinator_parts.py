"""The coordinator's parts on their own, without sockets, threads or a run directory: push admission (duplicates,
drops, early pushes, undo), the commit window (eviction, undo) and the membership table."""

from __future__ import annotations

import grpc
import numpy as np
import optax
import pytest

from diloco.coordinator.commit_window import CommitWindow
from diloco.coordinator.push_admission import AsyncUpdates, PushAdmission, SyncRounds, contribution_digest
from diloco.coordinator.roster import Roster
from diloco.run.rounds import OuterLoop, fragment_digests
from floor.codec import CodecSpec
from outer_optimizer.fragments import Fragments
from pytrees.digest import tree_digest
from pytrees.encode import encode_named
from transport import diloco_pb2 as pb
from transport.errors import Rejected

PARAMS = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}


def loop_of(fragments: int = 1) -> OuterLoop:
    split = Fragments.whole(sorted(PARAMS)) if fragments == 1 else Fragments((("a",), ("b",)))
    return OuterLoop.fresh(dict(PARAMS), optax.sgd(1.0), CodecSpec(kind="fp32"), fragments=split)


def admission(rule: SyncRounds | AsyncUpdates | None = None, remembered: int = 16) -> PushAdmission:
    return PushAdmission(rule or SyncRounds(), max_tokens=100, remembered=remembered)


def meta(island: str, round_: int = 0, fragment: int = 0, tokens: int = 10, base: str = "") -> pb.PushMeta:
    return pb.PushMeta(
        island=island, round=round_, fragment=fragment, tokens=tokens, loss=1.0, base_digest=bytes.fromhex(base)
    )


def admit(
    adm: PushAdmission, loop: OuterLoop, island: str, fill: float, fragment: int = 0, round_: int = 0, tokens: int = 10
) -> bytes:
    """One push through `place` and `enter`, as the coordinator makes it; returns its payload digest."""
    names = loop.fragments.names[fragment]
    arrays = {n: np.full(PARAMS[n].shape, fill, np.float32) for n in names}
    tensors = encode_named(arrays, CodecSpec(kind="fp32"))
    digest = bytes([int(fill * 10) % 256]) * 32
    digests = fragment_digests(loop.fragments, loop.params, tree_digest(loop.params))
    m = meta(island, round_, fragment, tokens, digests[fragment])
    admitted = adm.place(m, tensors, arrays, digest, loop, lambda mm: digests[mm.fragment])
    adm.enter(admitted, loop)
    adm.remember(admitted.key, digest, pb.PushReply(accepted=True, round=loop.round, detail="accepted"))
    return digest


def refused(call, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(Rejected) as info:
        call()
    assert info.value.code == code and words in info.value.reason, info.value


# -- push admission ---------------------------------------------------------------------------------------------


def test_a_retry_is_answered_as_before_and_another_payload_under_its_key_is_refused() -> None:
    adm, loop = admission(), loop_of()
    digest = admit(adm, loop, "i0", 0.1)
    reply = adm.replay(meta("i0"), digest)
    assert reply is not None and reply.accepted and reply.digest == digest
    refused(lambda: adm.replay(meta("i0"), b"x" * 32), grpc.StatusCode.ALREADY_EXISTS, "different payload")
    assert adm.replay(meta("i1"), digest) is None  # another island's key


def test_an_accepted_key_stays_admissible_after_its_round_closed_and_a_new_one_does_not() -> None:
    adm, loop = admission(), loop_of()
    admit(adm, loop, "i0", 0.1)
    loop.commit()
    adm.opened(loop)
    adm.admissible(meta("i0", round_=0), loop)  # its retry is answered by `replay`
    refused(lambda: adm.admissible(meta("i1", round_=0), loop), grpc.StatusCode.FAILED_PRECONDITION, "is stale")
    refused(lambda: adm.admissible(meta("i1", round_=2), loop), grpc.StatusCode.FAILED_PRECONDITION, "in the future")


def test_a_dropped_contribution_is_refused_again_and_its_island_may_push_a_new_one() -> None:
    adm, loop = admission(), loop_of()
    digest = admit(adm, loop, "i0", 0.5)
    loop.withdraw("i0")
    adm.drop("i0", "cannot be encoded")
    assert adm.replay(meta("i0"), digest) is None, "a cached reply outlived the drop"
    refused(lambda: admit(adm, loop, "i0", 0.5), grpc.StatusCode.FAILED_PRECONDITION, "was dropped: cannot be encoded")
    admit(adm, loop, "i0", 0.2)
    assert loop.pending == ("i0",)


def test_the_claimed_token_weight_is_capped() -> None:
    adm, loop = admission(), loop_of()
    admit(adm, loop, "i0", 0.1, tokens=10**9)
    assert loop._pending["i0"].tokens == 100


def test_a_second_contribution_to_one_sync_is_already_exists() -> None:
    adm, loop = admission(), loop_of()
    admit(adm, loop, "i0", 0.1)
    adm.accepted.forget(("i0", 0, 0))  # as if the reply had fallen out of the cache
    refused(lambda: admit(adm, loop, "i0", 0.3), grpc.StatusCode.ALREADY_EXISTS, "already contributed")


@pytest.mark.parametrize(
    ("round_", "fragment", "words"),
    [(0, 1, None), (1, 0, "round 1 fragment 0 but round 0 fragment 0 is open"), (2, 1, "round 2 fragment 1")],
)
def test_streaming_pushes_for_the_syncs_after_the_open_one_wait_for_it(round_: int, fragment: int, words) -> None:
    adm, loop = admission(), loop_of(fragments=2)
    if words is not None:
        refused(lambda: admit(adm, loop, "i0", 0.1, fragment, round_), grpc.StatusCode.FAILED_PRECONDITION, words)
        return
    admit(adm, loop, "i0", 0.1, fragment=1)
    assert loop.pending == () and set(adm.early) == {1}
    admit(adm, loop, "i1", 0.1, fragment=0)
    loop.commit()
    assert adm.opened(loop) == [] and loop.pending == ("i0",) and adm.early == {}


def test_undo_restores_the_reopened_sync_and_forgets_later_pushes() -> None:
    adm, loop = admission(), loop_of(fragments=2)
    admit(adm, loop, "i0", 0.1, fragment=0)
    restore = adm.snapshot()
    loop.commit()
    adm.opened(loop)
    admit(adm, loop, "i1", 0.2, fragment=1)
    adm.undo_to(restore, position=0, fragments=2)
    assert set(adm.pending) == {"i0"} and ("i0", 0, 0) in adm.accepted
    assert ("i1", 0, 1) not in adm.accepted, "a push of an undone sync is remembered"


def test_an_asynchronous_push_is_weighted_by_its_staleness_and_refused_beyond_the_bound() -> None:
    loop = loop_of()
    adm = admission(AsyncUpdates(max_staleness=1, exponent=1.0))
    digests = {0: "aa" * 16, 1: "bb" * 16, 2: "cc" * 16}
    arrays = {n: np.ones(PARAMS[n].shape, np.float32) for n in PARAMS}
    tensors = encode_named(arrays, CodecSpec(kind="fp32"))

    def place(round_: int, base: str):
        return adm.place(
            meta("i0", round_, base=base), tensors, arrays, b"d" * 32, loop, lambda m: digests.get(m.round)
        )

    def advance() -> None:
        loop.submit("i9", loop.round, arrays, 1)
        loop.commit()

    advance()  # update 1 is open
    placed = place(0, digests[0]).placement
    assert (placed.position, placed.staleness, placed.weight) == (1, 1, 0.5)
    refused(lambda: place(2, digests[2]), grpc.StatusCode.FAILED_PRECONDITION, "ahead of the coordinator")
    refused(lambda: place(1, digests[0]), grpc.StatusCode.FAILED_PRECONDITION, "was not taken from θ_1")
    advance()
    refused(lambda: place(0, digests[0]), grpc.StatusCode.FAILED_PRECONDITION, "over outer.max_staleness = 1")


def test_the_contribution_digest_names_island_tensors_and_payload() -> None:
    tensors = encode_named({"a": np.ones(4, np.float32)}, CodecSpec(kind="fp32"))
    base = contribution_digest("i0", tensors, b"p" * 32)
    assert len(base) == 16
    assert base != contribution_digest("i1", tensors, b"p" * 32)
    assert base != contribution_digest("i0", tensors, b"q" * 32)


def test_the_cache_of_accepted_pushes_is_bounded() -> None:
    adm, loop = admission(remembered=2), loop_of()
    for i in range(3):
        admit(adm, loop, f"i{i}", 0.1 * (i + 1))
    assert ("i0", 0, 0) not in adm.accepted and ("i2", 0, 0) in adm.accepted


# -- commit window ----------------------------------------------------------------------------------------------


def test_the_commit_window_keeps_the_last_commits_and_undoes_from_a_position() -> None:
    loop = loop_of()
    window = CommitWindow(kept=2, position=0, digest=tree_digest(loop.params))
    for position in range(3):
        loop.submit("i0", loop.round, {n: np.full(PARAMS[n].shape, 0.1, np.float32) for n in PARAMS}, 1)
        window.add(position, loop.commit())
    assert sorted(window.commits) == [1, 2] and sorted(window.streams) == [1, 2]
    assert sorted(window.digests) == [2, 3] and window.last_position == 2
    assert window.served_to("i0", 2) and window.was_served("i0", 2)
    assert not window.served_to("i0", 0), "a commit out of the window is remembered as served"
    window.undo_from(2)
    assert sorted(window.commits) == [1] and window.served == {} and sorted(window.digests) == [2]


# -- membership table -------------------------------------------------------------------------------------------


def test_the_roster_applies_joins_beats_breaks_leaves_and_losses() -> None:
    roster = Roster()
    assert roster.join("i0", 1.0) and not roster.join("i0", 2.0)
    roster.broke("i1", 2.0)  # not a member: nothing to break
    assert roster.broken == {} and roster.seen_ago("i1", 3.0) == -1.0
    roster.broke("i0", 3.0)
    assert roster.round_view(0.0, (), ()).broken == {"i0": 3.0}
    assert roster.beat("i0", 4, 4.0) and not roster.beat("i0", 4, 4.5)
    assert roster.broken == {}, "a heartbeat forgives a broken presence call"
    assert roster.moved_past("i0", 3) and not roster.moved_past("i0", 4)
    roster.pushed("i1", 2.5, 5.0)
    assert roster.live == ["i0", "i1"] and roster.losses(["i0", "i1"]) == [2.5]
    roster.lose(["i1"], 5.0)
    assert "i1" not in roster and roster.leave("i0", 6.0) and not roster.leave("i0", 6.0) and len(roster) == 0
    assert roster.gone == {"i1": 5.0, "i0": 6.0}, "whoever stops being a member is gone from then on"


def test_the_roster_knows_who_joined_a_sync_late_and_who_is_gone_for_retirement() -> None:
    roster = Roster()
    roster.expect(["a", "b", "c"], 0.0)
    assert roster.gone == {"a": 0.0, "b": 0.0, "c": 0.0}
    roster.join("a", 1.0)
    roster.join("b", 2.0, late_for=7)  # arrived in sync 7 without θ_7
    assert roster.round_view(0.0, (), (), sync=7).late == {"b"}
    assert roster.round_view(0.0, (), (), sync=8).late == frozenset(), "only the sync it arrived in"
    roster.join("b", 3.0)  # a join that holds the open sync's θ is waited for again
    assert roster.round_view(0.0, (), (), sync=7).late == frozenset()
    assert roster.gone == {"c": 0.0} and roster.round_view(0.0, (), ()).awaited == {"c": 0.0}, "awaited till it joins"
    assert not roster.retire("c") and roster.gone == {}, "a retired island is not gone: it is no island any more"
    assert roster.awaited == {}, "nor awaited"
    roster.beat("a", 4, 4.0)
    roster.pushed("a", 2.5, 5.0)
    assert roster.retire("a") and "a" not in roster and "a" not in roster.gone
    assert "a" not in roster.working and "a" not in roster.last_loss, "nothing of a retired island is kept"
