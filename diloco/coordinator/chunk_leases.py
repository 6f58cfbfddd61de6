"""The coordinator's side of chunked sampling (data.sampling = "chunks", docs/architecture.md "Chunked sampling").

The ledgers themselves (diloco/run/chunk_sources.py, one per source; diloco/run/chunk_ledger.py) belong to the run
(`GlobalRun.chunks`), which `simulate` shares; this part is what the wire adds to them: a lease only for a member
(every lease has a reader whose loss or retirement gives it back), an admitted island's own source taken on from
its lease (bounded, and written to the run dir's sources.json before it is adopted, so a restarted coordinator
keeps it), a push's spans checked against its token weight and recorded before it joins the round (dropped again if
it does not), a departed island's chunks returned, and a `ChunkRefused` turned into a gRPC status. Under window
sampling there is no ledger: a lease is refused, a push that names spans too, and the rest does nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import grpc

from diloco.run.chunk_ledger import BEYOND_END, INVALID, ChunkRefused
from diloco.run.chunk_sources import EXHAUSTED, ChunkSources, layout_fields, registry_problem
from floor.errors import UserError
from floor.files import write_atomically
from islands.chunks import Span
from transport import diloco_pb2 as pb
from transport.errors import Rejected

SOURCES_FILE = "sources.json"
"""In the run dir: the own sources admitted islands brought, and which island reads which (`ChunkSources.own_meta`)."""


class SourcesFileError(UserError, ValueError):
    """sources.json cannot be read back: one line naming the file, exit 2."""


class ChunkLeases:
    """Leases, claims and returns of chunks over the run's ledgers (`sources()`: None under window sampling)."""

    def __init__(
        self,
        sources: Callable[[], ChunkSources | None],
        seq_len: int,
        run_dir: Path,
        log: Callable[..., None],
    ) -> None:
        """`run_dir`: where sources.json lives; `log(event, **fields)`: the run's metrics.jsonl."""
        self.sources = sources
        self.seq_len = seq_len
        self.path = run_dir / SOURCES_FILE
        self.log = log

    def resume(self, logged: Collection[str]) -> None:
        """A restarted coordinator takes the own sources sources.json holds (a ledger a checkpoint saved reads on;
        one registered after it starts fresh, as what was read of it since is read again) and records the layout of
        each one its kept records (`logged`: the sources with a `chunks_layout`) do not have."""
        sources = self.sources()
        if sources is None or not self.path.exists():
            return
        try:
            registry = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise SourcesFileError(f"{self.path} cannot be read ({exc}): restore it from a backup") from None
        problem = registry_problem(registry)
        if problem is not None:
            raise SourcesFileError(f"{self.path} is damaged: {problem}; restore it from a backup")
        sources.adopt(registry)
        for key in sources.own_sources():
            if key not in logged:
                self._log_layout(sources, key)

    def lease(self, req: pb.LeaseRequest, member: bool, round_: int, enrolled: Collection[str]) -> pb.LeaseReply:
        """The spans `req.island` reads next (`ChunkSources.lease`), of the own source its lease names if any (taken
        on, durably, first: `_take_on`)."""
        sources = self.sources()
        island = req.island
        if sources is None:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this run samples windows (data.sampling = 'windows'): there are no chunks to lease",
            )
        if not member:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"island {island} is not a member now (its lease expired, or it left): join first",
            )
        try:
            if req.source:
                self._take_on(sources, island, bytes(req.source), int(req.source_sequences), enrolled)
            spans = sources.lease(island, int(req.sequences))
        except ChunkRefused as exc:
            raise Rejected(chunk_status(exc), exc.reason) from None
        return pb.LeaseReply(spans=[pb.ChunkSpan(chunk=s.chunk, start=s.start, end=s.end) for s in spans], round=round_)

    def _take_on(
        self, sources: ChunkSources, island: str, digest: bytes, sequences: int, enrolled: Collection[str]
    ) -> None:
        """`island` reads the own source `digest`: a change of the registry is written (sources.json) before it is
        adopted, so a failed write changes nothing and a restarted coordinator knows every source it handed out."""
        registry = sources.binding(island, digest, sequences, enrolled)
        if registry is None:
            return
        try:
            write_atomically(self.path, json.dumps(registry, sort_keys=True) + "\n")
        except OSError as exc:
            raise Rejected(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot write {self.path} ({exc.strerror or exc}): island {island}'s source is not taken on; fix the "
                "run dir and lease again",
            ) from None
        for key in sources.adopt(registry):
            self._log_layout(sources, key)

    def _log_layout(self, sources: ChunkSources, key: str) -> None:
        """A `chunks_layout` without a round: kept whatever round a restarted coordinator resumes at, as sources.json
        keeps the source."""
        self.log("chunks_layout", **layout_fields(key, sources.ledgers[key].layout))

    def record(self, meta: pb.PushMeta, sync: int) -> None:
        """A push that passed every other check, placed in sync `sync` (round·P + fragment; the round itself without
        streaming, or the update it becomes in the asynchronous mode): the chunk spans it trained on, of its source,
        those read since its island's previous push, are recorded (pending until that sync is kept), or the push is
        refused with why. A run of windows names none."""
        sources = self.sources()
        if sources is None:
            if meta.chunks:
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT, "this run samples windows: a push names no chunk spans"
                )
            return
        spans = [Span(int(s.chunk), int(s.start), int(s.end)) for s in meta.chunks]
        sequences = sum(max(0, s.end - s.start) for s in spans)
        if sequences * self.seq_len != meta.tokens:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the push names {sequences} sequences of chunks, but {meta.tokens} tokens are "
                f"{meta.tokens / self.seq_len:g} sequences of model.seq_len tokens",
            )
        try:
            sources.record(meta.island, sync, spans)
        except ChunkRefused as exc:
            raise Rejected(chunk_status(exc), exc.reason) from None

    def drop(self, island: str, sync: int) -> None:
        """A recorded push did not join its sync after all: its spans are rewound."""
        sources = self.sources()
        if sources is not None:
            sources.drop(island, sync)

    def release_all_but(self, enrolled: Collection[str]) -> None:
        """A restarted coordinator's ledger, as its checkpoint saved it, may give chunks to islands that are not
        enrolled now (retired after that checkpoint, or dropped from islands.names on resume): they go back to the
        pool, as they would have when the island went."""
        sources = self.sources()
        if sources is not None:
            for island in sorted(sources.readers() - set(enrolled)):
                sources.release(island)

    def release_gone(self, gone: Mapping[str, float], now: float, after_s: float) -> None:
        """Chunks of islands gone (`Roster.gone`) for `after_s` (a lease's length) go back to the pool. A lost or
        departed member's went at once; this returns those of an island a restarted coordinator's ledger names and
        that has not come back, as if it had been lost then."""
        sources = self.sources()
        overdue = {name for name, since in gone.items() if now - since >= after_s}
        if sources is not None and overdue:
            for island in sorted(sources.readers() & overdue):
                sources.release(island)

    def release(self, island: str) -> None:
        """A retired, lost or departed island's chunks return to the pool (its pending spans still count)."""
        sources = self.sources()
        if sources is not None:
            sources.release(island)


def chunk_status(refused: ChunkRefused) -> grpc.StatusCode:
    """The status of a refused lease or claim: malformed (INVALID_ARGUMENT), beyond a chunk's end (OUT_OF_RANGE),
    or a state the island's view lags (FAILED_PRECONDITION: another island's chunk, a rewound position), which an
    honest island meets after a loss or a coordinator restart and answers by resyncing and leasing again), or a run
    that holds as many sources as it may (RESOURCE_EXHAUSTED)."""
    if refused.kind == EXHAUSTED:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if refused.kind == INVALID:
        return grpc.StatusCode.INVALID_ARGUMENT
    if refused.kind == BEYOND_END:
        return grpc.StatusCode.OUT_OF_RANGE
    return grpc.StatusCode.FAILED_PRECONDITION
