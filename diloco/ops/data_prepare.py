"""`diloco data prepare`: text in, a prepared token directory out (its layout: islands/prepared.py).

    diloco data prepare corpus/ --out data/corpus-4k --train-vocab 4096    # train a byte-level BPE tokenizer, offline
    diloco data prepare more.txt --out data/more --tokenizer data/corpus-4k/tokenizer.json   # reuse a tokenizer
    diloco simulate configs/tiny.toml data.kind=tokens data.path=data/corpus-4k model.vocab_size=4096

INPUT is what data.path takes (a file, a directory's files, a glob, or "stdlib:" for the built-in corpus:
`islands.data.resolve_files`), read as UTF-8 text; a *.jsonl, *.jsonl.gz or *.parquet file is read as documents, the
text of each record's --text-field, each followed by the tokenizer's end-of-sequence token when its
tokenizer_config.json names one (islands/documents.py: the same token file a data.kind = "jsonl" or "parquet" run
tokenizes into its cache). A trained tokenizer is byte-level BPE (Hugging Face `tokenizers`,
the `tokenize` extra): its first 256 ids are the bytes, so every text encodes with no unknown token and decodes back
exactly, and N (>= 256) is the vocabulary it grows to by merges (a corpus too small for N merges gives fewer: meta.json
and the printed summary say what it got). Each file is encoded on its own, so no token spans two files; long files go
through in chunks cut at line ends (a UTF-8 boundary), the same chunks for training and encoding.

The directory is written so that a crash never leaves one a run would take for complete: tokens.bin and tokenizer.json
first (tokens.bin through a temporary name), meta.json last. An --out that already holds a prepared corpus is refused.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from floor.files import file_sha256
from islands.data import DataError, resolve_files
from islands.documents import document_format, documents, encode_texts
from islands.prepared import META_FILE, META_FORMAT, TOKENIZER_FILE, TOKENS_FILE, token_dtype_for
from islands.text import TOKENIZER_COMPANIONS, read_tokenizer_config, special_content, tokenizers_package
from islands.text import load_tokenizer as load_tokenizer_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MIN_VOCAB = 256
"""A byte-level BPE vocabulary starts with the 256 bytes; merges add to it."""
MAX_VOCAB = 1 << 32
"""Ids are stored as uint32 at most (data.token_dtype)."""
CHUNK_BYTES = 1 << 20
"""Text is read, trained on and encoded in pieces of about this many bytes, cut after a newline."""
ENCODE_BATCH = 16
"""Chunks encoded per `encode_batch` call (the tokenizer spreads a batch over the CPU's cores)."""


def _tokenizers() -> Any:
    return tokenizers_package("diloco data prepare")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def input_files(inputs: Sequence[str]) -> list[str]:
    """Every file the INPUTs name, in order, each once (a file named twice, e.g. by a glob and a directory, is read
    once)."""
    if not inputs:
        raise DataError("diloco data prepare needs at least one INPUT (a file, directory, glob or stdlib:)")
    files: dict[str, None] = {}
    for spec in inputs:
        for path in resolve_files(spec, f"input {spec!r}", key="INPUT"):
            files.setdefault(os.path.abspath(path), None)
    return list(files)


def _split_at(data: bytes, final: bool) -> int:
    """Where to cut bytes read from a file: after the last newline, else before the last character, which may be
    incomplete (a newline byte, 0x0A, never occurs inside a multi-byte UTF-8 character; continuation bytes are
    0b10xxxxxx). 0: no whole character yet, read on. Bytes that are no UTF-8 at all are cut whole (decoding says so)."""
    if final:
        return len(data)
    cut = data.rfind(b"\n") + 1
    if cut:
        return cut
    cut = len(data)
    while cut > 0 and data[cut - 1] & 0xC0 == 0x80:
        cut -= 1
    if cut > 0 and data[cut - 1] >= 0xC0:  # the lead byte of the character the data ends inside of
        cut -= 1
    return cut if cut or len(data) < 4 else len(data)  # a character has at most 4 bytes


def text_chunks(path: str, on_bytes: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """The file's text in pieces of about CHUNK_BYTES, cut at line ends; DataError when it is not UTF-8.
    on_bytes(n) is told each piece's size in bytes (a progress bar)."""
    carry, offset = b"", 0
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(CHUNK_BYTES)
                data = carry + block
                if not data:
                    return
                cut = _split_at(data, final=not block)
                piece, carry = data[:cut], data[cut:]
                if not piece:
                    continue
                try:
                    text = piece.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"input file {path!r} is not UTF-8 text (byte {offset + err.start} cannot be decoded); "
                        "diloco data prepare reads UTF-8"
                    ) from None
                offset += len(piece)
                on_bytes(len(piece))
                yield text
    except OSError as err:
        raise DataError(f"input file {path!r}: cannot read it ({err.strerror or err})") from err


def file_texts(path: str, text_field: str, on_bytes: Callable[[int], None]) -> Iterator[str]:
    """A document file's texts (its records' text_field), else the file's text in chunks (`text_chunks`)."""
    kind = document_format(path)
    if kind is None:
        yield from text_chunks(path, on_bytes)
        return
    for text in documents(path, kind, text_field):
        on_bytes(len(text))
        yield text


def _corpus(files: Sequence[str], text_field: str, on_bytes: Callable[[int], None]) -> Iterator[str]:
    for path in files:
        yield from file_texts(path, text_field, on_bytes)


def train_tokenizer(
    files: Sequence[str], vocab_size: int, on_bytes: Callable[[int], None], text_field: str = "text"
) -> Tokenizer:
    """A byte-level BPE tokenizer of at most vocab_size ids, trained on the files' text (offline)."""
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    # No prefix space and no normaliser: decode(encode(text)) is the text, byte for byte.
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,  # the bar is ours (rich, on a terminal only)
    )
    tokenizer.train_from_iterator(_corpus(files, text_field, on_bytes), trainer=trainer)
    return tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    """A Hugging Face tokenizer.json; DataError naming the file when it is missing or not one."""
    return load_tokenizer_file(path, f"--tokenizer {str(path)!r}", "diloco data prepare")


def document_eos(tokenizer: Tokenizer, tokenizer_file: Path | None) -> int | None:
    """The id that ends each document: the eos_token of the tokenizer_config.json beside `tokenizer_file` (None for a
    trained tokenizer or one without it)."""
    if tokenizer_file is None:
        return None
    text = special_content(read_tokenizer_config(tokenizer_file).get("eos_token"))
    return None if text is None else tokenizer.token_to_id(text)


def encode_files(
    tokenizer: Tokenizer,
    files: Sequence[str],
    out: Path,
    dtype: str,
    on_bytes: Callable[[int], None],
    text_field: str = "text",
    eos: int | None = None,
) -> int:
    """Encode the files into `out` (flat little-endian `dtype` ids); returns the count. Text files get no special
    tokens; each document of a document file is encoded as islands/documents.py encodes it (the post-processor's
    special tokens, then `eos` when given)."""
    np_dtype = np.dtype(dtype).newbyteorder("<")
    count = 0
    with open(out, "wb") as f:
        for path in files:
            kind = document_format(path)
            if kind is not None:
                batch = lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=True)]  # noqa: E731
                count += encode_texts(batch, file_texts(path, text_field, on_bytes), f, np_dtype, eos)
                continue
            chunks = text_chunks(path, on_bytes)
            while batch := list(itertools.islice(chunks, ENCODE_BATCH)):
                for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                    ids = np.asarray(encoding.ids, dtype=np_dtype)
                    ids.tofile(f)
                    count += len(ids)
    return count


def _check_out(out: Path) -> None:
    for name in (META_FILE, TOKENS_FILE):
        if (out / name).exists():
            raise DataError(
                f"--out {str(out)!r} already holds a prepared corpus ({name}): choose another directory or delete it"
            )
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is a file, not a directory")


class _Bar:
    """A rich progress bar over bytes of text on a terminal (stderr); nothing otherwise (a pipe, a log, CI)."""

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(file=sys.stderr)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not (enabled and console.is_terminal),
        )

    def task(self, description: str, total: int) -> Callable[[int], None]:
        task = self.progress.add_task(description, total=total)
        return lambda n: self.progress.advance(task, n)

    def __enter__(self) -> _Bar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def prepare(
    inputs: Sequence[str],
    out: Path,
    train_vocab: int | None = None,
    tokenizer_file: Path | None = None,
    progress: bool = True,
    text_field: str = "text",
) -> dict[str, Any]:
    """Tokenize the INPUTs into `out` (tokens.bin, tokenizer.json, meta.json) with a tokenizer trained on them to
    `train_vocab` ids, or the one in `tokenizer_file`; returns meta.json's contents plus the seconds each phase took.
    text_field: the field of a document file's records that holds the text."""
    if (train_vocab is None) == (tokenizer_file is None):
        raise DataError("diloco data prepare needs exactly one of --train-vocab N and --tokenizer FILE")
    if train_vocab is not None and train_vocab < MIN_VOCAB:
        raise DataError(
            f"--train-vocab must be at least {MIN_VOCAB}: a byte-level vocabulary starts with the 256 "
            f"bytes (got {train_vocab})"
        )
    if train_vocab is not None and train_vocab > MAX_VOCAB:
        raise DataError(f"--train-vocab must be at most {MAX_VOCAB}, what uint32 token ids hold (got {train_vocab})")
    _tokenizers()  # a missing extra is one line before any file is read
    files = input_files(inputs)
    sizes = [os.path.getsize(path) for path in files]
    total = sum(sizes)
    if total == 0:
        raise DataError(f"the corpus is empty: {len(files)} file(s), 0 bytes of text ({', '.join(inputs)})")
    _check_out(out)
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file is not None else None
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        with _Bar(progress) as bar:
            meta, seconds = _write(out, files, tokenizer, train_vocab, tokenizer_file, bar, text_field)
    except BaseException:  # a bad file, Ctrl+C: leave no half-prepared directory behind
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            (out / f"{TOKENS_FILE}.partial").unlink(missing_ok=True)
        raise
    meta = {
        "format": META_FORMAT,
        **meta,
        "sources": {
            "inputs": list(inputs),
            "files": [{"path": p, "bytes": n} for p, n in zip(files, sizes, strict=True)],
        },
        "text_bytes": total,
        "tool": {"diloco": _version("diloco"), "tokenizers": _version("tokenizers")},
    }
    tmp = out / f"{META_FILE}.partial"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / META_FILE)  # last: its presence marks a complete directory
    return {**meta, "seconds": {k: round(v, 3) for k, v in seconds.items()}}


def _write(
    out: Path,
    files: Sequence[str],
    tokenizer: Tokenizer | None,
    train_vocab: int | None,
    tokenizer_file: Path | None,
    bar: _Bar,
    text_field: str,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Train (tokenizer None) or copy the tokenizer, encode the files; (meta's token fields, seconds per phase)."""
    total = sum(os.path.getsize(path) for path in files)
    seconds: dict[str, float] = {}
    if tokenizer is None:
        assert train_vocab is not None
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(files, train_vocab, bar.task("training tokenizer", total), text_field)
        seconds["train"] = time.perf_counter() - t0
        tokenizer.save(str(out / TOKENIZER_FILE))
    elif tokenizer_file is not None and tokenizer_file.resolve() != (out / TOKENIZER_FILE).resolve():
        shutil.copyfile(tokenizer_file, out / TOKENIZER_FILE)  # byte for byte: its sha256 is the original's
        for name in TOKENIZER_COMPANIONS:  # its special tokens and chat template go along
            if (tokenizer_file.parent / name).is_file():
                shutil.copyfile(tokenizer_file.parent / name, out / name)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype_for(vocab_size)
    t0 = time.perf_counter()
    partial = out / f"{TOKENS_FILE}.partial"
    eos = document_eos(tokenizer, tokenizer_file)
    count = encode_files(tokenizer, files, partial, dtype, bar.task("encoding", total), text_field, eos)
    seconds["encode"] = time.perf_counter() - t0
    if count == 0:
        raise DataError(f"the corpus encodes to no tokens ({len(files)} file(s), {total} bytes): check the tokenizer")
    os.replace(partial, out / TOKENS_FILE)
    source = {"requested_vocab": train_vocab} if train_vocab is not None else {"from": str(tokenizer_file)}
    tokenizer_meta = {
        "file": TOKENIZER_FILE,
        "sha256": file_sha256(out / TOKENIZER_FILE),
        "trained": train_vocab is not None,
        **source,
    }
    return {"vocab_size": vocab_size, "token_dtype": dtype, "tokens": count, "tokenizer": tokenizer_meta}, seconds


def summary(out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """What `diloco data prepare` prints: the counts, the timings, and the overrides that train on the directory."""
    use = f"data.kind=tokens data.path={out} model.vocab_size={meta['vocab_size']}"
    if meta["token_dtype"] != "uint16":  # data.token_dtype's default
        use += f" data.token_dtype={meta['token_dtype']}"
    wanted = meta["tokenizer"].get("requested_vocab")
    note = (
        {"note": f"the corpus allowed {meta['vocab_size']} ids of the {wanted} asked for (too few merges)"}
        if wanted and meta["vocab_size"] < wanted
        else {}
    )
    return {
        "out": str(out),
        "tokens": meta["tokens"],
        "vocab_size": meta["vocab_size"],
        "token_dtype": meta["token_dtype"],
        "files": len(meta["sources"]["files"]),
        "text_bytes": meta["text_bytes"],
        "tokenizer_sha256": meta["tokenizer"]["sha256"],
        "seconds": meta["seconds"],
        "overrides": use,
        **note,
    }
