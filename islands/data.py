"""An island's data: the corpus split into per-island training shards and a validation split, and
deterministic, resumable batch streams over a shard.

DiLoCo (arXiv 2311.08105) trains each island on its own data: IID (one corpus cut into contiguous,
disjoint shards, `data.path`) or non-IID (one source per island, `data.paths`). Every source keeps its
last `val_fraction` as held-out validation data.

Batch k of an island is a pure function of (seed, island index, k): random windows whose offsets come
from `np.random.default_rng((seed, island, k))`. The only state is the host int k (the cursor), which the
island checkpoints, so a resumed island neither repeats nor skips a batch, and a re-run is bit-identical.
A single-file corpus is memory-mapped (np.memmap) so an island touches only the pages its windows read;
a multi-file source is read once into one array.

Built-in corpus: the source spec `stdlib:` (data.kind = "text") is the running Python's own standard-library
sources, read at run time from `sysconfig.get_paths()["stdlib"]` (never copied into the repo), so a fresh clone
trains with no download and no extra data. `stdlib:email,json` keeps only those top-level packages and modules:
one family per island in `data.paths` gives non-IID data. See `stdlib_files` for what is included. The corpus is
whatever Python runs the job, so losses and digests are comparable only across runs on the same Python version.

An island process passes `load_sources(..., only={i})` and the coordinator `only=set()`: other islands' training
data is then neither read nor copied (non-IID sources are read only for their validation tails).
"""

from __future__ import annotations

import bisect
import difflib
import glob
import os
import sysconfig
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from floor.errors import UserError
from floor.fields import LOCAL
from islands import documents, prepared

if TYPE_CHECKING:
    from islands.documents import CorpusTokenizer

KINDS: tuple[str, ...] = ("text", "tokens", "synthetic", "jsonl", "parquet")
DOCUMENT_KINDS: tuple[str, ...] = ("jsonl", "parquet")
"""The kinds whose files hold documents in a text field, tokenized by the run's tokenizer (islands/documents.py)."""
SAMPLINGS: tuple[str, ...] = ("windows", "chunks")
TOKEN_DTYPES: tuple[str, ...] = ("uint16", "uint32")

FULL_CHECK_TOKENS = 1 << 26
"""Files up to this many tokens get every token id checked against the vocabulary; larger ones a sample."""

_CHUNK = 1 << 22

STDLIB_PREFIX = "stdlib:"
"""A source spec starting with this names the built-in corpus (see `stdlib_files`)."""

STDLIB_TEST_DIRS: frozenset[str] = frozenset({"test", "tests", "idle_test"})
"""Directories skipped at any depth of the standard library: its test suites (Lib/test, ctypes/test,
unittest/test, distutils/tests, lib2to3/tests, idlelib/idle_test, tkinter/test, ...)."""

STDLIB_FIXTURES: frozenset[str] = frozenset({"__hello__", "__phello__"})
"""Top-level modules skipped: fixtures of the frozen-module tests, not library code."""


class DataError(UserError, ValueError):
    """A user error in the data section of the config or in the data itself (missing, empty, too small): a
    UserError, so the CLI prints it as one line with exit code 2."""


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
    little-endian array of token_dtype, read through np.memmap), "synthetic" (a generated corpus), "jsonl" or
    "parquet" (documents in data.text_field of *.jsonl / *.jsonl.gz or *.parquet shards, as Hugging Face dataset
    repositories keep them, tokenized by the run's tokenizer into a cached token file: islands/documents.py)."""

    path: str = ""
    """One corpus shared by all islands (IID): a file, a directory (all its files, sorted by name, hidden
    files skipped), a glob pattern (matches sorted), or "stdlib:" (kind = "text" only), the built-in corpus:
    the installed Python's standard-library .py sources without their test suites (about 12 MB), read at run
    time; "stdlib:json,email" keeps only those top-level packages or modules. Relative paths are relative to
    the current directory. With kind = "tokens", a directory written by `diloco data prepare` is read as its
    tokens.bin, checked against its meta.json (islands/prepared.py). Split into disjoint per-island shards, see
    shard_block_tokens."""

    shard_block_tokens: int = 8192
    """IID split granularity: the training corpus is cut into blocks of this many tokens, which a seeded
    shuffle deals out to the islands, so every island's shard samples the whole corpus (contiguous quarters of
    a corpus ordered by topic, play or date would not be IID). 0 = one contiguous slice per island."""

    paths: tuple[str, ...] = ()
    """Non-IID data: one source (file, directory, glob or "stdlib:NAME,...") per island, in island order; its
    length must equal the number of islands. Mutually exclusive with path. With the built-in corpus, give each
    island its own family of standard-library packages, e.g. ["stdlib:email,http", "stdlib:asyncio,concurrent",
    "stdlib:json,xml"] (comma-separated top-level package or module names)."""

    token_dtype: str = "uint16"
    """kind = "tokens" only: the integer type of the stored token ids, "uint16" or "uint32"."""

    val_fraction: float = 0.05
    """Fraction in (0, 1) held out at the tail of each source for validation."""

    synthetic_tokens: int = 200_000
    """kind = "synthetic" only: length of the generated corpus (an order-2 Markov chain, see
    `synthetic_tokens`)."""

    own_path: str = field(default="", metadata=LOCAL)
    """An island admitted into a live run (`diloco admit`) that brings its own source trains on it: a path as
    data.path takes (the same kind). Per process, not part of the run's identity: only that island reads it, and
    the run's validation split stays the shared one. Under data.sampling = "chunks" it reads chunks of it from a ledger
    of its own, which the coordinator keys by the source's content. "": it trains on the shared corpus."""

    sampling: str = "windows"
    """How an island draws its batches. "windows" (the default: existing runs reproduce bit for bit): random windows
    of its own shard, a pure function of (seed, island, batch index), so over a run some windows repeat and some
    tokens are never seen. "chunks": the training split as fixed-length sequences of model.seq_len + 1 tokens in a
    seeded global order, cut into chunks of data.chunk_sequences that the coordinator leases to islands; every
    sequence is trained on once per epoch, whatever islands join and leave (docs/architecture.md, "Chunked
    sampling"). Each source has its own chunks and ledger: the shared corpus, each island's data.paths entry, and
    the source an admitted island brings (data.own_path, known to the coordinator by its content). DiLoCo rounds
    only (train.mode = "diloco" or "async", no streaming)."""

    chunk_sequences: int = 64
    """data.sampling = "chunks" only: sequences per chunk, the unit the coordinator leases. Many more chunks than
    islands let joiners and re-leases find free ones; fewer keep the coordinator's ledger and its checkpoint small."""

    text_field: str = "text"
    """data.kind = "jsonl" or "parquet" only: the field (JSONL) or column (Parquet) that holds a document's text."""

    tokenizer: str = ""
    """The run's Hugging Face tokenizer.json (islands/text.py `tokenizer_file`): it tokenizes the documents of
    data.kind = "jsonl" or "parquet" (its tokenizer_config.json beside it, when there is one, gives the end-of-sequence
    token that ends each document), post-training data and `diloco sample`'s prompts. A run from a Hugging Face
    checkpoint (init.from) that names none takes the checkpoint's. Not with data.kind = "tokens", whose prepared
    directory carries its own (one of another tokenizer than the checkpoint's is refused: diloco/config.py); with
    data.kind = "text" only for a run that trains on no corpus (a byte corpus is not text for a tokenizer's model:
    diloco/config.py refuses it)."""

    cache_dir: str = field(default="", metadata=LOCAL)
    """data.kind = "jsonl" or "parquet" only: where the tokenized documents are kept, one token file per (shards,
    tokenizer), tokenized by the first process that needs it ("": $XDG_CACHE_HOME/diloco/tokens, else
    ~/.cache/diloco/tokens). Per process, not part of the run's identity."""

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise DataError(f"data.sampling must be one of {', '.join(SAMPLINGS)} (got {self.sampling!r})")
        _check_count("data.chunk_sequences", self.chunk_sequences, 1)
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
        for key in ("text_field", "tokenizer", "cache_dir"):
            if not isinstance(getattr(self, key), str):
                raise DataError(f"data.{key} must be a string (got {getattr(self, key)!r})")
        if not self.text_field:
            raise DataError("data.text_field must name the field that holds a document's text (e.g. 'text')")
        if self.tokenizer and self.kind == "tokens":
            raise DataError(
                "data.tokenizer is the run's tokenizer; data.kind = 'tokens' has it already: the tokenizer.json that "
                "`diloco data prepare` writes beside the tokens"
            )
        if self.kind in ("tokens", *DOCUMENT_KINDS):
            specs = [("data.path", self.path), *((f"data.paths[{i}]", p) for i, p in enumerate(self.paths))]
            for key, spec in specs:
                if spec.startswith(STDLIB_PREFIX):
                    raise DataError(f"{key} {spec!r} is text: the built-in corpus needs data.kind = 'text'")


@dataclass(frozen=True)
class TokenSource:
    """One loaded source: its training tokens and its held-out tail (1-D integer arrays, memmap views
    where the source is a single file)."""

    name: str
    """How errors refer to it, e.g. "data.path 'corpus.txt'"."""
    train: np.ndarray
    """Empty when the source was opened for its validation tail only (see n_train)."""
    val: np.ndarray
    n_train: int
    """Length of the training part, known even when it was not read (for the too-small checks)."""


def _missing_hint(key: str) -> str:
    """The override that fixes a missing source: a fresh clone has no data files, but always the built-in corpus."""
    if key == "data.path":
        return "set data.path=FILE, or data.path=stdlib: for the built-in corpus"
    return f"fix {key}: a FILE, or 'stdlib:NAME,...' for part of the built-in corpus"


def resolve_files(spec: str, where: str, key: str = "data.path") -> list[str]:
    """The files a path spec names: a file, a directory's files (sorted), a glob's matches (sorted), or the
    built-in corpus ("stdlib:..."; see stdlib_files). key (e.g. "data.paths[1]") is named in the error."""
    if spec.startswith(STDLIB_PREFIX):
        return stdlib_files(spec[len(STDLIB_PREFIX) :], where)
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
        raise DataError(f"{where}: no such file or directory ({_missing_hint(key)})")
    return files


def _stdlib_top_level(root: str) -> dict[str, str]:
    """Importable top-level names of the standard library -> their path (a package dir or a module file).

    Only identifiers count, which leaves out site-packages, lib-dynload, config-3.x-* and the machine-specific
    _sysconfigdata_*-*.py; test suites and fixtures are left out too."""
    out: dict[str, str] = {}
    try:
        entries = list(os.scandir(root))
    except OSError:
        return out
    for entry in entries:
        name = entry.name
        if entry.is_dir():
            stem = name
        elif name.endswith(".py") and entry.is_file():
            stem = name[:-3]
        else:
            continue
        if stem.isidentifier() and stem != "__pycache__" and stem not in STDLIB_TEST_DIRS | STDLIB_FIXTURES:
            out[stem] = entry.path
    return out


def _package_files(top: str, rel: str, out: list[tuple[str, str]]) -> None:
    """Append (relative path, path) of every non-empty .py module under package dir `top`, skipping test
    suites, test_*.py, caches and non-importable directories."""
    try:
        entries = list(os.scandir(top))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        if entry.is_dir():
            if name.isidentifier() and name != "__pycache__" and name not in STDLIB_TEST_DIRS:
                _package_files(entry.path, f"{rel}/{name}", out)
        elif (
            name.endswith(".py")
            and name[:-3].isidentifier()
            and not name.startswith("test_")
            and entry.is_file()
            and entry.stat().st_size > 0
        ):
            out.append((f"{rel}/{name}", entry.path))


def stdlib_files(names: str, where: str) -> list[str]:
    """The built-in corpus: the .py sources of the running Python's standard library
    (`sysconfig.get_paths()["stdlib"]`), read where they are installed.

    `names` is "" (the whole library) or comma-separated top-level package or module names ("email,json").
    Included: every importable module (a .py file whose name, and whose directories' names, are identifiers).
    Excluded: site-packages, compiled extensions, test suites (directories named test, tests or idle_test at
    any depth, and files named test_*.py), the frozen-module fixtures __hello__ and __phello__, and empty
    files (mostly bare __init__.py, which add no tokens). Files are sorted by their '/'-separated path
    relative to the stdlib directory, so the corpus is the same on every run of the same Python."""
    root = sysconfig.get_paths()["stdlib"]
    top = _stdlib_top_level(root)
    wanted = [n.strip() for n in names.split(",")] if names.strip() else sorted(top)
    for name in wanted:
        if name in top:
            continue
        if not name:
            raise DataError(f"{where}: an empty name in the list (write e.g. 'stdlib:email,json')")
        if name in STDLIB_TEST_DIRS | STDLIB_FIXTURES:
            raise DataError(f"{where}: '{name}' is test code, which the built-in corpus leaves out")
        if "." in name:
            raise DataError(f"{where}: '{name}': name top-level packages or modules only (e.g. '{name.split('.')[0]}')")
        close = difflib.get_close_matches(name, list(top), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise DataError(f"{where}: no standard-library package or module '{name}' in {root}{hint}")
    found: list[tuple[str, str]] = []
    for name in sorted(set(wanted)):
        path = top[name]
        if path.endswith(".py"):
            if os.path.getsize(path) > 0:
                found.append((f"{name}.py", path))
        else:
            _package_files(path, name, found)
    if not found:
        what = f"'{names}'" if names.strip() else "the standard library"
        raise DataError(f"{where}: {what} has no .py sources in {root} (is this a Python without its sources?)")
    return [path for _, path in sorted(found)]


def _token_count(path: str, dtype: np.dtype, where: str) -> int:
    """How many tokens the file holds, without reading it (the sizes locate the validation tail)."""
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise DataError(f"{where}: cannot read the file ({err.strerror or err})") from err
    if size == 0:
        raise DataError(f"{where}: the file is empty")
    if size % dtype.itemsize:
        raise DataError(
            f"{where}: the file has {size} bytes, not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each; check data.token_dtype)"
        )
    return size // dtype.itemsize


def _read_tokens(
    files: list[str], counts: list[int], labels: list[str], dtype: np.dtype, vocab_size: int, lo: int
) -> np.ndarray:
    """Tokens lo.. of the files' concatenation, each file's part checked against the vocabulary.

    One file stays a zero-copy memmap (only the pages used are ever read). Several files are read with one
    readinto each straight into a single array (a memmap per file and then a concatenation would copy twice,
    which for the standard library's ~700 small files is the slower way), skipping files that end before lo."""
    if len(files) == 1:
        try:
            arr = np.memmap(files[0], dtype=dtype, mode="r")[lo:]
        except OSError as err:
            raise DataError(f"{labels[0]}: cannot read the file ({err.strerror or err})") from err
        check_vocab(arr, vocab_size, labels[0], base=lo)
        return arr
    out = np.empty(sum(counts) - lo, dtype)
    raw = memoryview(out.view(np.uint8))
    size = dtype.itemsize
    start = pos = 0
    for path, count, label in zip(files, counts, labels, strict=True):
        skip = min(max(0, lo - start), count)  # tokens of this file before lo
        start += count
        n = count - skip
        if n == 0:
            continue
        try:
            with open(path, "rb") as f:
                f.seek(skip * size)
                got = f.readinto(raw[pos * size : (pos + n) * size])
        except OSError as err:
            raise DataError(f"{label}: cannot read the file ({err.strerror or err})") from err
        if got != n * size:
            raise DataError(f"{label}: the file changed while it was being read")
        check_vocab(out[pos : pos + n], vocab_size, label, base=skip)
        pos += n
    return out


def check_vocab(tokens: np.ndarray, vocab_size: int, where: str, base: int = 0) -> None:
    """Raise DataError if a token id is >= vocab_size, naming the first such id and the largest id read (the
    vocabulary the data needs): every id of files up to FULL_CHECK_TOKENS tokens, else 16 evenly spaced chunks and
    the tail (a full pass would read the whole corpus at every start). base: the index of tokens[0] in its file, so
    the error points into the file."""
    if np.iinfo(tokens.dtype).max < vocab_size:
        return
    n = len(tokens)
    whole = n <= FULL_CHECK_TOKENS
    if whole:
        starts = range(0, n, _CHUNK)
    else:
        starts = sorted({*np.linspace(0, n - _CHUNK, 16).astype(np.int64).tolist(), n - _CHUNK})
    first: tuple[int, int] | None = None  # (index, id) of the first id beyond the vocabulary
    largest = 0
    for start in starts:
        chunk = np.asarray(tokens[start : start + _CHUNK])
        if not chunk.size:
            continue
        largest = max(largest, int(chunk.max()))
        if first is None and largest >= vocab_size:
            i = int(np.argmax(chunk >= vocab_size))
            first = (base + start + i, int(chunk[i]))
    if first is not None:
        read = "" if whole else f" of the {len(starts)} parts read"
        raise DataError(
            f"{where}: token id {first[1]} at index {first[0]} is >= model.vocab_size ({vocab_size}); the largest "
            f"id{read} is {largest} (wrong data.token_dtype, or tokens of a larger vocabulary than the model's?)"
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


def _n_val(n: int, val_fraction: float) -> int:
    return max(1, int(n * val_fraction))


def split_tail(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(head, tail) where the tail is the last val_fraction of the tokens (at least one token)."""
    n_val = _n_val(len(tokens), val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]


def _prepared(cfg: DataConfig, spec: str, where: str, vocab_size: int) -> str:
    """The path to read for spec: a prepared directory (`diloco data prepare`) is read as its tokens.bin, once its
    meta.json agrees with model.vocab_size and data.token_dtype (islands/prepared.py); other specs are kept."""
    path, meta_path = prepared.locate(spec)
    if meta_path is None:
        return spec
    if cfg.kind != "tokens":
        raise DataError(f"{where} holds tokens prepared by `diloco data prepare` ({meta_path}): set data.kind=tokens")
    meta = prepared.read_meta(meta_path)
    if isinstance(meta, str):
        raise DataError(f"{where}: {meta}")
    problems = prepared.mismatches(meta, vocab_size, cfg.token_dtype)
    if problems:
        raise DataError(f"{where} was prepared by `diloco data prepare` ({meta_path}): {'; '.join(problems)}")
    return path


def _documents(
    cfg: DataConfig, spec: str, where: str, key: str, vocab_size: int, tokenizer: CorpusTokenizer | None
) -> tuple[str, np.dtype]:
    """(the token file, its dtype) of a data.kind = "jsonl" or "parquet" source: its shards tokenized by the run's
    tokenizer into the cache (islands/documents.py), once the tokenizer's vocabulary fits model.vocab_size."""
    if tokenizer is None:
        raise DataError(
            f"{where}: data.kind = {cfg.kind!r} tokenizes documents with the run's tokenizer, and the run has none "
            "(set data.tokenizer=PATH/tokenizer.json)"
        )
    if vocab_size < tokenizer.vocab:
        raise DataError(
            f"{where}: the tokenizer '{tokenizer.path}' has a vocabulary of {tokenizer.vocab} but model.vocab_size is "
            f"{vocab_size} (set model.vocab_size={tokenizer.vocab} or more)"
        )
    files = resolve_files(spec, where, key)
    if os.path.isdir(os.path.expanduser(spec)):  # a dataset repository's folder: its shards, not its card
        files = [f for f in files if f.endswith(documents.FORMATS[cfg.kind])]
        if not files:
            ends = " or ".join(documents.FORMATS[cfg.kind])
            raise DataError(f"{where}: the directory has no {ends} files (data.kind = {cfg.kind!r})")
    try:
        directory = documents.cached_tokens(files, cfg.kind, cfg.text_field, tokenizer, cfg.cache_dir)
    except documents.DocumentError as err:
        raise DataError(str(err)) from None
    meta = prepared.read_meta(directory / prepared.META_FILE)
    if isinstance(meta, str):
        raise DataError(f"{where}: the token cache is damaged ({meta}): delete {directory}")
    return str(directory / prepared.TOKENS_FILE), np.dtype(meta["token_dtype"])


def open_source(
    cfg: DataConfig,
    spec: str,
    where: str,
    vocab_size: int,
    seed: int,
    key: str = "data.path",
    tail_only: bool = False,
    tokenizer: CorpusTokenizer | None = None,
) -> TokenSource:
    """Load one source (for kind = "synthetic", spec is ignored) and split off its validation tail.

    key is the config key the spec came from (named in a missing-path error). tail_only reads just the
    validation tail (train is then empty; n_train still counts it): what an island needs of the other
    islands' non-IID sources. tokenizer: the run's, which data.kind = "jsonl" and "parquet" tokenize with."""
    if cfg.kind == "synthetic":
        train, val = split_tail(synthetic_tokens(cfg.synthetic_tokens, vocab_size, seed), cfg.val_fraction)
        return TokenSource(name=where, train=train, val=val, n_train=len(train))
    if cfg.kind in DOCUMENT_KINDS:
        spec, dtype = _documents(cfg, spec, where, key, vocab_size, tokenizer)
    else:
        spec = _prepared(cfg, spec, where, vocab_size)
        dtype = np.dtype(np.uint8 if cfg.kind == "text" else cfg.token_dtype)
    files = resolve_files(spec, where, key)
    # Name the file only when the spec (a directory, glob or stdlib:) does not already.
    single = files == [os.path.expanduser(spec)] or cfg.kind in DOCUMENT_KINDS
    labels = [where if single else f"{where}: file {path!r}" for path in files]
    counts = [_token_count(path, dtype, label) for path, label in zip(files, labels, strict=True)]
    total = sum(counts)
    n_train = total - _n_val(total, cfg.val_fraction)
    tokens = _read_tokens(files, counts, labels, dtype, vocab_size, lo=n_train if tail_only else 0)
    if tail_only:
        return TokenSource(name=where, train=tokens[:0], val=tokens, n_train=n_train)
    return TokenSource(name=where, train=tokens[:n_train], val=tokens[n_train:], n_train=n_train)


def iid_layout(n: int, n_islands: int, block: int, seed: int) -> list[list[tuple[int, int]]]:
    """Each island's IID shard of n training tokens as (start, stop) ranges in corpus order: blocks of `block`
    tokens dealt to islands in a seeded random order, or one contiguous slice per island when block is 0 or
    there is one island. A corpus too small for 8 blocks per island gets smaller blocks."""
    if block == 0 or n_islands == 1:
        bounds = [i * n // n_islands for i in range(n_islands + 1)]
        return [[(lo, hi)] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    block = max(1, min(block, n // (8 * n_islands)))  # a small corpus still deals each island >= 8 blocks
    n_blocks = -(-n // block)
    order = np.random.default_rng((seed, n_islands, block)).permutation(n_blocks)
    return [
        [(b * block, min((b + 1) * block, n)) for b in np.sort(order[i::n_islands]).tolist()] for i in range(n_islands)
    ]


def split_iid(
    tokens: np.ndarray, n_islands: int, block: int, seed: int, only: Collection[int] | None = None
) -> list[np.ndarray]:
    """Disjoint shards covering `tokens`, laid out by iid_layout. A one-range shard is a view (a single
    memmapped file is then never copied); others are concatenated. With `only`, just those islands' shards are
    built and the others are empty arrays of the same dtype."""
    shards = []
    for i, ranges in enumerate(iid_layout(len(tokens), n_islands, block, seed)):
        if only is not None and i not in only:
            shards.append(tokens[:0])
        elif len(ranges) == 1:
            shards.append(tokens[ranges[0][0] : ranges[0][1]])
        else:
            parts = [tokens[lo:hi] for lo, hi in ranges]
            shards.append(np.concatenate(parts) if parts else tokens[:0])
    return shards


def load_sources(
    cfg: DataConfig,
    n_islands: int,
    vocab_size: int,
    seed: int,
    seq_len: int = 1,
    only: Collection[int] | None = None,
    tokenizer: CorpusTokenizer | None = None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """(training tokens of each island, validation tokens).

    IID (data.path or synthetic): the corpus's tail is the validation split and the rest is cut into
    n_islands disjoint shards covering it (see iid_layout). Non-IID (data.paths): source i is island i's
    training data minus its tail; the validation split is all tails concatenated in island order.
    Every shard and the validation split must hold at least seq_len + 1 tokens (one example); every island's
    size is checked even with `only`, so all islands of a run accept or refuse the same config.

    only: island indices; then only those islands' shards are built (bit-identical to the full call) and the
    other entries are empty arrays of the same dtype, so an island process does not read or copy the others'
    training data (non-IID: their sources are read only for the validation tails).

    tokenizer: the run's (islands.text.corpus_tokenizer), which data.kind = "jsonl" and "parquet" tokenize with.
    """
    _check_count("n_islands", n_islands, 1)
    _check_count("model.vocab_size", vocab_size, 1)
    _check_count("seed", seed, 0)
    need = _check_count("model.seq_len", seq_len, 1) + 1
    for i in only or ():
        if _check_count("only", i, 0) >= n_islands:
            raise DataError(f"only must hold island indices below n_islands = {n_islands} (got {i})")
    if cfg.paths:
        if len(cfg.paths) != n_islands:
            raise DataError(
                f"data.paths has {len(cfg.paths)} entries but there are {n_islands} islands "
                "(non-IID data needs exactly one source per island)"
            )
        wanted = range(n_islands) if only is None else only
        sources = [
            open_source(
                cfg, p, f"data.paths[{i}] {p!r}", vocab_size, seed, f"data.paths[{i}]", i not in wanted, tokenizer
            )
            for i, p in enumerate(cfg.paths)
        ]
        for i, src in enumerate(sources):
            if src.n_train < need:
                raise DataError(
                    f"{src.name}: island {i}'s training data has {src.n_train} tokens after the "
                    f"validation tail but seq_len + 1 = {need} are needed"
                )
        shards = [src.train for src in sources]
        val = np.concatenate([src.val for src in sources])
        name = "data.paths"
    else:
        where = (
            f"data.synthetic_tokens ({cfg.synthetic_tokens})" if cfg.kind == "synthetic" else f"data.path {cfg.path!r}"
        )
        src = open_source(cfg, cfg.path, where, vocab_size, seed, tokenizer=tokenizer)
        n = len(src.train)
        sizes = [sum(hi - lo for lo, hi in r) for r in iid_layout(n, n_islands, cfg.shard_block_tokens, seed)]
        for i, size in enumerate(sizes):
            if size < need:
                raise DataError(
                    f"{where}: island {i}'s training shard has {size} tokens but seq_len + 1 = {need} "
                    f"are needed ({n} training tokens are too few for {n_islands} islands)"
                )
        shards = split_iid(src.train, n_islands, cfg.shard_block_tokens, seed, only)
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
