"""Documents as users keep them: JSON Lines and Parquet files with a text field, read as a stream, and tokenized once
into a prepared token directory (islands/prepared.py) that a run then reads as it reads `diloco data prepare`'s.

    data.kind = "jsonl"     *.jsonl, *.jsonl.gz: one JSON object per line, its data.text_field a string
    data.kind = "parquet"   *.parquet: a column data.text_field of strings, read row group by row group (pyarrow)

data.path is what it is for every kind: a file, a directory (here: its files of the kind, as a Hugging Face dataset
repository keeps `data/train-00000-of-00004.parquet`), or a glob of shards; shards are read in sorted order. Nothing
holds more than one JSONL line (at most MAX_LINE_BYTES) or one Parquet record batch (BATCH_ROWS rows) at a time, so a
corpus larger than memory tokenizes into a file on disk that the run memory-maps.

The token file is the documents' ids in shard order, row order within a shard: each document as transformers'
`tokenizer(text)` encodes it (with the special tokens its post-processor adds, e.g. a Llama tokenizer's BOS) and then
the tokenizer's end-of-sequence id when it has one (tokenizer_config.json's eos_token) and the post-processor did not
end the document with it already. It is a pure function of the
shards' bytes and the tokenizer, so every process of a run (coordinator, islands) that tokenizes the same shards gets
the same file, and a chunk of data.sampling = "chunks" (islands/chunks.py) names the same sequences in each. meta.json
records each shard's first token, so a token index maps back to its shard. The cache directory holds one token file
per (shards, sizes, modification times, text field, tokenizer): a changed shard or tokenizer tokenizes anew, and the
first process to get there tokenizes while the others wait on a lock (`cached_tokens`).

Every record is untrusted: a line that is not JSON or not an object, a missing field, a field that is not a string (or
a null), a Parquet file without the column, with a non-string column or that is no Parquet at all, a shard with no
documents, a glob that matches nothing: each is one line naming the file (and the line or row).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from floor.errors import UserError
from floor.files import file_sha256
from islands import prepared

FORMATS: dict[str, tuple[str, ...]] = {"jsonl": (".jsonl", ".jsonl.gz"), "parquet": (".parquet",)}
"""data.kind -> the file name endings of its shards (what a directory's files are filtered by)."""

PARQUET_EXTRA = "pip install 'diloco[parquet]'"
MAX_LINE_BYTES = 1 << 26
"""64 MiB: the longest JSONL line read (one document); a longer one is refused rather than held."""
BATCH_ROWS = 1024
"""Parquet rows read per record batch."""
ENCODE_DOCUMENTS = 256
"""Documents per `encode_batch` call (the tokenizer spreads a batch over the CPU's cores)."""
CACHE_FORMAT = 1
"""Part of every cache key: bumped when the token file's layout changes."""


class DocumentError(UserError, ValueError):
    """A document file that cannot be used, or a cache that cannot be written: one line naming the file (and line or
    row). islands.data re-raises it as a DataError."""


def document_format(path: str) -> str | None:
    """The kind whose shards end like `path` ("jsonl", "parquet"), None for another file."""
    return next((kind for kind, ends in FORMATS.items() if path.endswith(ends)), None)


def pyarrow_parquet(purpose: str) -> Any:
    """`pyarrow.parquet`; a DocumentError naming `purpose` and the extra when pyarrow is not installed."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DocumentError(f"{purpose} reads Parquet with pyarrow, which is not installed: {PARQUET_EXTRA}") from None
    return pq


def documents(path: str, kind: str, field: str) -> Iterator[str]:
    """The texts of one shard, in order; DocumentError (one line, naming the file and line or row) for a record without
    a string `field`, a file that is not of the kind, and a shard with no documents."""
    count = 0
    reader = _jsonl_texts if kind == "jsonl" else _parquet_texts
    for text in reader(path, field):
        count += 1
        yield text
    if count == 0:
        raise DocumentError(f"{path}: an empty shard (no documents)")


def _open_jsonl(path: str) -> BinaryIO:
    try:
        return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # type: ignore[return-value]
    except OSError as err:
        raise DocumentError(f"{path}: cannot read it ({err.strerror or err})") from None


def _jsonl_texts(path: str, field: str) -> Iterator[str]:
    with _open_jsonl(path) as f:
        number = 0
        while True:
            number += 1
            try:
                line = f.readline(MAX_LINE_BYTES + 1)
            except (OSError, EOFError, zlib.error) as err:
                raise DocumentError(f"{path}:{number}: cannot read it ({err})") from None
            if not line:
                return
            body = line.rstrip(b"\r\n")
            if len(body) > MAX_LINE_BYTES:
                raise DocumentError(f"{path}:{number}: a line longer than {MAX_LINE_BYTES} bytes")
            if not body.strip():
                continue
            try:
                record = json.loads(body)
            except (ValueError, RecursionError) as err:
                raise DocumentError(f"{path}:{number}: not JSON ({str(err)[:80]})") from None
            yield _text_of(record, field, f"{path}:{number}")


def _json_type(value: object) -> str:
    names = {list: "an array", dict: "an object", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _text_of(record: object, field: str, where: str) -> str:
    if not isinstance(record, dict):
        shape = f"{{{field!r}: TEXT, ...}}"
        raise DocumentError(f"{where}: not a JSON object (got {_json_type(record)}); each line is {shape}")
    if field not in record:
        names = ", ".join(repr(k) for k in list(record)[:8])
        raise DocumentError(f"{where}: no field {field!r} (data.text_field; the record has {names or 'no fields'})")
    value = record[field]
    if not isinstance(value, str):
        raise DocumentError(f"{where}: field {field!r} is {_json_type(value)}, not a string")
    return value


def _parquet_texts(path: str, field: str) -> Iterator[str]:
    pq = pyarrow_parquet(f"data.kind = 'parquet' ({path})")
    import pyarrow as pa

    try:
        file = pq.ParquetFile(path)
        schema = file.schema_arrow
    except (pa.ArrowException, OSError) as err:
        raise DocumentError(f"{path}: not a Parquet file we can read ({str(err)[:120]})") from None
    with file:
        if field not in schema.names:
            names = ", ".join(repr(n) for n in schema.names[:8])
            raise DocumentError(f"{path}: no column {field!r} (data.text_field; the file has {names or 'no columns'})")
        kind = schema.field(field).type
        if pa.types.is_dictionary(kind):  # a dictionary-encoded column reads as its values
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise DocumentError(f"{path}: column {field!r} is {kind}, not a string")
        row = 0
        try:
            for batch in file.iter_batches(batch_size=BATCH_ROWS, columns=[field]):
                for value in batch.column(0).to_pylist():
                    if value is None:
                        raise DocumentError(f"{path} row {row}: field {field!r} is null, not a string")
                    row += 1
                    yield value
        except (pa.ArrowException, OSError) as err:
            raise DocumentError(f"{path} row {row}: cannot read the Parquet data ({str(err)[:120]})") from None


def encode_texts(encode_batch: Callable[[list[str]], list[list[int]]], texts: Iterator[str], out: BinaryIO,
                 dtype: np.dtype, eos: int | None) -> int:  # fmt: skip
    """Write the texts' ids to `out` (flat little-endian `dtype`), each ended by `eos` when given; the count."""
    count = 0
    while batch := [text for _, text in zip(range(ENCODE_DOCUMENTS), texts, strict=False)]:
        for ids in encode_batch(batch):
            ended = eos is None or (len(ids) > 0 and ids[-1] == eos)
            row = np.asarray(ids if ended else [*ids, eos], dtype=dtype)
            row.tofile(out)
            count += len(row)
    return count


class CorpusTokenizer(Protocol):
    """What tokenizing a corpus needs of the run's tokenizer (islands.text.TokenizerText is one)."""

    path: Path
    vocab: int
    eos: int | None

    def encode_documents(self, texts: list[str]) -> list[list[int]]: ...


def cache_root(cache_dir: str) -> Path:
    """data.cache_dir, else $XDG_CACHE_HOME/diloco/tokens (~/.cache/diloco/tokens)."""
    if cache_dir:
        return Path(os.path.expanduser(cache_dir))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diloco" / "tokens"


def _cache_key(files: Sequence[str], kind: str, field: str, tokenizer_sha: str, eos: int | None) -> str:
    stats = []
    for path in files:
        st = os.stat(path)
        stats.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    key = {"format": CACHE_FORMAT, "kind": kind, "field": field, "tokenizer": tokenizer_sha, "eos": eos, "files": stats}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def cached_tokens(files: Sequence[str], kind: str, field: str, tokenizer: CorpusTokenizer, cache_dir: str) -> Path:
    """The prepared directory (tokens.bin, tokenizer.json, meta.json) of these shards as `tokenizer` encodes them,
    tokenized now unless the cache already holds it. Written under a temporary name and renamed whole, under a lock
    that makes concurrent processes tokenize it once."""
    root = cache_root(cache_dir)
    tokenizer_sha = file_sha256(tokenizer.path)
    out = root / _cache_key(files, kind, field, tokenizer_sha, tokenizer.eos)
    if (out / prepared.META_FILE).is_file():
        return out
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{out.name}.lock", "wb")  # noqa: SIM115 (held until the directory is in place)
    except OSError as err:
        raise DocumentError(f"data.cache_dir {str(root)!r}: cannot write there ({err.strerror or err})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / prepared.META_FILE).is_file():  # another process tokenized it while this one waited
            return out
        partial = root / f"{out.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            _write_cache(partial, files, kind, field, tokenizer, tokenizer_sha)
            os.replace(partial, out)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return out


def _write_cache(out: Path, files: Sequence[str], kind: str, field: str, tokenizer: CorpusTokenizer,
                 tokenizer_sha: str) -> None:  # fmt: skip
    dtype = np.dtype(prepared.token_dtype_for(tokenizer.vocab)).newbyteorder("<")
    shards, total = [], 0
    with open(out / prepared.TOKENS_FILE, "wb") as f:
        for path in files:
            count = encode_texts(tokenizer.encode_documents, documents(path, kind, field), f, dtype, tokenizer.eos)
            shards.append({"path": os.path.abspath(path), "first_token": total, "tokens": count})
            total += count
    if total == 0:
        raise DocumentError(f"the documents of {len(files)} shard(s) encode to no tokens: check data.text_field")
    shutil.copyfile(tokenizer.path, out / prepared.TOKENIZER_FILE)
    meta = {
        "format": prepared.META_FORMAT,
        "vocab_size": tokenizer.vocab,
        "token_dtype": dtype.name,
        "tokens": total,
        "tokenizer": {"file": prepared.TOKENIZER_FILE, "sha256": tokenizer_sha, "eos": tokenizer.eos},
        "sources": {"kind": kind, "text_field": field, "shards": shards},
    }
    (out / prepared.META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
