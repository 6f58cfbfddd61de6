"""An island's data: the corpus split into per-island training shards and a validation split, and
deterministic, resumable batch streams over a shard.

DiLoCo (arXiv 2311.08105) trains each island on its own data: IID (one corpus cut into contiguous,
disjoint shards, `data.path`) or non-IID (one source per island, `data.paths`). Every source keeps its
last `val_fraction` as held-out validation data.

Batch k of an island is a pure function of (seed, island index, k): random windows whose offsets come
from `np.random.default_rng((seed, island, k))`. The only state is the host int k (the cursor), which the
island checkpoints, so a resumed island neither repeats nor skips a batch, and a re-run is bit-identical.
Corpora are memory-mapped (np.memmap) so an island touches only the pages its windows read.
"""

from __future__ import annotations

import bisect
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

KINDS: tuple[str, ...] = ("text", "tokens", "synthetic")
TOKEN_DTYPES: tuple[str, ...] = ("uint16", "uint32")

FULL_CHECK_TOKENS = 1 << 26
"""Files up to this many tokens get every token id checked against the vocabulary; larger ones a sample."""

_CHUNK = 1 << 22


class DataError(ValueError):
    """A user error in the data section of the config or in the data itself (missing, empty, too small)."""


def _check_count(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; `batch_size = true` is a mistake, not the number 1.
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum} (got {value!r})")
    return int(value)


@dataclass(frozen=True)
class DataConfig:
    """Where an island's tokens come from (the `[data]` table of a run config)."""

    kind: str = "text"
    """"text" (raw bytes of the files, one token per byte), "tokens" (pre-tokenized ids stored as a flat
    little-endian array of token_dtype, read through np.memmap) or "synthetic" (a generated corpus)."""

    path: str = ""
    """One corpus shared by all islands (IID): a file, a directory (all its files, sorted by name, hidden
    files skipped) or a glob pattern (matches sorted). Split into disjoint per-island shards, see
    shard_block_tokens."""

    shard_block_tokens: int = 8192
    """IID split granularity: the training corpus is cut into blocks of this many tokens, which a seeded
    shuffle deals out to the islands, so every island's shard samples the whole corpus (contiguous quarters of
    a corpus ordered by topic, play or date would not be IID). 0 = one contiguous slice per island."""

    paths: tuple[str, ...] = ()
    """Non-IID data: one source (file, directory or glob) per island, in island order; its length must
    equal the number of islands. Mutually exclusive with path."""

    token_dtype: str = "uint16"
    """kind = "tokens" only: the integer type of the stored token ids, "uint16" or "uint32"."""

    val_fraction: float = 0.05
    """Fraction in (0, 1) held out at the tail of each source for validation."""

    synthetic_tokens: int = 200_000
    """kind = "synthetic" only: length of the generated corpus (an order-2 Markov chain, see
    `synthetic_tokens`)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DataError(f"data.kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        if not isinstance(self.path, str):
            raise DataError(f"data.path must be a string (got {self.path!r})")
        if isinstance(self.paths, str) or not isinstance(self.paths, list | tuple):
            raise DataError(f"data.paths must be a list of strings (got {self.paths!r})")
        # TOML gives lists; keep a tuple so the frozen config stays hashable.
        object.__setattr__(self, "paths", tuple(self.paths))
        for i, p in enumerate(self.paths):
            if not isinstance(p, str) or not p:
                raise DataError(f"data.paths[{i}] must be a non-empty string (got {p!r})")
        if self.token_dtype not in TOKEN_DTYPES:
            raise DataError(f"data.token_dtype must be one of {', '.join(TOKEN_DTYPES)} (got {self.token_dtype!r})")
        vf = self.val_fraction
        if not isinstance(vf, int | float) or isinstance(vf, bool) or not 0 < vf < 1:
            raise DataError(f"data.val_fraction must be a number in (0, 1) (got {vf!r})")
        object.__setattr__(self, "val_fraction", float(vf))
        _check_count("data.synthetic_tokens", self.synthetic_tokens, 2)
        _check_count("data.shard_block_tokens", self.shard_block_tokens, 0)
        if self.path and self.paths:
            raise DataError(
                "data.path and data.paths are both set: use data.path for one corpus shared by all "
                "islands (IID) or data.paths for one source per island (non-IID)"
            )
        if self.kind == "synthetic" and (self.path or self.paths):
            raise DataError(
                "data.path and data.paths must be empty for data.kind = 'synthetic' (it generates its data)"
            )
        if self.kind != "synthetic" and not (self.path or self.paths):
            raise DataError(f"data.path (or data.paths, one per island) must be set for data.kind = {self.kind!r}")


@dataclass(frozen=True)
class TokenSource:
    """One loaded source: its training tokens and its held-out tail (1-D integer arrays, memmap views
    where the source is a single file)."""

    name: str
    """How errors refer to it, e.g. "data.path 'corpus.txt'"."""
    train: np.ndarray
    val: np.ndarray


def resolve_files(spec: str, where: str) -> list[str]:
    """The files a path spec names: a file, a directory's files (sorted) or a glob's matches (sorted)."""
    spec = os.path.expanduser(spec)
    if any(c in spec for c in "*?["):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"{where}: no files match this pattern")
    elif os.path.isdir(spec):
        names = sorted(n for n in os.listdir(spec) if not n.startswith("."))
        files = [os.path.join(spec, n) for n in names if os.path.isfile(os.path.join(spec, n))]
        if not files:
            raise DataError(f"{where}: the directory has no files")
    elif os.path.isfile(spec):
        files = [spec]
    else:
        raise DataError(f"{where}: no such file or directory")
    return files


def _map_file(path: str, dtype: np.dtype, where: str) -> np.ndarray:
    try:
        size = os.path.getsize(path)
        if size == 0:
            raise DataError(f"{where}: the file is empty")
        if size % dtype.itemsize:
            raise DataError(
                f"{where}: the file has {size} bytes, not a whole number of {dtype.name} tokens "
                f"({dtype.itemsize} bytes each; check data.token_dtype)"
            )
        return np.memmap(path, dtype=dtype, mode="r")
    except OSError as err:
        raise DataError(f"{where}: cannot read the file ({err.strerror or err})") from err


def check_vocab(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Raise DataError if a token id is >= vocab_size: every id of files up to FULL_CHECK_TOKENS tokens,
    else 16 evenly spaced chunks and the tail (a full pass would read the whole corpus at every start)."""
    if np.iinfo(tokens.dtype).max < vocab_size:
        return
    n = len(tokens)
    if n <= FULL_CHECK_TOKENS:
        starts = range(0, n, _CHUNK)
    else:
        starts = sorted({*np.linspace(0, n - _CHUNK, 16).astype(np.int64).tolist(), n - _CHUNK})
    for start in starts:
        chunk = np.asarray(tokens[start : start + _CHUNK])
        if chunk.max() >= vocab_size:
            i = int(np.argmax(chunk >= vocab_size))
            raise DataError(
                f"{where}: token id {int(chunk[i])} at index {start + i} is >= model.vocab_size "
                f"({vocab_size}) (wrong data.token_dtype or model.vocab_size?)"
            )


def synthetic_tokens(n: int, vocab_size: int, seed: int, alphabet: int = 32, branching: int = 4) -> np.ndarray:
    """n tokens from a random order-2 Markov chain, deterministic for (vocab_size, seed).

    The chain runs over `alphabet` distinct token ids drawn from the vocabulary; each context (previous
    two symbols) allows `branching` successors with Dirichlet(1) probabilities. Its entropy rate is at
    most log(branching) nats (1.39 by default), far below log(vocab_size), so a model's loss can fall
    well below the uniform level: a quick, data-free check that training and DiLoCo rounds work.
    """
    rng = np.random.default_rng((seed, 0x5EED))
    a = min(vocab_size, alphabet)
    b = min(branching, a)
    symbols = rng.choice(vocab_size, size=a, replace=False)
    successors = rng.permuted(np.tile(np.arange(a), (a * a, 1)), axis=1)[:, :b].tolist()
    cdf = np.cumsum(rng.dirichlet(np.ones(b), size=a * a), axis=1).tolist()
    draws = rng.random(n).tolist()
    prev2, prev1 = (int(s) for s in rng.integers(a, size=2))
    out = [0] * n
    # The chain is inherently sequential; plain Python lists keep this at ~1 us per token.
    for t, u in enumerate(draws):
        ctx = prev2 * a + prev1
        nxt = successors[ctx][min(bisect.bisect_right(cdf[ctx], u), b - 1)]
        out[t] = nxt
        prev2, prev1 = prev1, nxt
    return symbols[np.asarray(out, dtype=np.int64)].astype(np.int32)


def split_tail(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(head, tail) where the tail is the last val_fraction of the tokens (at least one token)."""
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def open_source(cfg: DataConfig, spec: str, where: str, vocab_size: int, seed: int) -> TokenSource:
    """Load one source (for kind = "synthetic", spec is ignored) and split off its validation tail."""
    if cfg.kind == "synthetic":
        tokens = synthetic_tokens(cfg.synthetic_tokens, vocab_size, seed)
    else:
        dtype = np.dtype(np.uint8 if cfg.kind == "text" else cfg.token_dtype)
        arrays = []
        files = resolve_files(spec, where)
        for path in files:
            # Name the file only when the spec (a directory or glob) does not already.
            label = where if files == [os.path.expanduser(spec)] else f"{where}: file {path!r}"
            arr = _map_file(path, dtype, label)
            check_vocab(arr, vocab_size, label)
            arrays.append(arr)
        # A single file stays a zero-copy memmap; several are concatenated in memory.
        tokens = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    train, val = split_tail(tokens, cfg.val_fraction)
    return TokenSource(name=where, train=train, val=val)


def split_iid(tokens: np.ndarray, n_islands: int, block: int, seed: int) -> list[np.ndarray]:
    """Disjoint shards covering `tokens`: blocks of `block` tokens dealt to islands in a seeded random order
    (each shard keeps its blocks in corpus order), or contiguous slices when block is 0 or there is one island
    (a single memmapped file is then never copied). A corpus too small for 8 blocks per island gets smaller
    blocks."""
    n = len(tokens)
    if block == 0 or n_islands == 1:
        bounds = [i * n // n_islands for i in range(n_islands + 1)]
        return [tokens[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    block = max(1, min(block, n // (8 * n_islands)))  # a small corpus still deals each island >= 8 blocks
    n_blocks = -(-n // block)
    order = np.random.default_rng((seed, n_islands, block)).permutation(n_blocks)
    shards = []
    for i in range(n_islands):
        mine = np.sort(order[i::n_islands])
        parts = [tokens[b * block : (b + 1) * block] for b in mine]
        shards.append(np.concatenate(parts) if parts else tokens[:0])
    return shards


def load_sources(
    cfg: DataConfig, n_islands: int, vocab_size: int, seed: int, seq_len: int = 1
) -> tuple[list[np.ndarray], np.ndarray]:
    """(training tokens of each island, validation tokens).

    IID (data.path or synthetic): the corpus's tail is the validation split and the rest is cut into
    n_islands contiguous, disjoint shards covering it. Non-IID (data.paths): source i is island i's
    training data minus its tail; the validation split is all tails concatenated in island order.
    Every shard and the validation split must hold at least seq_len + 1 tokens (one example).
    """
    _check_count("n_islands", n_islands, 1)
    _check_count("model.vocab_size", vocab_size, 1)
    _check_count("seed", seed, 0)
    need = _check_count("model.seq_len", seq_len, 1) + 1
    if cfg.paths:
        if len(cfg.paths) != n_islands:
            raise DataError(
                f"data.paths has {len(cfg.paths)} entries but there are {n_islands} islands "
                "(non-IID data needs exactly one source per island)"
            )
        sources = [open_source(cfg, p, f"data.paths[{i}] {p!r}", vocab_size, seed) for i, p in enumerate(cfg.paths)]
        for i, src in enumerate(sources):
            if len(src.train) < need:
                raise DataError(
                    f"{src.name}: island {i}'s training data has {len(src.train)} tokens after the "
                    f"validation tail but seq_len + 1 = {need} are needed"
                )
        shards = [src.train for src in sources]
        val = np.concatenate([src.val for src in sources])
        name = "data.paths"
    else:
        where = (
            f"data.synthetic_tokens ({cfg.synthetic_tokens})" if cfg.kind == "synthetic" else f"data.path {cfg.path!r}"
        )
        src = open_source(cfg, cfg.path, where, vocab_size, seed)
        shards = split_iid(src.train, n_islands, cfg.shard_block_tokens, seed)
        n = len(src.train)
        for i, shard in enumerate(shards):
            if len(shard) < need:
                raise DataError(
                    f"{where}: island {i}'s training shard has {len(shard)} tokens but seq_len + 1 = {need} "
                    f"are needed ({n} training tokens are too few for {n_islands} islands)"
                )
        val, name = src.val, where
    if len(val) < need:
        raise DataError(
            f"{name}: the validation split has {len(val)} tokens but seq_len + 1 = {need} are needed "
            "(raise data.val_fraction or use more data)"
        )
    return shards, val


class BatchStream:
    """Deterministic batches from one island's shard: batch k is a pure function of (seed, stream_id, k).

    The cursor is k, a host int: checkpoint it, and a stream resumed at that cursor neither repeats nor
    skips a batch. stream_id is the island's index, so islands sharing a shard still draw different
    windows.
    """

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, stream_id: int, cursor: int = 0
    ) -> None:
        self.batch_size = _check_count("batch_size", batch_size, 1)
        self.seq_len = _check_count("model.seq_len", seq_len, 1)
        self.seed = _check_count("seed", seed, 0)
        self.stream_id = _check_count("stream_id", stream_id, 0)
        self.cursor = _check_count("cursor", cursor, 0)
        if np.ndim(tokens) != 1:
            raise DataError(f"island {stream_id}'s tokens must be a 1-D array (got shape {np.shape(tokens)})")
        self.tokens = tokens
        self._window = np.arange(seq_len + 1)
        self._n_offsets = len(tokens) - seq_len  # offsets 0 .. len - (seq_len + 1) inclusive
        if self._n_offsets < 1:
            raise DataError(
                f"island {stream_id}'s training shard has {len(tokens)} tokens but seq_len + 1 = "
                f"{seq_len + 1} are needed (too many islands for this data, or seq_len too long)"
            )

    def batch_at(self, k: int) -> np.ndarray:
        """int32 [batch_size, seq_len + 1]: batch_size windows at offsets drawn for (seed, stream_id, k)."""
        k = _check_count("batch index", k, 0)
        rng = np.random.default_rng((self.seed, self.stream_id, k))
        offsets = rng.integers(0, self._n_offsets, size=self.batch_size)
        return np.asarray(self.tokens[offsets[:, None] + self._window], dtype=np.int32)

    def next(self) -> np.ndarray:
        """batch_at(cursor), then advance the cursor."""
        batch = self.batch_at(self.cursor)
        self.cursor += 1
        return batch

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        return self.next()


def eval_batches(val_tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int) -> list[np.ndarray]:
    """n_batches int32 [batch_size, seq_len + 1] batches of windows evenly spaced over the validation
    split, the same at every call (no rng), so eval losses are comparable across rounds and islands."""
    _check_count("n_batches", n_batches, 1)
    _check_count("batch_size", batch_size, 1)
    width = _check_count("model.seq_len", seq_len, 1) + 1
    if len(val_tokens) < width:
        raise DataError(
            f"the validation split has {len(val_tokens)} tokens but seq_len + 1 = {width} are needed "
            "(raise data.val_fraction or use more data)"
        )
    offsets = np.linspace(0, len(val_tokens) - width, n_batches * batch_size).round().astype(np.int64)
    windows = np.asarray(val_tokens[offsets[:, None] + np.arange(width)], dtype=np.int32)
    return list(windows.reshape(n_batches, batch_size, width))
