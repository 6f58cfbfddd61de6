"""The corpus as chunks of sequences (data.sampling = "chunks"): its layout, and an island's stream over its leases.

The training split is cut into `sequences` = len(train) // (seq_len + 1) fixed-length sequences of seq_len + 1
tokens (sequence s is tokens[s·(seq_len+1) : (s+1)·(seq_len+1)]; the tail that fills no sequence is never read).
Each epoch e orders them by a seeded permutation, `order(e)`, and cuts that order into chunks of `chunk_sequences`
(the last chunk of an epoch may be shorter). A chunk is named by one int, e·chunks + i, so chunk ids of later epochs
follow those of earlier ones. Position p of chunk c is the p-th sequence of its slice of the epoch's order.

Who reads which chunk is the coordinator's ledger's decision (diloco/run/chunk_ledger.py); an island only reads the
spans it was leased, in order (`ChunkStream`). Both sides compute the same layout from the config alone, so a span
(chunk, start, end) names the same sequences in every process. numpy only: no JAX, no transport.

Each source has its own chunks (docs/architecture.md, "Chunked sampling": a ledger per source): the shared corpus,
each island's own source under data.paths, and an admitted island's own source (data.own_path), which the
coordinator knows only by what the island tells it: its content identity, `source_digest`, and its size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from islands.data import DataError


@dataclass(frozen=True)
class Span:
    """Sequences [start, end) of chunk `chunk`: what an island reads and what a push says it trained on."""

    chunk: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    def as_list(self) -> list[int]:
        """How a span travels in metrics.jsonl and checkpoints: [chunk, start, end]."""
        return [self.chunk, self.start, self.end]


@dataclass(frozen=True)
class ChunkLayout:
    """How many sequences, chunks and epochs: a pure function of the corpus size, data.chunk_sequences and the seed."""

    sequences: int
    """Sequences of seq_len + 1 tokens in the training split (one epoch)."""
    chunk_sequences: int
    seed: int
    _orders: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.sequences < 1:
            raise DataError(
                "data.sampling = 'chunks': the training split holds no whole sequence of model.seq_len + 1 tokens"
            )

    @property
    def chunks(self) -> int:
        """Chunks per epoch."""
        return -(-self.sequences // self.chunk_sequences)

    def epoch(self, chunk: int) -> int:
        return chunk // self.chunks

    def size(self, chunk: int) -> int:
        """Sequences in `chunk`: chunk_sequences, fewer for the last chunk of an epoch."""
        i = chunk % self.chunks
        return min(self.chunk_sequences, self.sequences - i * self.chunk_sequences)

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of the sequences (cached: the two newest epochs)."""
        got = self._orders.get(epoch)
        if got is None:
            got = np.random.default_rng((self.seed, 0xC4_0C5, epoch)).permutation(self.sequences)
            for old in sorted(self._orders)[:-1]:
                del self._orders[old]
            self._orders[epoch] = got
        return got

    def sequence_ids(self, span: Span) -> np.ndarray:
        """The corpus indices of the sequences `span` names, in reading order."""
        first = (span.chunk % self.chunks) * self.chunk_sequences
        return self.order(self.epoch(span.chunk))[first + span.start : first + span.end]

    def to_meta(self) -> dict[str, int]:
        """What the `chunks_layout` event records: enough for a checker to know every chunk's size."""
        return {"sequences": self.sequences, "chunk_sequences": self.chunk_sequences, "chunks": self.chunks}


def corpus_sequences(train_tokens: int, seq_len: int) -> int:
    """Whole sequences of seq_len + 1 tokens in a training split of `train_tokens` tokens."""
    return train_tokens // (seq_len + 1)


DIGEST_BLOCK_TOKENS = 1 << 22
"""Tokens hashed per step of `source_digest` (16 MiB as uint32): a memory-mapped source is never read whole."""


def source_digest(tokens: np.ndarray, layout: ChunkLayout, seq_len: int) -> bytes:
    """The content identity of a source: the SHA-256 of the token ids its chunks can name (the first
    layout.sequences x (seq_len + 1) tokens, as little-endian uint32, so the same tokens stored as uint16 or uint32
    are the same source), with the sequence length. Two files with these tokens are one source wherever they lie,
    and one path that holds other tokens is another."""
    h = hashlib.sha256(f"diloco source: seq_len {seq_len}\n".encode())
    end = layout.sequences * (seq_len + 1)
    for lo in range(0, end, DIGEST_BLOCK_TOKENS):
        h.update(np.asarray(tokens[lo : min(end, lo + DIGEST_BLOCK_TOKENS)], dtype="<u4").tobytes())
    return h.digest()


class ChunkStream:
    """An island's batches under data.sampling = "chunks": the spans the coordinator leased it (`begin`), read in
    order, batch_size sequences a batch (an `islands.island.Batches`).

    The cursor counts the batches drawn since the plan began; `taken` is what they read. A push reports what the
    batches drawn since the previous push read (`claim`), which the coordinator's ledger checks against its leases:
    with one push a round that is `taken`; with Streaming DiLoCo each fragment's push claims its own steps. Nothing
    here decides what to read next."""

    def __init__(
        self, tokens: np.ndarray, layout: ChunkLayout, batch_size: int, seq_len: int, source: bytes = b""
    ) -> None:
        """`source`: an admitted island's own source, its `source_digest`, which its leases name; b"" for a source
        of the run's config (the shared corpus, or the island's data.paths entry), which the coordinator knows."""
        if np.ndim(tokens) != 1 or len(tokens) < layout.sequences * (seq_len + 1):
            raise DataError(f"the training split ({len(tokens)} tokens) is shorter than the chunk layout's sequences")
        self.tokens = tokens
        self.layout = layout
        self.source = source
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.cursor = 0
        self.plan: tuple[Span, ...] = ()
        self.claimed = 0
        """The batches of the plan that a push has claimed already (`claim`)."""
        self._window = np.arange(seq_len + 1)

    def begin(self, plan: Sequence[Span]) -> None:
        """Read `plan` from its start (the spans the coordinator leased for the next round)."""
        self.plan = tuple(plan)
        self.cursor = self.claimed = 0

    @property
    def planned(self) -> int:
        return sum(s.length for s in self.plan)

    def taken(self) -> list[Span]:
        """The prefix of the plan that the batches drawn so far read, span by span."""
        return self._read(0, self.cursor)

    def claim(self) -> list[Span]:
        """What the batches drawn since the last claim (or since the plan began) read, span by span; they are claimed
        from here on."""
        spans = self._read(self.claimed, self.cursor)
        self.claimed = self.cursor
        return spans

    def _read(self, first: int, end: int) -> list[Span]:
        """The spans of the plan that batches [first, end) read, in order."""
        skip, left, out = first * self.batch_size, (end - first) * self.batch_size, []
        for span in self.plan:
            if left <= 0:
                break
            if skip >= span.length:
                skip -= span.length
                continue
            n = min(left, span.length - skip)
            out.append(Span(span.chunk, span.start + skip, span.start + skip + n))
            skip, left = 0, left - n
        return out

    def next(self) -> np.ndarray:
        """int32 [batch_size, seq_len + 1]: the plan's next batch_size sequences; then advance the cursor."""
        first = self.cursor * self.batch_size
        if first + self.batch_size > self.planned:
            raise DataError(
                f"the chunks leased for this round hold {self.planned} sequences; batch {self.cursor} needs "
                f"{first + self.batch_size}"
            )
        ids = [self.layout.sequence_ids(span) for span in self._read(self.cursor, self.cursor + 1)]
        starts = np.concatenate(ids) * (self.seq_len + 1)
        self.cursor += 1
        return np.asarray(self.tokens[starts[:, None] + self._window], dtype=np.int32)
