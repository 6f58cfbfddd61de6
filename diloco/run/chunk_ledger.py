"""The chunk ledger: who reads which chunk of the corpus, and which sequences are consumed (data.sampling = "chunks").

docs/architecture.md, "Chunked sampling". A source (the corpus, an island's data.paths entry, an admitted island's
own: one ledger each, diloco/run/chunk_sources.py) is cut into chunks of sequences (islands/chunks.py); its ledger,
owned by whoever owns θ (`GlobalRun`: the coordinator, or `simulate`), leases chunks to islands and keeps, per chunk
it has touched:

    owner       the island that reads it now (None: nobody; it is free once nothing of it is pending)
    committed   sequences [0, committed) are consumed: a sync that trained on them is committed and kept
    pending     spans of pushes accepted into syncs not yet kept, in reading order (sync, island, start, end)

A *sync* is what one commit closes, round·P + fragment (`OuterLoop.sync`): the round itself without streaming, an
update in the asynchronous mode. A push claims the spans its island read since its previous push, so with Streaming
DiLoCo each fragment's push claims its own S = H / P steps and each fragment's commit consumes them.

A chunk is read in order, so its *position*, where its reader goes on, is committed plus what is pending. The rules:

* `lease(island, n)`: the spans of n sequences the island reads next, from the chunks it holds (lowest id first),
  taking new ones as it needs them: a chunk released by another island first (its remainder), then a fresh one of
  its own *home* (chunk i's home is configured island i mod N, so without churn every process leases the same
  chunks whatever the timing while every home has a fresh chunk left: a federation equals `simulate` bit for bit),
  then a fresh one of another home (taken from the back of the fullest; which one, at an epoch's end, depends on who
  asks first), then the next epoch's. Asking again before a push hands out the same spans, lowest chunk id first
  (the first answer lists a returned chunk before fresh ones, so the order may differ). The homes of an epoch are
  the configured islands when it opened: a run resumed with another roster (islands.names / count) reads the open
  epoch's remaining fresh chunks by its old homes, so none is handed out twice; an island without a home there
  reads as a joiner does, and the next epoch opens with the new roster's homes.
* `record(island, sync, spans)` when a push is accepted: each span must be of a chunk leased to that island and
  start exactly at its position (before it: those sequences are consumed or pending already; after it: the ones
  between would be lost) and end within the chunk. All or nothing; `ChunkRefused` says why.
* `commit(sync, islands)` when a sync is kept: those islands' spans of that sync are consumed (returned, for
  the sync's record); any other span of that sync is dropped.
* `drop(island, sync)`: a contribution that was not committed (dropped at commit, or its push undone): its spans
  of that sync and later rewind; `undo_after(sync)`: every span of a later sync rewinds (commits undone).
* `release(island)`: a retired, lost or departed island's chunks go back to the pool; a chunk with spans still
  pending waits for them to be committed or dropped, so a chunk never has two readers.

Pure and JAX-free: plain values, no clock, no I/O. `to_meta`/`from_meta` save and restore it with the checkpoint of
the global state; what is pending is not saved (a restarted coordinator reopens the round after its checkpoint, and
the islands lease again, so they are told the positions it knows).

`consumption` reads the events a run logged (`chunks_layout`, `chunks_consumed`) and says how many sequences were
consumed, repeated, lost and left unread: exactly-once is checked from the run's records, not from these counters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from islands.chunks import ChunkLayout, Span

CORPUS = "corpus"
"""The shared corpus's source key (diloco/run/chunk_sources.py): the source of records that name none."""

PendingSpan = tuple[int, str, int, int]
"""(sync, island, start, end): sequences of a chunk in a push accepted into `sync` and not yet kept."""


class ChunkRefused(ValueError):
    """A lease or a claim the ledger refuses; `kind` says which rule (for the gRPC status), the message why."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


MAX_LEASE_SPANS = 1024
"""The most spans one lease hands out, whatever a round reads (below transport.validate.MAX_CHUNK_SPANS, what a push
may name on the wire)."""
INVALID = "invalid"
"""A malformed request: a count out of bounds, a span that is empty, a negative chunk id, a chunk named twice."""
NOT_LEASED = "not_leased"
"""A chunk that is not leased to the claiming island (another island's, nobody's, or of an epoch not open: a lease
that opened the next epoch is undone by a coordinator restarted from a checkpoint before it)."""
OUT_OF_ORDER = "out_of_order"
"""A span that does not start at its chunk's position: it overlaps what is consumed or pending, or skips some."""
BEYOND_END = "beyond_end"
"""A position beyond the end of its chunk."""


@dataclass
class _Chunk:
    owner: str | None
    committed: int = 0
    pending: list[PendingSpan] = field(default_factory=list)

    @property
    def position(self) -> int:
        return self.pending[-1][3] if self.pending else self.committed


class ChunkLedger:
    """Leases and consumption of the corpus's chunks (module docstring). The caller holds any lock."""

    def __init__(self, layout: ChunkLayout, homes: Sequence[str], max_sequences: int) -> None:
        """`homes`: the configured islands (islands.names), in order; `max_sequences`: the most one lease may ask for
        (a round's H × batch_size)."""
        self.layout = layout
        self.homes = tuple(homes)
        self.max_sequences = max_sequences
        self.max_spans = min(max_sequences, MAX_LEASE_SPANS)
        """The most spans a push may claim: what one lease can hand out. Returned chunks may have a sequence or two
        left each, so a lease may take many of them; it takes one only while the spans left can still finish it with
        fresh chunks (`_fresh_spans`)."""
        self.epoch = 0
        """The newest epoch opened; older ones have no fresh chunk left."""
        self._epoch_homes: tuple[str | None, ...] = self.homes
        """The homes `epoch` opened with (None: a home whose island a checkpoint of an older diloco did not name)."""
        self._slots: list[list[int]] = self._fresh_slots()
        """Per home h, the fresh chunks of `epoch` with that home: indices h + N·j for j in [lo, hi), N its homes."""
        self._chunks: dict[int, _Chunk] = {}
        """Every chunk leased, pending or partly consumed; a chunk absent here is fresh (in a slot) or consumed."""
        self._returned: set[int] = set()
        """Chunks whose reader went, with sequences left and nothing pending: leased before any fresh one."""
        self.consumed = 0
        """Sequences committed so far, all epochs (a counter; the records are what `consumption` reads)."""

    def _fresh_slots(self) -> list[list[int]]:
        n, chunks = len(self._epoch_homes), self.layout.chunks
        return [[0, len(range(h, chunks, n))] for h in range(n)]

    # -- reading -----------------------------------------------------------------------------------------------

    def held(self, island: str) -> list[int]:
        """The chunks `island` reads, with sequences left to read, lowest id first."""
        return sorted(c for c, ch in self._chunks.items() if ch.owner == island and ch.position < self.size(c))

    def size(self, chunk: int) -> int:
        return self.layout.size(chunk)

    def position(self, chunk: int) -> int:
        """Where `chunk`'s reader goes on (a chunk never leased: 0)."""
        ch = self._chunks.get(chunk)
        return ch.position if ch is not None else 0

    def owner(self, chunk: int) -> str | None:
        ch = self._chunks.get(chunk)
        return ch.owner if ch is not None else None

    def readers(self) -> set[str]:
        """The islands that hold a chunk now."""
        return {ch.owner for ch in self._chunks.values() if ch.owner is not None}

    def fresh_sequences(self) -> int:
        """Sequences in the chunks of the open epoch that nobody has leased yet: whole chunks, less what the epoch's
        last chunk lacks when it is among them (counted per home, not per chunk: a source's size comes from the
        wire for an admitted island's own source)."""
        n, last, full = len(self._epoch_homes), self.layout.chunks - 1, self.layout.chunk_sequences
        total = 0
        for h, (lo, hi) in enumerate(self._slots):
            total += (hi - lo) * full
            if (last - h) % n == 0 and lo <= (last - h) // n < hi:
                total -= full - self.size(last)
        return total

    def unfinished(self) -> list[Span]:
        """What is left of every chunk begun and not consumed to its end (leased, partly read, or returned), lowest id
        first: with the open epoch's fresh chunks, what the run has not read of the passes it began."""
        return [Span(c, ch.committed, self.size(c)) for c, ch in sorted(self._chunks.items())]

    # -- leases ------------------------------------------------------------------------------------------------

    def lease(self, island: str, sequences: int) -> list[Span]:
        """The spans of the next `sequences` sequences `island` reads (module docstring); leases chunks as needed."""
        if not 1 <= sequences <= self.max_sequences:
            raise ChunkRefused(
                INVALID,
                f"a lease is for 1 to {self.max_sequences} sequences (a round's inner_steps x batch_size)"
                f", not {sequences}",
            )
        plan, need = [], sequences
        for c in self.held(island):
            need = self._plan(plan, c, need)
            if need == 0:
                return plan
        while need > 0:
            returned = len(plan) + self._fresh_spans(need) < self.max_spans
            need = self._plan(plan, self._take(island, returned), need)
        return plan

    def _fresh_spans(self, sequences: int) -> int:
        """The most spans `sequences` take from fresh chunks: whole chunks, and an epoch's shorter last one."""
        return -(-sequences // self.layout.chunk_sequences) + 1

    def _plan(self, plan: list[Span], chunk: int, need: int) -> int:
        start = self.position(chunk)
        n = min(need, self.size(chunk) - start)
        plan.append(Span(chunk, start, start + n))
        return need - n

    def _take(self, island: str, returned: bool) -> int:
        """A chunk for `island` to read: a returned one (when `returned`), a fresh one of its home, of the fullest
        other home, or the next epoch's."""
        if returned and self._returned:
            chunk = min(self._returned)
            self._returned.discard(chunk)
        else:
            chunk = self._fresh(island)
        self._chunks.setdefault(chunk, _Chunk(None)).owner = island
        return chunk

    def _fresh(self, island: str) -> int:
        if all(lo == hi for lo, hi in self._slots):
            self.epoch += 1
            self._epoch_homes = self.homes
            self._slots = self._fresh_slots()
        n = len(self._epoch_homes)
        home = self._epoch_homes.index(island) if island in self._epoch_homes else -1
        if home >= 0 and self._slots[home][0] < self._slots[home][1]:
            j = self._slots[home][0]
            self._slots[home][0] += 1
        else:  # a joiner, or a home used up: from the back of the fullest home, where its own island reads last
            home = max(range(n), key=lambda h: (self._slots[h][1] - self._slots[h][0], -h))
            self._slots[home][1] -= 1
            j = self._slots[home][1]
        return self.epoch * self.layout.chunks + home + n * j

    # -- claims, commits and rewinds ---------------------------------------------------------------------------

    def check(self, island: str, spans: Sequence[Span]) -> None:
        """Refuse (`ChunkRefused`) spans that `record` would not take; changes nothing."""
        if not spans:
            raise ChunkRefused(INVALID, "the push names no chunk span: with data.sampling = 'chunks' every push does")
        if len(spans) > self.max_spans:
            raise ChunkRefused(
                INVALID, f"the push names {len(spans)} chunk spans; one round reads at most {self.max_spans}"
            )
        seen: set[int] = set()
        for span in spans:
            c = span.chunk
            if c in seen:
                raise ChunkRefused(INVALID, f"chunk {c} is named twice")
            seen.add(c)
            if c < 0:
                raise ChunkRefused(INVALID, f"chunk {c} does not exist (chunk ids start at 0)")
            if c >= (self.epoch + 1) * self.layout.chunks:  # a lease that a coordinator restart undid, with its epoch
                raise ChunkRefused(NOT_LEASED, f"chunk {c} is of epoch {c // self.layout.chunks}, which is not open "
                                   f"(epoch {self.epoch} is): leased to no island, not to {island}")  # fmt: skip
            owner = self.owner(c)
            if owner != island:
                whose = f"leased to island {owner}" if owner is not None else "leased to no island"
                raise ChunkRefused(NOT_LEASED, f"chunk {c} is {whose}, not to {island}")
            size, at = self.size(c), self.position(c)
            if span.end > size:
                raise ChunkRefused(BEYOND_END, f"position {span.end} is beyond the end of chunk {c} ({size} sequences)")
            if span.start >= span.end:
                raise ChunkRefused(INVALID, f"chunk {c}: the span [{span.start}, {span.end}) is empty")
            if span.start < at:
                raise ChunkRefused(
                    OUT_OF_ORDER,
                    f"chunk {c}: sequences from {span.start} on are consumed or pending already (its position is {at})",
                )
            if span.start > at:
                raise ChunkRefused(OUT_OF_ORDER, f"chunk {c}: the span starts at {span.start}, skipping "
                                   f"sequences {at} to {span.start - 1}")  # fmt: skip

    def record(self, island: str, sync: int, spans: Sequence[Span]) -> None:
        """A push of `island` into `sync` trained on `spans`: pending until that sync is kept (all or nothing)."""
        self.check(island, spans)
        for span in spans:
            self._chunks[span.chunk].pending.append((sync, island, span.start, span.end))

    def commit(self, sync: int, islands: Iterable[str]) -> dict[str, list[Span]]:
        """Sync `sync` is kept with the contributions of `islands`: their spans of it are consumed; any other span of
        that sync (and what follows it in its chunk) is dropped. Returns the consumed spans by island."""
        members = set(islands)
        out: dict[str, list[Span]] = {}
        for c in sorted(self._chunks):
            ch = self._chunks[c]
            left: list[PendingSpan] = []
            for r, who, start, end in ch.pending:
                if r != sync:
                    left.append((r, who, start, end))
                elif who in members and start == ch.committed:
                    ch.committed = end
                    self.consumed += end - start
                    out.setdefault(who, []).append(Span(c, start, end))
                else:  # not committed: it rewinds, with whatever was read after it
                    break
            ch.pending = left
            self._settle(c)
        return {who: out[who] for who in sorted(out)}

    def drop(self, island: str, sync: int) -> None:
        """`island`'s contribution to `sync` was not committed: its spans of that sync and later ones rewind."""
        self._rewind_where(lambda r, who: who == island and r >= sync)

    def undo_after(self, sync: int) -> None:
        """The commits after `sync` were undone: every span of a later sync rewinds."""
        self._rewind_where(lambda r, who: r > sync)

    def release(self, island: str) -> None:
        """`island` reads no more (retired, lost, gone): its chunks go back to the pool (`_settle`)."""
        for c, ch in list(self._chunks.items()):
            if ch.owner == island:
                ch.owner = None
                self._settle(c)

    def _rewind_where(self, hit: Any) -> None:
        for c in sorted(self._chunks):
            ch = self._chunks[c]
            first = next((i for i, (r, who, _, _) in enumerate(ch.pending) if hit(r, who)), None)
            if first is not None:
                self._rewind(c, first)
                self._settle(c)

    def _rewind(self, chunk: int, index: int) -> None:
        """Drop `chunk`'s pending spans from `index` on: the ones after it were read past them, so they go too."""
        del self._chunks[chunk].pending[index:]

    def _settle(self, chunk: int) -> None:
        """A chunk consumed to its end is forgotten; one without reader or pending span is returned to the pool."""
        ch = self._chunks[chunk]
        if ch.committed >= self.size(chunk):
            del self._chunks[chunk]
            self._returned.discard(chunk)
        elif ch.owner is None and not ch.pending:
            self._returned.add(chunk)

    # -- durability --------------------------------------------------------------------------------------------

    def to_meta(self) -> dict[str, Any]:
        """The ledger as JSON values, without what is pending (module docstring)."""
        return {
            "epoch": self.epoch,
            "homes": list(self._epoch_homes),
            "slots": [list(s) for s in self._slots],
            "chunks": [[c, ch.owner, ch.committed] for c, ch in sorted(self._chunks.items())],
            "consumed": self.consumed,
        }

    def restore(self, meta: Mapping[str, Any]) -> None:
        """Back to a state `to_meta` saved: pending spans are gone, so every position is the committed one. The open
        epoch keeps the homes it opened with, whatever the roster is now (module docstring)."""
        self.epoch = int(meta["epoch"])
        self._slots = [[int(lo), int(hi)] for lo, hi in meta["slots"]]
        self._epoch_homes = _saved_homes(meta.get("homes"), len(self._slots), self.homes)
        self._chunks = {int(c): _Chunk(owner, int(committed)) for c, owner, committed in meta["chunks"]}
        self._returned = {c for c, ch in self._chunks.items() if ch.owner is None}
        self.consumed = int(meta["consumed"])


def _saved_homes(saved: Sequence[str] | None, count: int, configured: tuple[str, ...]) -> tuple[str | None, ...]:
    """The homes a saved epoch opened with: as saved, or (a checkpoint that did not name them) the configured ones
    when their count is the saved slots' count, else `count` homes of no island (every island reads as a joiner)."""
    if saved is not None:
        return tuple(None if name is None else str(name) for name in saved)
    return configured if len(configured) == count else (None,) * count


# -- the check from the records ---------------------------------------------------------------------------------

CONSUMPTION_KEYS: tuple[str, ...] = (
    "sequences_consumed",
    "sequences_repeated",
    "sequences_lost",
    "sequences_unread",
    "epochs",
)
"""summary.json's keys of a `Consumption` (null under data.sampling = "windows")."""


@dataclass(frozen=True)
class Consumption:
    """What a run's records say it consumed: summary.json's `sequences_*` and `epochs`."""

    consumed: int
    """Distinct sequences (per epoch) trained on in kept rounds."""
    repeated: int
    """Sequences trained on more than once in one epoch."""
    lost: int
    """Sequences skipped: never consumed while a later one of their chunk was (chunks are read in order)."""
    unread: int
    """Sequences of the passes begun (every epoch up to the newest one a record names) neither consumed nor lost:
    what is left to read, the tails of chunks begun and the chunks nobody read yet. 0 when the run ends on a pass's
    end."""
    epochs: float
    """Passes over the corpus: consumed / sequences per epoch."""

    def summary(self) -> dict[str, Any]:
        values = (self.consumed, self.repeated, self.lost, self.unread, self.epochs)
        return dict(zip(CONSUMPTION_KEYS, values, strict=True))


class ConsumptionCheck:
    """Reads `chunks_layout` and `chunks_consumed` events one at a time (`add`) and keeps every chunk's consumed
    intervals, source by source (a record without `source`, or the `spans` of a `chunks_consumed`, is the corpus's;
    its `sources` holds the others'); `result` says what they add up to, `by_source` per source. Knows nothing of the
    ledger: it checks the records."""

    def __init__(self) -> None:
        self.layouts: dict[str, dict[str, int]] = {}
        self._spans: dict[str, dict[int, list[tuple[int, int]]]] = {}
        self._repeated: dict[str, int] = {}

    @property
    def layout(self) -> dict[str, int] | None:
        """The corpus's layout (None: the run recorded none)."""
        return self.layouts.get(CORPUS)

    def add(self, event: Mapping[str, Any]) -> None:
        kind = event.get("event")
        if kind == "chunks_layout":
            source = str(event.get("source", CORPUS))
            self.layouts[source] = {k: int(event[k]) for k in ("sequences", "chunk_sequences", "chunks")}
            self._spans.setdefault(source, {})
        elif kind == "chunks_consumed":
            by_source = {CORPUS: event.get("spans", {}), **event.get("sources", {})}
            for source, by_island in by_source.items():
                for spans in by_island.values():
                    for chunk, start, end in spans:
                        self._add(source, int(chunk), int(start), int(end))

    def observe(self, event: str, fields: Mapping[str, Any]) -> None:
        """`add`, as a `RunDir` observer: each record counted as it is written."""
        self.add({"event": event, **fields})

    def _add(self, source: str, chunk: int, start: int, end: int) -> None:
        have = self._spans.setdefault(source, {}).setdefault(chunk, [])
        self._repeated[source] = self._repeated.get(source, 0) + sum(
            max(0, min(end, e) - max(start, s)) for s, e in have
        )
        have.append((start, end))

    def complete_epochs(self, source: str = CORPUS) -> int:
        """Epochs of `source`, from the first, whose every sequence the records consumed: whole passes over it."""
        meta, spans = self.layouts.get(source), self._spans.get(source, {})
        if meta is None:
            return 0
        layout = ChunkLayout(meta["sequences"], meta["chunk_sequences"], seed=0)
        epochs = 0
        while all(
            _covered(spans.get(chunk, [])) == layout.size(chunk)
            for chunk in range(epochs * layout.chunks, (epochs + 1) * layout.chunks)
        ):
            epochs += 1
        return epochs

    def by_source(self) -> dict[str, Consumption]:
        """What each source's records add up to (every source with a layout or a consumed span)."""
        return {source: self._result(source) for source in sorted(self._spans)}

    def result(self) -> Consumption:
        """What the run's records add up to over every source (`epochs`: passes over all of them)."""
        parts = self.by_source()
        consumed = sum(p.consumed for p in parts.values())
        sequences = sum(meta["sequences"] for meta in self.layouts.values())
        return Consumption(
            consumed,
            sum(p.repeated for p in parts.values()),
            sum(p.lost for p in parts.values()),
            sum(p.unread for p in parts.values()),
            round(consumed / sequences, 4) if sequences else 0.0,
        )

    def _result(self, source: str) -> Consumption:
        covered = lost = 0
        spans = self._spans.get(source, {})
        for intervals in spans.values():
            merged = _merged(intervals)
            inside = sum(e - s for s, e in merged)
            covered += inside
            lost += merged[-1][1] - inside  # holes below the highest sequence consumed
        repeated, meta = self._repeated.get(source, 0), self.layouts.get(source)
        if meta is None:
            return Consumption(covered, repeated, lost, 0, 0.0)
        sequences = meta["sequences"]
        begun = max(spans, default=0) // meta["chunks"] + 1
        unread = begun * sequences - covered - lost
        return Consumption(covered, repeated, lost, unread, round(covered / sequences, 4))


def _merged(intervals: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Half-open intervals merged where they touch or overlap, in order."""
    merged: list[list[int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _covered(intervals: Iterable[tuple[int, int]]) -> int:
    """Sequences of a chunk its intervals cover from 0 without a hole (all of it when read to its end)."""
    merged = _merged(intervals)
    return merged[0][1] if merged and merged[0][0] == 0 else 0


def consumption(events: Iterable[Mapping[str, Any]]) -> Consumption:
    """Consumed, repeated and lost sequences by a run's `chunks_consumed` records (metrics.jsonl's events, in order):
    what tests and `diloco bench` check exactly-once with."""
    check = ConsumptionCheck()
    for event in events:
        check.add(event)
    return check.result()
