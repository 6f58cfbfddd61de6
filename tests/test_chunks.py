"""Chunked sampling (data.sampling = "chunks"): the corpus consumed exactly once, whatever islands join and leave.

The ledger's rules as tables of cases (diloco/run/chunk_ledger.py), the island's stream over its leases
(islands/chunks.py), the checker over a run's records, the coordinator's refusals of hostile leases and claims, and
whole runs: `simulate` (with a resume), and real processes where an island is SIGKILLed at a named point and comes
back and another is retired, checked from the run's own metrics.jsonl.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

import diloco.coordinator.settler as settler_module
from diloco.config import ConfigError, load_config
from diloco.coordinator.chunk_leases import chunk_status
from diloco.coordinator.coordinator import Coordinator
from diloco.run.chunk_ledger import (
    BEYOND_END,
    INVALID,
    NOT_LEASED,
    OUT_OF_ORDER,
    ChunkLedger,
    ChunkRefused,
    ConsumptionCheck,
    consumption,
)
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import build_setup
from diloco.simulator.simulate import run_simulation
from floor.codec import CodecSpec
from islands.chunks import ChunkLayout, ChunkStream, Span
from islands.data import DataError
from pytrees.encode import encode_named
from pytrees.naming import flatten_named
from tests.conftest import cut_after_round
from transport import diloco_pb2 as pb
from transport.chunking import payload_digest
from transport.errors import Rejected

CHUNKS = ["data.sampling=chunks", "data.chunk_sequences=20"]


def ledger(sequences: int = 100, chunk: int = 10, homes: tuple[str, ...] = ("a", "b"), most: int = 25) -> ChunkLedger:
    return ChunkLedger(ChunkLayout(sequences, chunk, seed=0), homes, most)


def spans(*triples: tuple[int, int, int]) -> list[Span]:
    return [Span(*t) for t in triples]


# -- the layout and the stream ---------------------------------------------------------------------------------


def test_the_layout_cuts_each_epochs_order_into_chunks() -> None:
    layout = ChunkLayout(sequences=25, chunk_sequences=10, seed=3)
    assert layout.chunks == 3 and [layout.size(c) for c in range(6)] == [10, 10, 5, 10, 10, 5]
    epoch0 = np.concatenate([layout.sequence_ids(Span(c, 0, layout.size(c))) for c in range(3)])
    epoch1 = np.concatenate([layout.sequence_ids(Span(c, 0, layout.size(c))) for c in range(3, 6)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(25)) and list(epoch0) != list(epoch1)
    with pytest.raises(DataError, match="no whole sequence"):
        ChunkLayout(0, 10, 0)


def test_a_chunk_stream_reads_its_plan_in_order_and_says_what_it_took() -> None:
    layout = ChunkLayout(sequences=30, chunk_sequences=10, seed=0)
    tokens = np.arange(30 * 5, dtype=np.int32)  # seq_len 4: sequence s is tokens 5s .. 5s + 4
    stream = ChunkStream(tokens, layout, batch_size=4, seq_len=4)
    stream.begin(spans((0, 7, 10), (2, 0, 10)))
    first, second = stream.next(), stream.next()
    expected = np.concatenate([layout.sequence_ids(Span(0, 7, 10)), layout.sequence_ids(Span(2, 0, 5))])
    assert [row[0] // 5 for row in np.concatenate([first, second])] == list(expected)
    assert all((row == row[0] + np.arange(5)).all() for row in first)
    assert stream.taken() == spans((0, 7, 10), (2, 0, 5))
    stream.next()
    with pytest.raises(DataError, match="hold 13 sequences"):
        stream.next()


def test_each_push_claims_what_was_read_since_the_previous_one() -> None:
    layout = ChunkLayout(sequences=30, chunk_sequences=10, seed=0)
    stream = ChunkStream(np.zeros(30 * 5, np.int32), layout, batch_size=3, seq_len=4)
    stream.begin(spans((0, 7, 10), (2, 0, 10)))
    stream.next()
    assert stream.claim() == spans((0, 7, 10))
    stream.next(), stream.next()
    assert stream.claim() == spans((2, 0, 6)) and stream.claim() == []  # claimed once
    assert stream.taken() == spans((0, 7, 10), (2, 0, 6))  # what the whole plan read, for the checkpoint
    stream.begin(spans((2, 6, 10)))
    stream.next()
    assert stream.claim() == spans((2, 6, 9))


# -- the ledger's rules ----------------------------------------------------------------------------------------


def test_leases_take_home_chunks_then_others_then_the_next_epoch() -> None:
    book = ledger(sequences=40, chunk=10, most=25)  # 4 chunks: a's home 0, 2; b's home 1, 3
    assert book.lease("a", 25) == spans((0, 0, 10), (2, 0, 10), (3, 0, 5))  # a's home used up: b's, from the back
    assert book.lease("a", 25) == spans((0, 0, 10), (2, 0, 10), (3, 0, 5))  # asking again changes nothing
    assert book.lease("b", 10) == spans((1, 0, 10))
    assert book.lease("joiner", 5) == spans((6, 0, 5))  # no fresh chunk left: epoch 1, from the back of a home
    assert book.epoch == 1 and book.held("a") == [0, 2, 3]


@pytest.mark.parametrize(
    ("claim", "kind", "words"),
    [
        (spans((1, 0, 10)), NOT_LEASED, "leased to island b, not to a"),  # claimed twice: another island's chunk
        (spans((3, 0, 5)), NOT_LEASED, "leased to no island"),
        (spans((0, 0, 11)), BEYOND_END, "position 11 is beyond the end of chunk 0"),
        (spans((0, 2, 5)), OUT_OF_ORDER, "skipping sequences 0 to 1"),
        (spans((0, 0, 5), (0, 5, 6)), INVALID, "named twice"),
        (spans((0, 3, 3)), INVALID, "is empty"),
        (spans((-1, 0, 1)), INVALID, "does not exist"),
        (spans((99, 0, 1)), NOT_LEASED, "chunk 99 is of epoch 24, which is not open"),
        ([], INVALID, "names no chunk span"),
        (spans(*[(0, 0, 1)] * 26), INVALID, "at most 25"),
    ],
)
def test_a_claim_is_refused_with_its_reason_and_changes_nothing(claim: list[Span], kind: str, words: str) -> None:
    book = ledger(sequences=40, chunk=10, most=25)
    book.lease("a", 20)
    book.lease("b", 10)
    before = book.to_meta()
    with pytest.raises(ChunkRefused) as info:
        book.record("a", 0, claim)
    assert info.value.kind == kind and words in info.value.reason, info.value.reason
    assert book.to_meta() == before and book.position(0) == 0


def test_a_lease_into_an_epoch_a_restart_undid_is_refused_as_not_leased_and_leased_again() -> None:
    """An island's lease opened epoch 1 after the checkpoint a restarted coordinator resumed from: its push of
    those spans is a state it lags (FAILED_PRECONDITION, so it leases again), not a malformed request that ends it."""
    book = ledger(sequences=40, chunk=10, most=25)
    book.lease("a", 20)
    book.record("a", 0, spans((0, 0, 10), (2, 0, 10)))
    book.commit(0, ["a"])
    saved = book.to_meta()
    book.lease("b", 20)  # chunks 1 and 3: epoch 0 is used up
    undone = book.lease("a", 10)
    assert book.epoch == 1 and undone == spans((4, 0, 10))
    book.restore(saved)  # the coordinator restarted from the checkpoint of sync 0
    with pytest.raises(ChunkRefused, match="chunk 4 is of epoch 1, which is not open") as info:
        book.record("a", 1, undone)
    assert info.value.kind == NOT_LEASED and chunk_status(info.value) == grpc.StatusCode.FAILED_PRECONDITION
    again = book.lease("a", 10)
    book.record("a", 1, again)
    assert again[0].chunk < 4 and book.commit(1, ["a"]) == {"a": again}


def test_a_span_already_pending_or_consumed_is_refused() -> None:
    book = ledger()
    book.lease("a", 15)
    book.record("a", 0, spans((0, 0, 10), (2, 0, 5)))
    with pytest.raises(ChunkRefused, match="consumed or pending already") as info:
        book.record("a", 0, spans((2, 0, 5)))  # the same push again: nothing counted twice
    assert info.value.kind == OUT_OF_ORDER
    assert book.commit(0, ["a"]) == {"a": spans((0, 0, 10), (2, 0, 5))} and book.consumed == 15
    with pytest.raises(ChunkRefused, match="consumed or pending already"):
        book.record("a", 1, spans((2, 4, 6)))


@pytest.mark.parametrize(
    ("after", "positions", "consumed", "next_read"),
    [
        ("commit", {0: 0, 2: 5}, 15, (2, 5, 10)),  # chunk 0 consumed whole: forgotten (its position reads 0)
        ("drop", {0: 0, 2: 0}, 0, (0, 0, 5)),  # a dropped contribution: its reader reads the same sequences again
        ("commit_without", {0: 0, 2: 0}, 0, (0, 0, 5)),  # a round kept without it
        ("undo_later", {0: 10, 2: 5}, 0, (2, 5, 10)),  # a later round undone: round 0's spans stay pending
    ],
)
def test_what_becomes_of_pending_spans(
    after: str, positions: dict[int, int], consumed: int, next_read: tuple[int, int, int]
) -> None:
    book = ledger()
    book.lease("a", 15)
    book.record("a", 0, spans((0, 0, 10), (2, 0, 5)))
    {
        "commit": lambda: book.commit(0, ["a"]),
        "drop": lambda: book.drop("a", 0),
        "commit_without": lambda: book.commit(0, ["b"]),
        "undo_later": lambda: book.undo_after(0),
    }[after]()
    assert {c: book.position(c) for c in (0, 2)} == positions and book.consumed == consumed
    assert book.lease("a", 5) == spans(next_read)


def test_a_released_island_s_chunks_go_to_the_next_reader_once_nothing_is_pending() -> None:
    book = ledger()
    book.lease("a", 15)  # chunks 0, 2
    book.record("a", 0, spans((0, 0, 10), (2, 0, 3)))
    book.release("a")  # retired: its push of round 0 still counts
    assert book.lease("b", 10) == spans((1, 0, 10))  # chunk 2 waits for round 0
    book.commit(0, ["a"])
    assert book.lease("joiner", 10) == spans((2, 3, 10), (9, 0, 3))  # the remainder first, then fresh
    with pytest.raises(ChunkRefused, match="leased to island joiner"):
        book.record("a", 1, spans((2, 3, 5)))  # the retired island's stale claim


def test_a_lease_over_returned_remainders_stays_a_claim_the_ledger_takes() -> None:
    """Islands that leave mid-chunk return short remainders; a lease may gather many of them, and its push is still
    within what one round may name."""
    book = ledger(sequences=200, chunk=10, homes=("a", "b", "c", "d", "e"), most=25)
    for island in "bcde":
        book.record(island, 0, book.lease(island, 7))
    book.commit(0, "bcde")
    for island in "bcde":
        book.release(island)  # gone with 3 sequences of its chunk unread
    plan = book.lease("a", 25)
    assert [s.length for s in plan] == [3, 3, 3, 3, 10, 3] and len(plan) <= book.max_spans
    book.record("a", 9, plan)
    assert sum(s.length for s in book.commit(9, ["a"])["a"]) == 25


def test_the_ledger_survives_a_restart_without_its_pending_spans() -> None:
    book = ledger()
    book.lease("a", 15)
    book.record("a", 0, spans((0, 0, 10), (2, 0, 5)))
    book.commit(0, ["a"])
    book.record("a", 1, spans((2, 5, 10)))  # pending when the checkpoint is taken: not saved
    again = ledger()
    again.restore(json.loads(json.dumps(book.to_meta())))
    assert again.lease("a", 5) == spans((2, 5, 10)) and again.consumed == 15


def read_rounds(book: ChunkLedger, islands: tuple[str, ...], rounds: int, first: int = 0) -> list[dict]:
    """`rounds` rounds in which every island leases as much as it may, pushes it and the round is kept: the
    `chunks_consumed` records they leave."""
    records = []
    for r in range(first, first + rounds):
        for island in islands:
            book.record(island, r, book.lease(island, book.max_sequences))
        got = book.commit(r, islands)
        records.append(
            {"event": "chunks_consumed", "round": r, "spans": {k: [s.as_list() for s in v] for k, v in got.items()}}
        )
    return records


STREAM_FAULTS = ["none", "refused", "dropped", "killed", "overlap", "overlap_dropped"]


def streaming_run(fault: str, rounds: int = 5) -> tuple[ChunkLedger, list[dict]]:
    """Two islands a and b in Streaming DiLoCo's schedule over one ledger (H = 4, P = 2, batch 2: each fragment's
    push claims S = 2 batches, 4 sequences), as IslandWorker and the coordinator do it: a lease at each round's start
    (with overlap, before the round's last sync is kept) and after a restart for the steps left of the round, one
    claim per push, a sync kept with the pushes it holds. `fault` strikes island a in round 1: its push of sync 2 is
    refused on arrival or dropped at commit, a is killed there (and back in round 3), or (overlap_dropped) its push
    of round 1's last sync is dropped after it leased round 2. Returns the ledger and the `chunks_consumed` records."""
    H, P, B = 4, 2, 2
    S = H // P
    book = ledger(sequences=100, chunk=10, most=H * B)
    streams = {name: ChunkStream(np.zeros(100 * 5, np.int32), book.layout, B, 4) for name in "ab"}
    due, alive = {"a": True, "b": True}, {"a", "b"}
    overlap = fault.startswith("overlap")
    records: list[dict] = []
    for r in range(rounds):
        if fault == "killed" and r == 3:  # back: a new process leases before it trains
            alive.add("a")
            due["a"] = True
        for p in range(P):
            sync, pushed = r * P + p, []
            for name in sorted(alive):
                stream = streams[name]
                if due[name]:  # a round's start, or a restart from the global copy mid-round
                    stream.begin(book.lease(name, (P - p) * S * B))
                    due[name] = False
                for _ in range(S):
                    stream.next()
                claim = stream.claim()
                if name == "a" and (fault, sync) == ("killed", 2):
                    alive.discard("a")
                    book.release("a")
                    continue
                if name == "a" and (fault, sync) == ("refused", 2):
                    due["a"] = True  # refused: it restarts at the coordinator's position
                    continue
                try:
                    book.record(name, sync, claim)
                    pushed.append(name)
                except ChunkRefused:
                    due[name] = True  # a push its island's stale plan read: refused, it restarts
            if overlap and p == P - 1:  # τ > 0: the next round's lease comes before this sync is kept
                for name in sorted(alive):
                    if not due[name]:
                        streams[name].begin(book.lease(name, H * B))
            dropped = {"dropped": ("a", 2), "overlap_dropped": ("a", 3)}.get(fault)
            kept = [n for n in pushed if (n, sync) != dropped]
            if fault == "dropped" and "a" not in kept:
                due["a"] = True  # told its push was dropped: it restarts
            got = book.commit(sync, kept)
            records.append({"event": "chunks_consumed", "spans": {k: [s.as_list() for s in v] for k, v in got.items()}})
            if p == P - 1 and not overlap:
                due.update({name: True for name in alive})
    return book, records


@pytest.mark.parametrize("fault", STREAM_FAULTS)
def test_streaming_pushes_claim_every_sequence_once(fault: str) -> None:
    """Whatever befalls a fragment's push, every sequence is consumed once or still to read: none twice, none
    skipped, and the ledger's own count agrees with the records."""
    book, records = streaming_run(fault)
    check = ConsumptionCheck()
    check.add({"event": "chunks_layout", **book.layout.to_meta()})
    for event in records:
        check.add(event)
    got = check.result()
    assert (got.repeated, got.lost) == (0, 0), got
    assert got.consumed == book.consumed
    left = sum(s.length for s in book.unfinished()) + book.fresh_sequences()
    assert got.unread == left == 100 - got.consumed  # nothing stranded
    if fault in ("none", "overlap"):
        assert got.consumed == 5 * 2 * 2 * 4  # rounds x fragments x islands x sequences a push
    else:
        assert got.consumed < 5 * 2 * 2 * 4  # the fault cost a's work, not a sequence


@pytest.mark.parametrize(
    ("before", "after", "rounds"),
    [
        (("a", "b", "c", "d"), ("a", "b"), 4),  # fewer islands: c's and d's homes are read by the others
        (("a", "b"), ("a", "b", "c", "d", "e"), 2),  # more: the newcomers read as joiners until the next epoch
        (("a", "b", "c"), ("c", "x"), 4),  # renamed and reordered
    ],
)
def test_a_roster_changed_on_resume_reads_each_sequence_once(
    before: tuple[str, ...], after: tuple[str, ...], rounds: int
) -> None:
    layout = {"event": "chunks_layout", "sequences": 97, "chunk_sequences": 10, "chunks": 10}
    book = ledger(sequences=97, chunk=10, homes=before, most=13)
    records = [layout, *read_rounds(book, before, 1)]
    book.lease(before[-1], 13)  # leased and not pushed when the coordinator stopped
    again = ledger(sequences=97, chunk=10, homes=after, most=13)
    again.restore(json.loads(json.dumps(book.to_meta())))
    for gone in sorted(set(before) - set(after)):  # what the coordinator does for islands not enrolled now
        again.release(gone)
    records += read_rounds(again, after, rounds, first=1)  # into the second epoch
    check = ConsumptionCheck()
    for event in records:
        check.add(event)
    got = check.result()
    assert (got.repeated, got.lost) == (0, 0) and check.complete_epochs() == 1, got
    assert again.epoch == 1 and again.to_meta()["homes"] == list(after)


def test_a_checkpoint_that_names_no_homes_reads_as_joiners_when_the_roster_changed() -> None:
    book = ledger(sequences=97, chunk=10, homes=("a", "b", "c"), most=13)
    records = [{"event": "chunks_layout", "sequences": 97, "chunk_sequences": 10, "chunks": 10}]
    records += read_rounds(book, ("a", "b", "c"), 1)
    meta = book.to_meta()
    meta.pop("homes", None)  # as an older diloco saved it
    again = ledger(sequences=97, chunk=10, homes=("a", "b"), most=13)
    again.restore(meta)
    again.release("c")
    records += read_rounds(again, ("a", "b"), 4, first=1)
    check = ConsumptionCheck()
    for event in records:
        check.add(event)
    assert (check.result().repeated, check.result().lost, check.complete_epochs()) == (0, 0, 1)


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([[0, 0, 10], [1, 0, 5]], (15, 0, 0)),
        ([[0, 0, 10], [0, 5, 12]], (12, 5, 0)),  # repeated
        ([[0, 0, 4], [0, 6, 10]], (8, 0, 2)),  # a hole: lost
        ([[3, 0, 10], [3, 0, 10]], (10, 10, 0)),
    ],
)
def test_the_checker_counts_from_the_records(records: list[list[int]], expected: tuple[int, int, int]) -> None:
    events = [
        {"event": "chunks_layout", "sequences": 40, "chunk_sequences": 10, "chunks": 4},
        *({"event": "chunks_consumed", "round": i, "spans": {"a": [r]}} for i, r in enumerate(records)),
    ]
    got = consumption(events)
    assert (got.consumed, got.repeated, got.lost) == expected and got.epochs == round(expected[0] / 40, 4)


@pytest.mark.parametrize(
    ("records", "unread"),
    [
        ([], 40),  # nothing read: the first pass is begun and unread
        ([[0, 0, 10], [1, 0, 5]], 25),
        ([[0, 0, 4], [0, 6, 10]], 30),  # the hole is lost, not unread
        ([[c, 0, 10] for c in range(4)], 0),  # a whole pass, and the next not begun
        ([[c, 0, 10] for c in range(4)] + [[6, 0, 3]], 37),  # the second pass begun
        ([[0, 0, 10], [5, 0, 10]], 60),  # a pass begun before the last is finished: both count
    ],
)
def test_what_is_unread_is_what_the_passes_begun_hold_beyond_the_consumed_and_lost(
    records: list[list[int]], unread: int
) -> None:
    events = [
        {"event": "chunks_layout", "sequences": 40, "chunk_sequences": 10, "chunks": 4},
        *({"event": "chunks_consumed", "round": i, "spans": {"a": [r]}} for i, r in enumerate(records)),
    ]
    got = consumption(events)
    assert got.unread == unread and got.consumed + got.lost + got.unread == 40 * (
        1 + (max(r[0] for r in records) // 4 if records else 0)
    )


@pytest.mark.parametrize(
    ("records", "complete"),
    [
        ([[0, 0, 10], [1, 0, 10], [2, 0, 10], [3, 0, 7]], 1),  # the last chunk of an epoch is shorter (37 = 3x10+7)
        ([[0, 0, 10], [1, 0, 10], [2, 0, 10], [3, 0, 6]], 0),  # one sequence short
        ([[0, 0, 10], [1, 0, 10], [2, 0, 4], [2, 4, 10], [3, 0, 7]], 1),  # a chunk read over two rounds
        ([[0, 0, 10], [1, 0, 10], [2, 1, 10], [3, 0, 7]], 0),  # a hole at a chunk's start
        ([[c, 0, 10 if c % 4 != 3 else 7] for c in range(8)], 2),  # chunk ids of epoch 1 follow epoch 0's
    ],
)
def test_a_whole_pass_is_every_chunk_read_to_its_end(records: list[list[int]], complete: int) -> None:
    check = ConsumptionCheck()
    check.add({"event": "chunks_layout", "sequences": 37, "chunk_sequences": 10, "chunks": 4})
    for i, r in enumerate(records):
        check.add({"event": "chunks_consumed", "round": i, "spans": {"a": [r]}})
    assert check.complete_epochs() == complete


def test_the_config_takes_streaming_and_refuses_what_chunks_cannot_do(tiny_config: Path) -> None:
    assert load_config(tiny_config, [*CHUNKS, "stream.fragments=2", "stream.overlap_steps=1"]).stream.streaming
    for extra, words in [
        (["train.mode=sync"], "train.mode = 'sync'"),
        (["data.chunk_sequences=0"], "data.chunk_sequences"),
        (["data.sampling=tiles"], "data.sampling must be one of"),
    ]:
        with pytest.raises(ConfigError, match=words):
            load_config(tiny_config, [*CHUNKS, *extra])


# -- the coordinator: hostile leases and claims ----------------------------------------------------------------


@pytest.fixture
def coordinator(tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    cfg = load_config(tiny_config, [*CHUNKS, "quorum.min_islands=2", "train.checkpoint_every=0"])
    rd = RunDir(tmp_path / "run", cfg)
    coord = Coordinator(cfg, rd, build_setup(cfg, islands=()))
    for name in ("island-0", "island-1"):
        coord.join(
            pb.JoinRequest(
                run_id=coord.run_id, island=name, last_round=-1, release=_release(), config_digest=coord.digest
            )
        )
    yield coord
    coord.close()
    rd.close()


def _release() -> str:
    from diloco import RELEASE

    return RELEASE


def lease(coord: Coordinator, island: str, sequences: int = 32) -> list[Span]:
    reply = coord.lease(
        pb.LeaseRequest(run_id=coord.run_id, island=island, round=coord.loop.round, sequences=sequences)
    )
    return [Span(s.chunk, s.start, s.end) for s in reply.spans]


def push(coord: Coordinator, island: str, claim: list[Span], base: int | None = None) -> pb.PushReply:
    """`island`'s push of Δ trained on `claim`, from θ of the open round (or, asynchronous, of update `base`)."""
    named = {k: np.full(np.shape(v), 1e-3, np.float32) for k, v in flatten_named(coord.loop.params).items()}
    tensors = encode_named(named, CodecSpec(kind="fp32"))
    meta = pb.PushMeta(
        run_id=coord.run_id,
        island=island,
        round=coord.loop.round if base is None else base,
        tokens=sum(s.length for s in claim) * coord.cfg.model.seq_len or 1,
        loss=1.0,
        base_digest=bytes.fromhex(coord.world.params_digest if base is None else coord.window.digests[base]),
        chunks=[pb.ChunkSpan(chunk=s.chunk, start=s.start, end=s.end) for s in claim],
    )
    return coord.push(meta, tensors, named, payload_digest(tensors))


def refused(call, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(Rejected) as info:
        call()
    assert info.value.code == code and words in info.value.reason, info.value


def test_hostile_leases_and_claims_are_refused_and_nothing_is_counted_twice(coordinator: Coordinator) -> None:
    coord = coordinator
    mine, theirs = lease(coord, "island-0"), lease(coord, "island-1")
    refused(lambda: lease(coord, "island-0", 10**9), grpc.StatusCode.INVALID_ARGUMENT, "a lease is for 1 to 32")
    refused(lambda: push(coord, "island-0", theirs), grpc.StatusCode.FAILED_PRECONDITION, "leased to island island-1")
    end = Span(mine[0].chunk, mine[0].start, 10_000)
    refused(lambda: push(coord, "island-0", [end]), grpc.StatusCode.OUT_OF_RANGE, "beyond the end")
    refused(lambda: push(coord, "island-0", []), grpc.StatusCode.INVALID_ARGUMENT, "sequences of chunks")
    assert coord.loop.pending == ()
    assert push(coord, "island-0", mine).accepted
    refused(lambda: push(coord, "island-1", mine), grpc.StatusCode.FAILED_PRECONDITION, "leased to island island-0")
    assert push(coord, "island-1", theirs).accepted
    assert coord.settled(60)
    records = read_events(coord.rd.metrics_path, "chunks_consumed")
    assert [r["spans"] for r in records] == [
        {"island-0": [s.as_list() for s in mine], "island-1": [s.as_list() for s in theirs]}
    ]
    got = consumption(read_events(coord.rd.metrics_path))
    assert (got.consumed, got.repeated, got.lost) == (64, 0, 0)


def test_a_retired_islands_chunks_are_leased_again(coordinator: Coordinator) -> None:
    coord = coordinator
    first = lease(coord, "island-0", 10)
    coord.retire(pb.RetireRequest(run_id=coord.run_id, island="island-0", reason="test"), by="(operator)")
    again = lease(coord, "island-1", 32)
    assert again[0] == Span(first[0].chunk, 0, 20), (first, again)  # its chunk first, read from where it stands


def test_a_windows_run_has_nothing_to_lease(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.checkpoint_every=0"])
    rd = RunDir(tmp_path / "w", cfg)
    coord = Coordinator(cfg, rd, build_setup(cfg, islands=()))
    try:
        refused(lambda: lease(coord, "island-0"), grpc.StatusCode.FAILED_PRECONDITION, "samples windows")
    finally:
        coord.close()
        rd.close()


# -- the coordinator restarted: a changed roster, a retired island, the roster's records ------------------------


def started(
    tiny_config: Path, run_dir: Path, *overrides: str, clock: Callable[[], float] = time.monotonic
) -> Coordinator:
    """A coordinator on `run_dir` (resuming it when it holds a checkpoint), as `diloco coordinator` starts one."""
    cfg = load_config(tiny_config, [*CHUNKS, "train.rounds=6", *overrides])
    return Coordinator(cfg, RunDir(run_dir, cfg), build_setup(cfg, islands=()), clock=clock)


def stopped(coord: Coordinator) -> None:
    """The coordinator goes, as a killed one does, between two checkpoints: what is not saved is lost."""
    coord.close()
    coord.rd.close()


def joined(coord: Coordinator, *islands: str) -> None:
    for name in islands:
        coord.join(
            pb.JoinRequest(
                run_id=coord.run_id,
                island=name,
                last_round=coord.loop.round,  # it holds the open round's θ: it trains on, as after a restart
                release=_release(),
                config_digest=coord.digest,
            )
        )


def a_round(coord: Coordinator, *islands: str) -> None:
    """Every island leases a round's worth and pushes it; the round is kept and checkpointed."""
    for name in islands:
        assert push(coord, name, lease(coord, name)).accepted
    assert coord.settled(60) and coord.loop.round == coord.world.totals.rounds


def island_names(count: int) -> tuple[str, ...]:
    return tuple(f"island-{i}" for i in range(count))


@pytest.mark.slow  # it compiles a commit for each of three island counts
def test_a_roster_changed_on_resume_consumes_every_sequence_once(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four islands read round 0; resumed with two they read rounds 1 and 2 (their homes and the two left's), then
    with five (island-4 has no home in the open epoch: it leases as a joiner does)."""
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    run = tmp_path / "run"
    for count, rounds in [(4, 1), (2, 2), (5, 1)]:
        coord = started(tiny_config, run, f"islands.count={count}", f"quorum.min_islands={count}")
        try:
            joined(coord, *island_names(count))
            for _ in range(rounds):
                a_round(coord, *island_names(count))
        finally:
            stopped(coord)
    events = read_events(run / "metrics.jsonl")
    assert [e["round"] for e in events if e["event"] == "chunks_consumed"] == [0, 1, 2, 3]
    got = consumption(events)
    assert (got.consumed, got.repeated, got.lost) == ((4 + 2 * 2 + 5) * 32, 0, 0), got


def roster_changed_in_an_open_round(tiny_config: Path, run: Path) -> list[Span]:
    """Round 1 is open when sa-east is admitted and island-1, holding chunks, is retired; then the coordinator stops,
    its last checkpoint (round 1's) knowing neither. Returns what island-1 held."""
    coord = started(tiny_config, run, "quorum.min_islands=2")
    try:
        joined(coord, "island-0", "island-1")
        a_round(coord, "island-0", "island-1")
        held = lease(coord, "island-1")
        coord.admit(pb.AdmitRequest(run_id=coord.run_id, island="sa-east", secret_sha256=bytes(32)))
        coord.retire(pb.RetireRequest(run_id=coord.run_id, island="island-1", reason="region closed"), by="(operator)")
        return held
    finally:
        stopped(coord)


@pytest.mark.slow
def test_a_restarted_coordinator_returns_the_chunks_of_an_island_retired_since_its_checkpoint(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    held = roster_changed_in_an_open_round(tiny_config, tmp_path / "run")
    coord = started(tiny_config, tmp_path / "run", "quorum.min_islands=1")
    try:
        assert coord.world.chunks is not None and coord.world.chunks.corpus.owner(held[0].chunk) is None
        joined(coord, "island-0")
        mine = lease(coord, "island-0")
        assert held[0] in mine, (held, mine)  # the retired island's chunk, read on from where it stands
    finally:
        stopped(coord)


@pytest.mark.slow
def test_a_restarted_coordinator_returns_the_chunks_of_an_island_that_does_not_come_back(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """island-1 read round 0 and the coordinator restarts; island-1 never comes back (nobody retires it): a lease's
    length after the restart its chunks go to island-0, as a lost island's do."""
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    run = tmp_path / "run"
    coord = started(tiny_config, run, "quorum.min_islands=2")
    try:
        joined(coord, "island-0", "island-1")
        a_round(coord, "island-0", "island-1")
        (left,) = [
            c
            for c in range(8)
            if coord.world.chunks.corpus.owner(c) == "island-1" and coord.world.chunks.corpus.position(c)
        ]
    finally:
        stopped(coord)
    now = [0.0]
    coord = started(tiny_config, run, "quorum.min_islands=1", "quorum.lease_s=15", clock=lambda: now[0])
    try:
        coord.tick()
        now[0] = 14.9
        coord.tick()
        assert coord.world.chunks.corpus.owner(left) == "island-1"  # it may still come back to its chunks
        now[0] = 15.0
        coord.tick()
        assert coord.world.chunks.corpus.owner(left) is None
        joined(coord, "island-0")
        mine = lease(coord, "island-0")
        assert Span(left, coord.world.chunks.corpus.position(left), 20) in mine, mine
    finally:
        stopped(coord)


def test_a_restarted_coordinator_keeps_the_open_round_s_roster_events_and_counts(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    run = tmp_path / "run"
    roster_changed_in_an_open_round(tiny_config, run)
    coord = started(tiny_config, run, "quorum.min_islands=1")
    try:
        summary = coord.world.summary()
        assert (summary["islands_admitted"], summary["islands_retired"]) == (1, 1)
        kept = [(e["event"], e.get("round"), e.get("island")) for e in read_events(run / "metrics.jsonl")]
        assert [k for k in kept if k[0] in ("island_admitted", "island_retired")] == [
            ("island_admitted", 1, "sa-east"),
            ("island_retired", 1, "island-1"),
        ]
        assert ("resumed", 1, None) in kept and not [k for k in kept if k[0] == "push" and k[1] == 1]
    finally:
        stopped(coord)


@pytest.mark.slow
def test_asynchronous_updates_consume_what_their_island_read(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.mode = "async": each push is an update committed at once, and consumes its spans as that update, not as
    the round its Δ was taken from (a stale push is placed in the update it becomes)."""
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    coord = started(tiny_config, tmp_path / "run", "train.mode=async", "quorum.min_islands=1")
    try:
        joined(coord, "island-0", "island-1")
        base = coord.loop.round
        stale = lease(coord, "island-1")  # island-1 trains from update 0 while island-0 pushes twice
        for _ in range(2):
            assert push(coord, "island-0", lease(coord, "island-0")).accepted
        assert push(coord, "island-1", stale, base=base).accepted
        assert coord.settled(60) and coord.world.totals.rounds == 3
    finally:
        stopped(coord)
    events = read_events(tmp_path / "run" / "metrics.jsonl")
    records = [(e["round"], sorted(e["spans"])) for e in events if e["event"] == "chunks_consumed"]
    assert records == [(0, ["island-0"]), (1, ["island-0"]), (2, ["island-1"])]
    got = consumption(events)
    assert (got.consumed, got.repeated, got.lost) == (96, 0, 0)


# -- whole runs ------------------------------------------------------------------------------------------------


STREAMING = ["stream.fragments=2", "stream.overlap_steps=1", "stream.merge_alpha=0.5"]


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param([], id="rounds", marks=pytest.mark.slow),
        pytest.param(STREAMING, id="streaming", marks=pytest.mark.slow),  # each fragment's sync consumes its claims
    ],
)
def test_simulate_consumes_every_sequence_once_and_resumes_exactly(
    tiny_config: Path, tmp_path: Path, schedule: list[str]
) -> None:
    cfg = load_config(tiny_config, [*CHUNKS, "train.rounds=4", *schedule])
    whole = run_simulation(cfg, tmp_path / "whole", show_progress=False)
    records = read_events(tmp_path / "whole" / "metrics.jsonl")
    got = consumption(records)
    assert (got.consumed, got.repeated, got.lost) == (4 * 2 * 4 * 8, 0, 0)
    assert (whole["sequences_consumed"], whole["sequences_repeated"], whole["sequences_lost"]) == (256, 0, 0)
    assert whole["epochs"] == got.epochs > 0
    # What the run leaves of its pass over the corpus is said, by the records and where it is by the ledger.
    (layout,) = [e for e in records if e["event"] == "chunks_layout"]
    (unread,) = [e for e in records if e["event"] == "chunks_unread"]
    assert whole["sequences_unread"] == unread["sequences"] == layout["sequences"] - 256 > 0
    begun = sum(end - start for _, start, end in unread["spans"])
    assert begun > 0 and begun + unread["fresh_sequences"] == unread["sequences"]
    assert unread["round"] == 3 and [e["event"] for e in records].count("chunks_unread") == 1
    # Killed after round 2's checkpoint: the resumed run reads the same chunks and ends with the same θ.
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    cut_after_round(tmp_path / "cut", 2)
    resumed = run_simulation(cfg, tmp_path / "cut", show_progress=False)
    assert resumed["params_digest"] == whole["params_digest"]

    def spans_by_sync(run: str) -> list[tuple[int, int, dict]]:
        events = read_events(tmp_path / run / "metrics.jsonl", "chunks_consumed")
        return [(e["round"], e.get("fragment", 0), e["spans"]) for e in events]

    assert spans_by_sync("cut") == spans_by_sync("whole")
    assert len(spans_by_sync("whole")) == 4 * cfg.stream.fragments
    assert resumed["sequences_consumed"] == 256 and resumed["sequences_repeated"] == 0


@pytest.mark.slow  # a small asynchronous run and its resume
def test_simulate_asynchronous_updates_consume_every_sequence_once_and_resume_exactly(
    tiny_config: Path, tmp_path: Path
) -> None:
    cfg = load_config(tiny_config, [*CHUNKS, "train.mode=async", "train.rounds=4", 'islands.slowdown=["island-1=2"]'])
    whole = run_simulation(cfg, tmp_path / "whole", show_progress=False)
    records = read_events(tmp_path / "whole" / "metrics.jsonl")
    consumed = [(e["round"], sorted(e["spans"])) for e in records if e["event"] == "chunks_consumed"]
    updates = [(e["round"], [e["island"]]) for e in records if e["event"] == "round"]
    assert consumed == updates and len(updates) == 4  # each update consumes what its own island read
    assert (whole["sequences_consumed"], whole["sequences_repeated"], whole["sequences_lost"]) == (4 * 32, 0, 0)
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    cut_after_round(tmp_path / "cut", 2)  # as a kill after update 2's checkpoint leaves it
    resumed = run_simulation(cfg, tmp_path / "cut", show_progress=False)
    assert resumed["params_digest"] == whole["params_digest"]
    assert (resumed["sequences_consumed"], resumed["sequences_repeated"]) == (4 * 32, 0)


@pytest.mark.slow
def test_windows_stay_the_default_and_their_digest(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.rounds=1", "train.checkpoint_every=0"])
    assert cfg.data.sampling == "windows"
    out = run_simulation(cfg, tmp_path / "w", show_progress=False)
    assert out["sequences_consumed"] is None and out["epochs"] is None


# -- real processes ----------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", [pytest.param([], id="rounds"), pytest.param(STREAMING, id="streaming")])
def test_a_federation_reads_the_chunks_simulate_reads(
    federation, tiny_config: Path, tmp_path: Path, schedule: list[str]
) -> None:
    from tests.conftest import FAST, WAIT_S

    overrides = [*CHUNKS, "train.rounds=3", "quorum.min_islands=2", *schedule]  # every sync holds both islands
    fed = federation(*overrides)
    fed.start()
    fed.wait_exit(WAIT_S)
    simulated = run_simulation(load_config(tiny_config, [*FAST, *overrides]), tmp_path / "sim", show_progress=False)
    launched = json.loads((fed.run_dir / "summary.json").read_text())
    assert launched["params_digest"] == simulated["params_digest"]

    def spans(events: list[dict]) -> list[tuple[int, int, dict]]:
        return [(e["round"], e.get("fragment", 0), e["spans"]) for e in events if e["event"] == "chunks_consumed"]

    assert spans(fed.events()) == spans(read_events(tmp_path / "sim" / "metrics.jsonl"))
    got = consumption(fed.events())
    assert (got.consumed, got.repeated, got.lost) == (3 * 2 * 32, 0, 0)
    assert (launched["sequences_consumed"], launched["sequences_repeated"], launched["sequences_lost"]) == (192, 0, 0)


def consumed_once(fed, records: list[dict]) -> set[tuple[int, int]]:
    """The corpus's (chunk, sequence) pairs a federation's records say were consumed, after checking that none was
    consumed twice or lost and that summary.json counts the same."""
    got = consumption(records)
    assert (got.repeated, got.lost) == (0, 0), got
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert (summary["sequences_consumed"], summary["sequences_repeated"], summary["sequences_lost"]) == (
        got.consumed,
        0,
        0,
    )
    consumed = {
        (chunk, seq)
        for e in records
        if e["event"] == "chunks_consumed"
        for got_spans in e["spans"].values()
        for chunk, start, end in got_spans
        for seq in range(start, end)
    }
    assert got.consumed == len(consumed) == sum(e["sequences"] for e in records if e["event"] == "chunks_consumed")
    return consumed


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_under_churn_every_sequence_is_consumed_once(federation, tmp_path: Path) -> None:
    """island-1 is SIGKILLed before its push of round 1 (it read round 1's spans and pushed nothing) and comes back;
    sa-east is admitted, trains, and is retired before the run ends. The coordinator's records show no sequence
    consumed twice and none skipped, and the spans the killed and the retired island held are consumed by others."""
    from tests.conftest import WAIT_S
    from tests.test_elastic import ELASTIC, OPERATOR, operator_command

    rounds = 8
    pauses = ["island-0:before_push:0", "island-1:before_push:0", "island-1:before_push:1", "island-0:before_push:3",
              "island-1:before_push:5"]  # fmt: skip
    fed = federation(*CHUNKS, f"train.rounds={rounds}", *ELASTIC, pause_at=pauses)
    fed.env.update(OPERATOR)
    fed.start()
    # Both hold round 0 until both have joined, so round 1 waits for island-1 (on a busy machine one JAX process may
    # start so late that the other closes the first rounds alone, and the pause below never comes).
    for name in ("island-0", "island-1"):
        fed.paused(f"{name}:before_push:0", WAIT_S)
    for name in ("island-0", "island-1"):
        fed.release(f"{name}:before_push:0")
    fed.paused("island-1:before_push:1", WAIT_S)
    fed.kill("island-1")  # it read round 1's spans; its presence call breaks, it is lost and its chunks go back
    fed.wait_for(lambda: fed.events("island_lost"), WAIT_S, "island-1 lost")
    fed.start_island("island-1")  # it comes back: its own checkpoint, a join, a new lease
    # ... before the rounds it is paused in below can close without it (a new JAX process is slow on a busy machine)
    fed.wait_for(
        lambda: len([e for e in fed.events("island_joined") if e["island"] == "island-1"]) >= 2, WAIT_S, "island-1 back"
    )

    fed.paused("island-0:before_push:3", WAIT_S)
    kit = operator_command(fed, "admit", fed.config, "sa-east", "--out", str(tmp_path / "kit"))
    fed.start_island("sa-east", args=["--secret", kit["secret"]])
    fed.wait_for(lambda: fed.events("leased", island="sa-east"), WAIT_S, "sa-east to lease its chunks")
    fed.release("island-0:before_push:3")
    fed.wait_for(lambda: [r for r in fed.rounds() if "sa-east" in r["islands"]], WAIT_S, "a round with sa-east")

    fed.paused("island-1:before_push:5", WAIT_S)
    operator_command(fed, "retire", fed.config, "sa-east", "--reason", "region closed")
    fed.release("island-1:before_push:5")
    stopped = fed.wait_for(
        lambda: fed.others["sa-east"].poll() is not None and fed.others.pop("sa-east"), WAIT_S, "sa-east to stop"
    )
    assert stopped.returncode == 2  # refused from then on, in one line: a user error its supervisor does not retry
    fed.wait_exit(WAIT_S)

    records = fed.events()
    assert [r["round"] for r in fed.rounds()] == list(range(rounds))
    consumed = consumed_once(fed, records)
    # What the killed island read for round 1 and never pushed went back and was read again, once.
    killed = next(e for e in fed.events("leased", island="island-1") if e["round"] == 1)["spans"]
    assert all((c, s) in consumed for c, start, end in killed for s in range(start, end)), killed
    # The retired island's chunks were leased again: every one of its chunks is consumed up to where it was read.
    held = {c for e in fed.events("leased", island="sa-east") for c, _, _ in e["spans"]}
    assert held and all(any(c == chunk for chunk, _ in consumed) for c in held), held


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streaming_islands_consume_every_sequence_once_through_a_kill(federation) -> None:
    """Streaming DiLoCo (P = 2, τ = 1) under chunks: island-1 is SIGKILLed before its first push of round 1 (it read
    that round's first fragment of steps and claimed nothing), is lost, and comes back while island-0 waits before
    its push of round 3. Each fragment's push claimed its own steps; the records show no sequence consumed twice and
    none skipped, what the killed island read is read again by someone, and the end says what is left unread."""
    from tests.conftest import TOKENS, WAIT_S
    from tests.test_federation import check_run

    rounds, names = 5, ["island-0", "island-1"]
    fed = federation(
        *CHUNKS, f"train.rounds={rounds}", *STREAMING, pause_at=["island-1:before_push:1", "island-0:before_push:3"]
    )
    fed.start()
    fed.paused("island-1:before_push:1", WAIT_S)
    fed.kill("island-1")
    fed.wait_for(lambda: fed.events("island_lost"), WAIT_S, "island-1 lost")
    fed.paused("island-0:before_push:3", WAIT_S)  # island-0 trained on alone, and reads what island-1 returned
    fed.start_island("island-1")
    fed.wait_for(lambda: len(fed.events("joined", island="island-1")) >= 2, WAIT_S, "island-1 back")
    fed.release("island-0:before_push:3")
    fed.wait_exit(WAIT_S)

    check_run(fed, rounds, names, tokens=TOKENS // 2, fragments=2)  # every θ the coordinator's, syncs complete
    records = fed.events()
    got = consumption(records)
    consumed = consumed_once(fed, records)
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    (unread,) = [e for e in records if e["event"] == "chunks_unread"]
    assert summary["sequences_unread"] == got.unread == unread["sequences"] > 0
    # Each sync consumed what its pushes claimed: a fragment's push claims its own S steps of one island.
    assert all(len(e["spans"]) <= 2 and "fragment" in e for e in records if e["event"] == "chunks_consumed")
    killed = next(e for e in fed.events("leased", island="island-1") if e["round"] == 1)["spans"]
    assert all((c, s) in consumed for c, start, end in killed for s in range(start, end)), killed
