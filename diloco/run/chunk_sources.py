"""The run's chunk ledgers, one per source, and which source each island reads (data.sampling = "chunks").

docs/architecture.md, "Chunked sampling". A source is a body of training tokens cut into chunks of its own
(islands/chunks.py); each has its own `ChunkLedger`, so the chunk ids of one source never name another's sequences.
The sources of a run, by key:

    corpus          the shared corpus (data.path, or synthetic): the configured islands' homes, and any island
                    without a source of its own
    data.paths[i]   configured island i's source (non-IID data): its home, the only island that reads it
    own:<sha256>    a source an admitted island brings (data.own_path), named by its content (`source_digest`): the
                    coordinator never sees the file, only its identity and its size, and a path (which a typo or
                    another host may point at other tokens) names nothing here. Islands that bring the same tokens
                    read one ledger; an island reads one own source for as long as it is enrolled (`binding`).

The operations of one island (`lease`, `record`, `drop`, `release`) go to its source's ledger; a round's `commit`
and `undo_after` go to every ledger. A retired island's source stays in the run: what nobody has read of it is
unread, not lost (lost is a hole below a consumed sequence of a chunk, which no retirement makes), and an island
that brings the same tokens later reads on where it stopped.

Bounds: at most MAX_OWN_SOURCES sources that admitted islands bring per run (the configured ones are bounded by the
config), and one binding per enrolled island that brings one. `own_meta` is that registry; the coordinator writes
it (sources.json) before it adopts a change (`ChunkLeases`). `to_meta`/`restore` save every ledger with the
checkpoint. Pure and JAX-free, like the ledger.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from diloco.run.chunk_ledger import CORPUS, INVALID, NOT_LEASED, ChunkLedger, ChunkRefused
from islands.chunks import ChunkLayout, Span

OWN = "own:"
MAX_OWN_SOURCES = 256
"""The most sources admitted islands may bring into one run: each is a ledger the coordinator keeps and saves for
the rest of the run, whoever reads it, so a run's ledgers stay bounded under churn."""
EXHAUSTED = "exhausted"
"""A refusal for the bound above (RESOURCE_EXHAUSTED on the wire)."""
_OWN_KEY = re.compile(r"own:[0-9a-f]{64}")


def paths_source(index: int) -> str:
    """The key of configured island `index`'s source under data.paths."""
    return f"data.paths[{index}]"


def own_source(digest: bytes) -> str:
    """The key of an own source with content identity `digest` (islands/chunks.py `source_digest`)."""
    return OWN + digest.hex()


class ChunkSources:
    """Every source's ledger and each island's source (module docstring). The caller holds any lock."""

    def __init__(self, layouts: Mapping[str, ChunkLayout], names: Sequence[str], max_sequences: int) -> None:
        """`layouts`: the configured sources (the corpus, or data.paths[i] for each configured island); `names`: the
        configured islands (islands.names), in order, the homes of the corpus's chunks or each of its own source's;
        `max_sequences`: the most one lease may ask for (a round's H x batch_size)."""
        self.max_sequences = max_sequences
        homes = {CORPUS: tuple(names)} if CORPUS in layouts else {paths_source(i): (n,) for i, n in enumerate(names)}
        self.ledgers: dict[str, ChunkLedger] = {
            key: ChunkLedger(layout, homes[key], max_sequences) for key, layout in layouts.items()
        }
        self.configured: dict[str, str] = {island: key for key, islands in homes.items() for island in islands}
        """Configured island -> the source it reads."""
        first = next(iter(layouts.values()))
        self._shape = (first.chunk_sequences, first.seed)
        """(chunk_sequences, seed) of every source's layout: the run's."""
        self._own: dict[str, str] = {}
        """Admitted island -> the own source it reads (the registry's `islands`)."""

    # -- which source ------------------------------------------------------------------------------------------

    @property
    def corpus(self) -> ChunkLedger | None:
        """The shared corpus's ledger (None under data.paths)."""
        return self.ledgers.get(CORPUS)

    def source_of(self, island: str) -> str | None:
        """The source `island` reads: its own, its configured one, else the corpus (None: it has none)."""
        key = self._own.get(island) or self.configured.get(island)
        if key is None and CORPUS in self.ledgers:
            key = CORPUS
        return key

    def ledger_of(self, island: str) -> ChunkLedger:
        key = self.source_of(island)
        if key is None:
            raise ChunkRefused(
                NOT_LEASED,
                f"island {island} reads no source of this run: data.paths gives one to each configured island, and "
                "an admitted island leases with its own (data.own_path) first",
            )
        return self.ledgers[key]

    def layouts(self) -> dict[str, ChunkLayout]:
        return {key: ledger.layout for key, ledger in self.ledgers.items()}

    def own_sources(self) -> list[str]:
        return [key for key in self.ledgers if key.startswith(OWN)]

    # -- an island's operations --------------------------------------------------------------------------------

    def lease(self, island: str, sequences: int) -> list[Span]:
        return self.ledger_of(island).lease(island, sequences)

    def record(self, island: str, sync: int, spans: Sequence[Span]) -> None:
        self.ledger_of(island).record(island, sync, spans)

    def drop(self, island: str, sync: int) -> None:
        for ledger in self.ledgers.values():
            ledger.drop(island, sync)

    def release(self, island: str) -> None:
        for ledger in self.ledgers.values():
            ledger.release(island)

    def readers(self) -> set[str]:
        return {island for ledger in self.ledgers.values() for island in ledger.readers()}

    # -- a sync's ------------------------------------------------------------------------------------------------

    def commit(self, sync: int, islands: Iterable[str]) -> dict[str, dict[str, list[Span]]]:
        """`ChunkLedger.commit` on every ledger: the consumed spans by source (those with any) and island."""
        members = tuple(islands)
        out = {key: ledger.commit(sync, members) for key, ledger in self.ledgers.items()}
        return {key: got for key, got in out.items() if got}

    def undo_after(self, sync: int) -> None:
        for ledger in self.ledgers.values():
            ledger.undo_after(sync)

    # -- own sources ---------------------------------------------------------------------------------------------

    def binding(self, island: str, digest: bytes, sequences: int, enrolled: Collection[str]) -> dict[str, Any] | None:
        """What `island` reading the own source `digest` (of `sequences` sequences) asks of the registry: None when
        it reads it already, else the registry after (`own_meta`'s shape; bindings of islands no longer in
        `enrolled` are dropped), to write before `adopt`. `ChunkRefused` when it may not: a configured island (it
        reads its configured source), an island that reads another own source, a size that disagrees with the
        source's, or a new source beyond MAX_OWN_SOURCES."""
        key = own_source(digest)
        if island in self.configured:
            raise ChunkRefused(
                INVALID, f"island {island} is configured: it reads {self.configured[island]}, not a source of its own"
            )
        bound = self._own.get(island)
        if bound == key:
            return None
        if bound is not None:
            raise ChunkRefused(
                INVALID,
                f"island {island} reads source {bound[:16]}...; its data.own_path now holds other tokens "
                f"({key[:16]}...): one island reads one source (admit another island to read another)",
            )
        ledger = self.ledgers.get(key)
        if ledger is not None and ledger.layout.sequences != sequences:
            raise ChunkRefused(
                INVALID, f"source {key[:16]}... holds {ledger.layout.sequences} sequences, not {sequences}"
            )
        owns = self.own_sources()
        if ledger is None and len(owns) >= MAX_OWN_SOURCES:
            raise ChunkRefused(
                EXHAUSTED, f"this run holds {MAX_OWN_SOURCES} sources that admitted islands brought, the most it may"
            )
        islands = {name: k for name, k in self._own.items() if name in enrolled}
        sources = {k: self.ledgers[k].layout.sequences for k in owns}
        return {"sources": {**sources, key: sequences}, "islands": {**islands, island: key}}

    def own_meta(self) -> dict[str, Any]:
        """The registry of own sources (sources.json): each one's size, and which island reads which."""
        return {"sources": {k: self.ledgers[k].layout.sequences for k in self.own_sources()}, "islands": self._own}

    def adopt(self, registry: Mapping[str, Any]) -> list[str]:
        """Take a registry (`binding`'s answer, or sources.json as read): every source in it gets a ledger, fresh
        when it has none (its home: its first reader); returns the keys that were new."""
        chunk_sequences, seed = self._shape
        islands = dict(registry["islands"])
        new = []
        for key, sequences in registry["sources"].items():
            if key not in self.ledgers:
                homes = [name for name, k in islands.items() if k == key][:1]
                layout = ChunkLayout(int(sequences), chunk_sequences, seed)
                self.ledgers[key] = ChunkLedger(layout, homes or [key], self.max_sequences)
                new.append(key)
        self._own = islands
        return new

    # -- durability ----------------------------------------------------------------------------------------------

    def to_meta(self) -> dict[str, Any]:
        """Every ledger, for the checkpoint: the corpus's under `chunks` (as a run of one source saves it), the
        others under `chunk_sources` with their size."""
        corpus = self.corpus
        others = {
            key: {"sequences": ledger.layout.sequences, **ledger.to_meta()}
            for key, ledger in self.ledgers.items()
            if key != CORPUS
        }
        return {**({"chunks": corpus.to_meta()} if corpus is not None else {}), "chunk_sources": others}

    def restore(self, meta: Mapping[str, Any]) -> None:
        """Back to the ledgers a checkpoint's `meta` saved (`to_meta`); an own source it holds that this run has not
        adopted yet gets its ledger."""
        if self.corpus is not None:
            self.corpus.restore(meta["chunks"])
        chunk_sequences, seed = self._shape
        for key, saved in meta.get("chunk_sources", {}).items():
            if key not in self.ledgers:
                if not _OWN_KEY.fullmatch(key):
                    continue  # a configured source this run's config does not have
                layout = ChunkLayout(int(saved["sequences"]), chunk_sequences, seed)
                self.ledgers[key] = ChunkLedger(layout, saved.get("homes") or [key], self.max_sequences)
            self.ledgers[key].restore(saved)


def registry_problem(registry: Any) -> str | None:
    """Why a registry read back from sources.json cannot be adopted (None: it can): the run dir's own file, checked
    all the same, so a damaged one is one line, not a traceback."""
    if not isinstance(registry, dict) or not isinstance(registry.get("sources"), dict):
        return "it is not an object with 'sources' and 'islands'"
    islands = registry.get("islands")
    if not isinstance(islands, dict):
        return "'islands' is not an object"
    sources = registry["sources"]
    if len(sources) > MAX_OWN_SOURCES:
        return f"it holds {len(sources)} sources, more than {MAX_OWN_SOURCES}"
    for key, sequences in sources.items():
        counted = isinstance(sequences, int) and not isinstance(sequences, bool) and sequences >= 1
        if not _OWN_KEY.fullmatch(key) or not counted:
            return f"the source {str(key)[:80]!r} is not own:<sha256> with a count of sequences"
    for island, key in islands.items():
        if key not in sources:
            return f"island {str(island)[:80]!r} reads a source the file does not hold"
    return None


def layout_fields(key: str, layout: ChunkLayout) -> dict[str, Any]:
    """A `chunks_layout` record of source `key`: its layout, and its key in `source` but for the corpus's (as a run of
    one source writes it)."""
    return {**({} if key == CORPUS else {"source": key}), **layout.to_meta()}
