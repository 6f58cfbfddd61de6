"""A chunk ledger per source (diloco/run/chunk_sources.py): data.paths, an admitted island's own source, their records.

The rules as tables of cases over plain values (which source an island reads, what taking on an own source asks,
what a damaged registry is), the records counted per source, the coordinator's side over the wire (hostile source
fields, sources.json written before a source is adopted, kept across a restart), a `simulate` run over data.paths,
and real processes: two islands with their own sources and an admitted island with its own, the coordinator killed
and restarted between rounds, every source read once.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest

import diloco.coordinator.settler as settler_module
from diloco.config import load_config
from diloco.coordinator.chunk_leases import SOURCES_FILE, SourcesFileError
from diloco.coordinator.coordinator import Coordinator
from diloco.run.chunk_ledger import CORPUS, INVALID, NOT_LEASED, ChunkLedger, ChunkRefused, ConsumptionCheck
from diloco.run.chunk_sources import (
    EXHAUSTED,
    MAX_OWN_SOURCES,
    ChunkSources,
    own_source,
    paths_source,
    registry_problem,
)
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import admitted_stream, build_setup, chunk_layouts
from diloco.simulator.simulate import run_simulation
from islands.chunks import ChunkLayout, ChunkStream, Span, source_digest
from islands.data import DataError
from tests.conftest import write_corpus
from transport import diloco_pb2 as pb
from transport.errors import Rejected
from transport.validate import MAX_SOURCE_SEQUENCES, check_lease

CHUNKS = ["data.sampling=chunks", "data.chunk_sequences=20"]
ROUND = 25  # sequences a lease may ask for in these tables
DIGEST = bytes(range(32))
OTHER = bytes(range(1, 33))


def layout(sequences: int) -> ChunkLayout:
    return ChunkLayout(sequences, 10, seed=0)


def per_island(sizes: tuple[int, ...] = (40, 30), names: tuple[str, ...] = ("a", "b")) -> ChunkSources:
    """data.paths: island i reads source i alone."""
    return ChunkSources({paths_source(i): layout(n) for i, n in enumerate(sizes)}, names, ROUND)


def shared(sequences: int = 40, names: tuple[str, ...] = ("a", "b")) -> ChunkSources:
    return ChunkSources({CORPUS: layout(sequences)}, names, ROUND)


ENROLLED = frozenset({"x", "y", "joiner", "later"})
"""The admitted islands of these tables, enrolled unless a case retires one."""


def taken_on(sources: ChunkSources, island: str, sequences: int = 30, enrolled: frozenset[str] = ENROLLED) -> None:
    registry = sources.binding(island, DIGEST, sequences, enrolled)
    if registry is not None:
        sources.adopt(registry)


def records(sources: ChunkSources, rounds: int, islands: tuple[str, ...], first: int = 0) -> list[dict]:
    """`rounds` rounds in which every island leases a round's worth, pushes it and the round is kept: the
    `chunks_consumed` records they leave, as GlobalRun writes them."""
    out = []
    for r in range(first, first + rounds):
        for island in islands:
            sources.record(island, r, sources.lease(island, ROUND))
        got = sources.commit(r, islands)
        listed = {k: {i: [s.as_list() for s in v] for i, v in by.items()} for k, by in got.items()}
        others = {k: v for k, v in listed.items() if k != CORPUS}
        out.append({"event": "chunks_consumed", "round": r, "spans": listed.get(CORPUS, {}), "sources": others})
    return out


def layouts(sources: ChunkSources) -> list[dict]:
    return [
        {"event": "chunks_layout", **({} if k == CORPUS else {"source": k}), **v.to_meta()}
        for k, v in sources.layouts().items()
    ]


def checked(events: list[dict]) -> ConsumptionCheck:
    check = ConsumptionCheck()
    for event in events:
        check.add(event)
    return check


# -- which source an island reads ------------------------------------------------------------------------------


def test_under_data_paths_each_island_reads_its_own_source_s_chunks() -> None:
    sources = per_island()
    mine, theirs = sources.lease("a", 10), sources.lease("b", 10)
    assert mine == theirs == [Span(0, 0, 10)]  # chunk 0 of each source: the ids of one never name the other's
    sources.record("a", 0, mine)
    assert sources.ledgers["data.paths[1]"].position(0) == 0  # b's chunk 0 is untouched by a's claim
    with pytest.raises(ChunkRefused) as info:
        sources.record("a", 0, mine)  # the same sequences again
    assert "consumed or pending already" in info.value.reason
    assert sources.commit(0, ["a"]) == {"data.paths[0]": {"a": mine}}
    with pytest.raises(ChunkRefused) as info:
        sources.lease("joiner", 5)  # no corpus, no source of its own
    assert info.value.kind == NOT_LEASED and "data.own_path" in info.value.reason


@pytest.mark.parametrize(
    ("build", "island", "source"),
    [
        (shared, "a", CORPUS),
        (shared, "joiner", CORPUS),  # an admitted island without a source of its own reads the corpus
        (per_island, "b", "data.paths[1]"),
        (per_island, "joiner", None),
    ],
)
def test_which_source_an_island_reads(build, island: str, source: str | None) -> None:
    assert build().source_of(island) == source


def test_every_source_of_a_run_is_read_once_and_counted_per_source_and_in_total() -> None:
    sources = per_island(sizes=(40, 37))
    taken_on(sources, "joiner", sequences=45)
    events = [*layouts(sources), *records(sources, 3, ("a", "b", "joiner"))]
    check = checked(events)
    parts = check.by_source()
    assert set(parts) == {"data.paths[0]", "data.paths[1]", own_source(DIGEST)}
    assert all((p.repeated, p.lost) == (0, 0) for p in parts.values()), parts
    assert all(p.consumed == 75 for p in parts.values())  # 3 rounds of 25, into each source's second pass
    assert [parts[k].unread for k in sorted(parts)] == [2 * 40 - 75, 3 * 37 - 75, 2 * 45 - 75]  # passes begun
    total = check.result()
    assert (total.consumed, total.repeated, total.lost, total.unread) == (225, 0, 0, 5 + 36 + 15)


def test_a_retired_island_s_source_is_unread_not_lost_and_read_on_by_the_next_reader_of_it() -> None:
    sources = per_island()
    taken_on(sources, "joiner", sequences=60)
    events = [*layouts(sources), *records(sources, 1, ("a", "b", "joiner"))]
    sources.lease("joiner", ROUND)  # leased, then retired before its push
    sources.release("joiner")
    events += records(sources, 1, ("a",), first=1)
    own = checked(events).by_source()[own_source(DIGEST)]
    assert (own.consumed, own.lost, own.unread) == (25, 0, 35)
    taken_on(sources, "later", sequences=60, enrolled=frozenset({"later"}))  # another that brings the same tokens
    assert sources.lease("later", 5) == [Span(2, 5, 10)]  # the retired island's chunk, from where it stands


def test_two_islands_that_bring_the_same_tokens_share_its_ledger() -> None:
    sources = shared()
    taken_on(sources, "x", sequences=100)
    taken_on(sources, "y", sequences=100)
    events = [*layouts(sources), *records(sources, 2, ("x", "y"))]
    own = checked(events).by_source()[own_source(DIGEST)]
    assert (own.consumed, own.repeated, own.lost, own.unread) == (100, 0, 0, 0)


# -- taking on an own source -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("island", "digest", "sequences", "kind", "words"),
    [
        ("a", DIGEST, 30, INVALID, "island a is configured: it reads corpus"),
        ("x", OTHER, 30, INVALID, "now holds other tokens"),  # x reads DIGEST already: one island, one source
        ("y", DIGEST, 31, INVALID, "holds 30 sequences, not 31"),  # the same content cannot be another size
    ],
    ids=["configured", "another-source", "another-size"],
)
def test_an_own_source_that_cannot_be_taken_on_is_refused_and_changes_nothing(
    island: str, digest: bytes, sequences: int, kind: str, words: str
) -> None:
    sources = shared()
    taken_on(sources, "x")
    before = (sources.own_meta(), sources.to_meta())
    with pytest.raises(ChunkRefused) as info:
        sources.binding(island, digest, sequences, enrolled={"x", "y"})
    assert info.value.kind == kind and words in info.value.reason, info.value.reason
    assert (sources.own_meta(), sources.to_meta()) == before


def test_own_sources_are_bounded_and_a_binding_of_an_island_gone_is_dropped() -> None:
    sources = shared()
    registry = {
        "sources": {own_source(i.to_bytes(32, "big")): 10 for i in range(MAX_OWN_SOURCES)},
        "islands": {"gone": own_source(bytes(32))},
    }
    assert registry_problem(registry) is None
    sources.adopt(registry)
    with pytest.raises(ChunkRefused) as info:
        sources.binding("new", b"\xff" * 32, 10, enrolled={"new"})
    assert info.value.kind == EXHAUSTED
    known = sources.binding("new", bytes(32), 10, enrolled={"new"})  # a source the run holds: no new ledger
    assert known is not None and known["islands"] == {"new": own_source(bytes(32))}  # "gone" is not enrolled
    assert sources.binding("gone", bytes(32), 10, enrolled={"gone"}) is None  # bound already: nothing to write


@pytest.mark.parametrize(
    ("registry", "words"),
    [
        ([], "not an object"),
        ({"sources": {}, "islands": []}, "'islands' is not an object"),
        ({"sources": {"data.paths[0]": 10}, "islands": {}}, "is not own:<sha256>"),
        ({"sources": {own_source(DIGEST): True}, "islands": {}}, "is not own:<sha256>"),
        ({"sources": {own_source(DIGEST): 0}, "islands": {}}, "is not own:<sha256>"),
        ({"sources": {}, "islands": {"x": own_source(DIGEST)}}, "a source the file does not hold"),
        ({"sources": {own_source(i.to_bytes(32, "big")): 1 for i in range(257)}, "islands": {}}, "more than 256"),
    ],
)
def test_a_damaged_registry_is_named(registry: object, words: str) -> None:
    problem = registry_problem(registry)
    assert problem is not None and words in problem, problem


def test_every_ledger_survives_a_restart() -> None:
    sources = per_island()
    taken_on(sources, "joiner", sequences=60)
    records(sources, 1, ("a", "b", "joiner"))
    registry = sources.own_meta()
    again = per_island()
    again.restore(json.loads(json.dumps(sources.to_meta())))
    again.adopt(json.loads(json.dumps(registry)))
    for island in ("a", "b", "joiner"):
        assert again.lease(island, 5) == sources.lease(island, 5), island


def test_a_roster_renamed_on_resume_reads_each_island_s_source_on_where_it_stands() -> None:
    """data.paths fixes the number of islands, not their names: island b, renamed c on resume, reads b's source on from
    where the checkpoint has it, and the chunk b held when the coordinator stopped goes back to the pool first."""
    sources = per_island(sizes=(40, 37))
    events = [*layouts(sources), *records(sources, 1, ("a", "b"))]
    held = sources.lease("b", ROUND)  # leased and not pushed when the coordinator stopped
    again = per_island(sizes=(40, 37), names=("a", "c"))
    again.restore(json.loads(json.dumps(sources.to_meta())))
    again.release("b")  # what the coordinator does for an island not enrolled now
    assert again.lease("c", ROUND)[0] == held[0]
    events += records(again, 3, ("a", "c"), first=1)
    parts = checked(events).by_source()
    assert all((p.consumed, p.repeated, p.lost) == (100, 0, 0) for p in parts.values()), parts


@pytest.mark.parametrize(("sequences", "chunk", "homes", "taken"), [(97, 10, 3, 4), (40, 10, 2, 3), (7, 10, 1, 0)])
def test_fresh_sequences_are_counted_per_home_as_chunk_by_chunk(
    sequences: int, chunk: int, homes: int, taken: int
) -> None:
    names = tuple(f"i{h}" for h in range(homes))
    book = ChunkLedger(ChunkLayout(sequences, chunk, seed=0), names, chunk)
    for i in range(taken):
        book.lease(names[i % homes] if i % 2 else "joiner", 1)
        book.release("joiner")
    first = book.epoch * book.layout.chunks
    leased = {c for c, _, _ in book.to_meta()["chunks"]}
    fresh = sum(book.size(c) for c in range(first, first + book.layout.chunks) if c not in leased)
    assert book.fresh_sequences() == fresh


# -- the wire ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "sequences", "words"),
    [
        (b"", 5, "source_sequences without a source"),
        (b"x" * 31, 5, "31 bytes"),
        (b"x" * 4096, 5, "4096 bytes"),
        (DIGEST, 0, "1 to"),
        (DIGEST, MAX_SOURCE_SEQUENCES + 1, "1 to"),
        (DIGEST, 2**64 - 1, "1 to"),
    ],
)
def test_a_lease_s_source_fields_are_checked_on_the_wire(source: bytes, sequences: int, words: str) -> None:
    with pytest.raises(Rejected) as info:
        check_lease(pb.LeaseRequest(island="x", sequences=1, source=source, source_sequences=sequences))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.reason


def test_an_own_source_is_named_by_its_tokens_not_its_path(tmp_path: Path) -> None:
    tokens = np.arange(200, dtype=np.uint16) % 256
    lay = ChunkLayout(200 // 17, 20, seed=0)
    same = source_digest(tokens.astype(np.uint32), lay, 16)
    assert source_digest(tokens, lay, 16) == same  # stored as uint16 or uint32: the same tokens
    assert source_digest(np.concatenate([tokens, tokens[:5]]), lay, 16) == same  # a tail no chunk names
    changed = tokens.copy()
    changed[3] += 1
    assert source_digest(changed, lay, 16) != same and source_digest(tokens, lay, 15) != same


# -- the coordinator -----------------------------------------------------------------------------------------------


def coordinator_on(tiny_config: Path, run: Path, *overrides: str) -> Coordinator:
    cfg = load_config(tiny_config, [*CHUNKS, "quorum.min_islands=1", *overrides])
    return Coordinator(cfg, RunDir(run, cfg), build_setup(cfg, islands=()))


def stopped(coord: Coordinator) -> None:
    coord.close()
    coord.rd.close()


def joined_admitted(coord: Coordinator, name: str) -> None:
    from diloco import RELEASE

    coord.admit(pb.AdmitRequest(run_id=coord.run_id, island=name, secret_sha256=bytes(32)))
    coord.join(
        pb.JoinRequest(run_id=coord.run_id, island=name, last_round=-1, release=RELEASE, config_digest=coord.digest)
    )


def own_lease(coord: Coordinator, name: str, digest: bytes = DIGEST, sequences: int = 50) -> list[Span]:
    req = pb.LeaseRequest(run_id=coord.run_id, island=name, sequences=8, source=digest, source_sequences=sequences)
    return [Span(s.chunk, s.start, s.end) for s in coord.lease(req).spans]


@pytest.mark.slow  # three coordinator starts
def test_the_coordinator_writes_an_own_source_before_it_takes_it_on_and_keeps_it_across_a_restart(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    run = tmp_path / "run"
    coord = coordinator_on(tiny_config, run)
    try:
        joined_admitted(coord, "sa-east")
        (run / SOURCES_FILE).mkdir()  # a write that fails: nothing is taken on
        with pytest.raises(Rejected) as info:
            own_lease(coord, "sa-east")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "sources.json" in info.value.reason
        assert coord.world.chunks.own_sources() == []
        (run / SOURCES_FILE).rmdir()
        assert own_lease(coord, "sa-east") == [Span(0, 0, 8)]
        assert json.loads((run / SOURCES_FILE).read_text())["islands"] == {"sa-east": own_source(DIGEST)}
        with pytest.raises(Rejected) as info:
            own_lease(coord, "sa-east", OTHER)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "other tokens" in info.value.reason
    finally:
        stopped(coord)
    coord = coordinator_on(tiny_config, run)
    try:
        assert coord.world.chunks.source_of("sa-east") == own_source(DIGEST)
        layouts = [e for e in read_events(run / "metrics.jsonl", "chunks_layout") if e.get("source")]
        assert {e["source"] for e in layouts} == {own_source(DIGEST)} and layouts[0]["sequences"] == 50
    finally:
        stopped(coord)
    (run / SOURCES_FILE).write_text('{"sources": {"own:12": 3}, "islands": {}}')
    with pytest.raises(SourcesFileError, match="sources.json is damaged: the source 'own:12'"):
        coordinator_on(tiny_config, run)


# -- whole runs ----------------------------------------------------------------------------------------------------


def test_data_paths_under_chunks_is_a_source_per_island(tiny_config: Path, tmp_path: Path) -> None:
    paths = [str(write_corpus(tmp_path / f"source-{i}.txt", 1_000 * (i + 1), seed=i)) for i in range(2)]
    cfg = load_config(tiny_config, [*CHUNKS, f"data.paths={json.dumps(paths)}", "data.path="])  # refused before
    got = chunk_layouts(cfg)
    assert got is not None and {k: v.sequences for k, v in got.items()} == {
        "data.paths[0]": 900 // 17,
        "data.paths[1]": 1_800 // 17,
    }
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x" * 12)
    cfg = load_config(tiny_config, [*CHUNKS, f"data.paths={json.dumps([paths[0], str(tiny)])}", "data.path="])
    with pytest.raises(DataError, match=r"data.paths\[1\] '.*tiny.txt': data.sampling = 'chunks' reads whole"):
        chunk_layouts(cfg)


@pytest.mark.slow  # a small simulate of two islands
def test_data_paths_under_chunks_reads_each_island_s_source_once_in_simulate(tiny_config: Path, tmp_path: Path) -> None:
    paths = [str(write_corpus(tmp_path / f"source-{i}.txt", 12_000 + 3_000 * i, seed=i)) for i in range(2)]
    cfg = load_config(tiny_config, [*CHUNKS, f"data.paths={json.dumps(paths)}", "data.path=", "train.rounds=3"])
    out = run_simulation(cfg, tmp_path / "sim", show_progress=False)
    events = read_events(tmp_path / "sim" / "metrics.jsonl")
    assert [e.get("source") for e in events if e["event"] == "chunks_layout"] == ["data.paths[0]", "data.paths[1]"]
    consumed = [e for e in events if e["event"] == "chunks_consumed"]
    assert [sorted(e["sources"]) for e in consumed] == [["data.paths[0]", "data.paths[1]"]] * 3
    assert all(list(e["sources"][paths_source(i)]) == [f"island-{i}"] for e in consumed for i in range(2))
    by_source = out["sequences_by_source"]
    assert sorted(by_source) == ["data.paths[0]", "data.paths[1]"]
    assert all((s["sequences_consumed"], s["sequences_repeated"], s["sequences_lost"]) == (96, 0, 0)
               for s in by_source.values())  # fmt: skip
    assert (out["sequences_consumed"], out["sequences_repeated"], out["sequences_lost"]) == (192, 0, 0)


def test_an_admitted_island_s_own_source_is_chunks_named_by_its_content(tiny_config: Path, tmp_path: Path) -> None:
    own = write_corpus(tmp_path / "own.txt", 9_000, seed=5)
    stream = admitted_stream(load_config(tiny_config, [*CHUNKS, f"data.own_path={own}"]), "sa-east")
    assert isinstance(stream, ChunkStream) and len(stream.source) == 32
    assert stream.layout.sequences == int(9_000 * 0.9) // 17
    copy = tmp_path / "elsewhere" / "copy.txt"
    copy.parent.mkdir()
    copy.write_bytes(own.read_bytes())
    again = admitted_stream(load_config(tiny_config, [*CHUNKS, f"data.own_path={copy}"]), "sa-east")
    assert isinstance(again, ChunkStream) and again.source == stream.source  # the tokens name it, not the path
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 12)
    with pytest.raises(DataError, match=r"data.own_path '.*short.txt': data.sampling = 'chunks' reads whole sequences"):
        admitted_stream(load_config(tiny_config, [*CHUNKS, f"data.own_path={short}"]), "sa-east")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_source_is_read_once_across_a_coordinator_restart(federation, tmp_path: Path) -> None:
    """island-0 and island-1 read their data.paths sources; sa-east, admitted, reads its own (data.own_path). The
    coordinator is SIGKILLed once every island holds θ_2 and round 2's checkpoint is saved, and restarted: it takes
    sa-east's source back from sources.json and its position from the checkpoint, and the run ends with every
    source's sequences consumed once, none lost, per source and in total."""
    from tests.conftest import WAIT_S
    from tests.test_elastic import ELASTIC, OPERATOR, operator_command

    paths = [str(write_corpus(tmp_path / f"source-{i}.txt", 12_000 + 3_000 * i, seed=i)) for i in range(2)]
    own = write_corpus(tmp_path / "own.txt", 9_000, seed=5)
    holding = [f"{name}:after_adopt:2" for name in ("island-0", "island-1", "sa-east")]
    fed = federation(
        *CHUNKS,
        f"data.paths={json.dumps(paths)}",
        "data.path=",
        "train.rounds=4",
        *ELASTIC,
        pause_at=["island-0:before_push:0", "island-1:before_push:0", *holding],
    )
    fed.env.update(OPERATOR)
    fed.start_coordinator()
    kit = operator_command(fed, "admit", fed.config, "sa-east", "--out", str(tmp_path / "kit"))
    fed.start_island("island-0")
    fed.start_island("island-1")
    fed.start_island("sa-east", args=["--secret", kit["secret"], f"data.own_path={own}"])
    # Neither configured island pushes before sa-east reads its own source: whichever joins first would otherwise
    # close the first rounds alone on a busy machine.
    for name in ("island-0", "island-1"):
        fed.paused(f"{name}:before_push:0", WAIT_S)
    fed.wait_for(lambda: fed.events("leased", island="sa-east"), WAIT_S, "sa-east to lease its own source")
    for name in ("island-0", "island-1"):
        fed.release(f"{name}:before_push:0")
    for entry in holding:
        fed.paused(entry, WAIT_S)
    checkpoints = fed.run_dir / "checkpoints" / "coordinator"
    fed.wait_for(lambda: (checkpoints / "2").is_dir(), WAIT_S, "the coordinator's checkpoint 2")
    fed.wait_for(lambda: fed.rounds() and fed.rounds()[-1]["round"] == 1, WAIT_S, "round 1's record")
    fed.kill("coordinator")
    fed.start_coordinator()
    fed.wait_for(lambda: fed.events("resumed"), WAIT_S, "the coordinator to resume")
    for entry in holding:
        fed.release(entry)
    fed.wait_exit(WAIT_S)

    records = fed.events()
    assert [r["round"] for r in fed.rounds()] == [0, 1, 2, 3]
    resumed = [r for r in fed.rounds() if r["round"] >= 2]
    assert all(len(r["islands"]) == 3 for r in resumed), "the restarted coordinator waits for every island"
    mine = json.loads((fed.run_dir / SOURCES_FILE).read_text())["islands"]["sa-east"]
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    by_source = summary["sequences_by_source"]
    assert sorted(by_source) == ["data.paths[0]", "data.paths[1]", mine]
    for key, part in by_source.items():
        assert (part["sequences_repeated"], part["sequences_lost"]) == (0, 0), (key, part)
        assert part["sequences_consumed"] > 0, (key, part)
    check = checked(records)
    assert {k: v.summary() for k, v in check.by_source().items()} == by_source  # the records say the same
    assert (summary["sequences_repeated"], summary["sequences_lost"]) == (0, 0)
    read_by_sa_east = [e["round"] for e in records if e["event"] == "chunks_consumed" and mine in e.get("sources", {})]
    assert min(read_by_sa_east) < 2 <= max(read_by_sa_east), read_by_sa_east  # before the restart and after it
