"""The coordinator's side of chunked sampling (data.sampling = "chunks", docs/architecture.md "Chunked sampling").

The ledger itself (diloco/run/chunk_ledger.py) belongs to the run (`GlobalRun.chunks`), which `simulate` shares;
this part is what the wire adds to it: a lease only for a member (every lease has a reader whose loss or retirement
gives it back), a push's spans checked against its token weight and recorded before it joins the round (dropped
again if it does not), a departed island's chunks returned, and a `ChunkRefused` turned into a gRPC status. Under
window sampling there is no ledger: a lease is refused, a push that names spans too, and the rest does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import grpc

from diloco.run.chunk_ledger import BEYOND_END, INVALID, ChunkLedger, ChunkRefused
from islands.chunks import Span
from transport import diloco_pb2 as pb
from transport.errors import Rejected


class ChunkLeases:
    """Leases, claims and returns of chunks over the run's ledger (`ledger()`: None under window sampling)."""

    def __init__(self, ledger: Callable[[], ChunkLedger | None], configured: Collection[str], seq_len: int) -> None:
        self.ledger = ledger
        self.configured = frozenset(configured)
        self.seq_len = seq_len

    def lease(self, island: str, sequences: int, member: bool, round_: int) -> pb.LeaseReply:
        """The spans `island` reads next (`ChunkLedger.lease`)."""
        ledger = self.ledger()
        if ledger is None:
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
            spans = ledger.lease(island, sequences)
        except ChunkRefused as exc:
            raise Rejected(chunk_status(exc), exc.reason) from None
        return pb.LeaseReply(spans=[pb.ChunkSpan(chunk=s.chunk, start=s.start, end=s.end) for s in spans], round=round_)

    def record(self, meta: pb.PushMeta, sync: int) -> None:
        """A push that passed every other check, placed in sync `sync` (round·P + fragment; the round itself without
        streaming, or the update it becomes in the asynchronous mode): the chunk spans it trained on, those read since
        its island's previous push, are recorded (pending until that sync is kept), or the push is refused with why.
        An island that brings its own source (data.own_path) and a run of windows name none."""
        ledger = self.ledger()
        if ledger is None:
            if meta.chunks:
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT, "this run samples windows: a push names no chunk spans"
                )
            return
        spans = [Span(int(s.chunk), int(s.start), int(s.end)) for s in meta.chunks]
        if not spans and meta.island not in self.configured:
            return  # an admitted island's own source: the ledger covers the shared corpus only
        sequences = sum(max(0, s.end - s.start) for s in spans)
        if sequences * self.seq_len != meta.tokens:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the push names {sequences} sequences of chunks, but {meta.tokens} tokens are "
                f"{meta.tokens / self.seq_len:g} sequences of model.seq_len tokens",
            )
        try:
            ledger.record(meta.island, sync, spans)
        except ChunkRefused as exc:
            raise Rejected(chunk_status(exc), exc.reason) from None

    def drop(self, island: str, sync: int) -> None:
        """A recorded push did not join its sync after all: its spans are rewound."""
        ledger = self.ledger()
        if ledger is not None:
            ledger.drop(island, sync)

    def release_all_but(self, enrolled: Collection[str]) -> None:
        """A restarted coordinator's ledger, as its checkpoint saved it, may give chunks to islands that are not
        enrolled now (retired after that checkpoint, or dropped from islands.names on resume): they go back to the
        pool, as they would have when the island went."""
        ledger = self.ledger()
        if ledger is not None:
            for island in sorted(ledger.readers() - set(enrolled)):
                ledger.release(island)

    def release_gone(self, gone: Mapping[str, float], now: float, after_s: float) -> None:
        """Chunks of islands gone (`Roster.gone`) for `after_s` (a lease's length) go back to the pool. A lost or
        departed member's went at once; this returns those of an island a restarted coordinator's ledger names and
        that has not come back, as if it had been lost then."""
        ledger = self.ledger()
        overdue = {name for name, since in gone.items() if now - since >= after_s}
        if ledger is not None and overdue:
            for island in sorted(ledger.readers() & overdue):
                ledger.release(island)

    def release(self, island: str) -> None:
        """A retired, lost or departed island's chunks return to the pool (its pending spans still count)."""
        ledger = self.ledger()
        if ledger is not None:
            ledger.release(island)


def chunk_status(refused: ChunkRefused) -> grpc.StatusCode:
    """The status of a refused lease or claim: malformed (INVALID_ARGUMENT), beyond a chunk's end (OUT_OF_RANGE),
    or a state the island's view lags (FAILED_PRECONDITION: another island's chunk, a rewound position), which an
    honest island meets after a loss or a coordinator restart and answers by resyncing and leasing again."""
    if refused.kind == INVALID:
        return grpc.StatusCode.INVALID_ARGUMENT
    if refused.kind == BEYOND_END:
        return grpc.StatusCode.OUT_OF_RANGE
    return grpc.StatusCode.FAILED_PRECONDITION
