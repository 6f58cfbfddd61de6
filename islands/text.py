"""A run's text as token ids and back: UTF-8 bytes for a byte-level run, the run's Hugging Face tokenizer for
data.kind = "tokens" (the tokenizer.json that `diloco data prepare` wrote beside the run's tokens, islands/prepared.py).

`diloco sample` encodes prompts and decodes continuations through `text_codec`, `diloco export` ships the file
`tokenizer_file` names, and `diloco data prepare` loads tokenizers through `tokenizers_package` and `load_tokenizer`.
The tokenizer needs the tokenize extra (Hugging Face `tokenizers`), imported only when one is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from islands import prepared
from islands.data import DataConfig, DataError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZE_EXTRA = "pip install 'diloco[tokenize]'"
BYTES = 256
"""Ids of a byte-level run: one per byte value."""


def tokenizers_package(purpose: str) -> Any:
    """The `tokenizers` module; a DataError naming `purpose` ("diloco data prepare") and the extra when missing."""
    try:
        import tokenizers
    except ImportError:
        raise DataError(f"{purpose} needs the tokenizers package, which is not installed: {TOKENIZE_EXTRA}") from None
    return tokenizers


def load_tokenizer(path: Path, where: str, purpose: str) -> Tokenizer:
    """A Hugging Face tokenizer.json; a DataError naming `where` ("--tokenizer 'FILE'") when missing or not one."""
    tk = tokenizers_package(purpose)
    if not path.is_file():
        raise DataError(f"{where}: no such file")
    try:
        return tk.Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises a bare Exception for any parse error
        raise DataError(f"{where} is not a Hugging Face tokenizer.json ({err})") from None


class TextCodec(Protocol):
    """Text -> token ids and back, as the run's model reads them."""

    kind: str
    """"bytes" or "tokenizer"."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ByteText:
    """A byte-level run: a token is a byte of the UTF-8 text. Decoding replaces what is not UTF-8 (a continuation
    cut inside a character, an id beyond 255 that a larger vocabulary allows) with U+FFFD."""

    vocab_size: int
    kind: str = "bytes"

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode())
        if ids and max(ids) >= self.vocab_size:
            raise DataError(
                f"the text {text[:40]!r} holds byte {max(ids)}, beyond this byte-level model's vocabulary "
                f"(model.vocab_size {self.vocab_size})"
            )
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        # 0xFF never occurs in UTF-8: an id beyond the bytes decodes as one replacement character.
        return bytes(i if i < BYTES else 0xFF for i in map(int, ids)).decode("utf-8", errors="replace")


class TokenizerText:
    """A data.kind = "tokens" run: the Hugging Face tokenizer its corpus was prepared with (no special tokens
    added, as `diloco data prepare` encodes)."""

    kind = "tokenizer"

    def __init__(self, path: Path, vocab_size: int, purpose: str) -> None:
        self.path = path
        self.vocab_size = vocab_size
        self._tokenizer = load_tokenizer(path, f"the run's tokenizer '{path}'", purpose)

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if ids and max(ids) >= self.vocab_size:
            raise DataError(
                f"the tokenizer '{self.path}' gives id {max(ids)} for {text[:40]!r}, beyond model.vocab_size "
                f"({self.vocab_size})"
            )
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_file(data: DataConfig) -> Path | None:
    """The tokenizer.json beside a data.kind = "tokens" run's prepared corpus (data.path, else the first of data.paths
    that has one); None for another kind, or a corpus that `diloco data prepare` did not write."""
    if data.kind != "tokens":
        return None
    for spec in (data.path, *data.paths):
        _, meta = prepared.locate(spec) if spec else ("", None)
        if meta is not None and (meta.parent / prepared.TOKENIZER_FILE).is_file():
            return meta.parent / prepared.TOKENIZER_FILE
    return None


def text_codec(data: DataConfig, vocab_size: int, purpose: str) -> TextCodec:
    """How the run whose [data] this is reads text: bytes, or its tokenizer (a DataError naming data.path when a
    data.kind = "tokens" run has none, and the extra when `tokenizers` is not installed)."""
    if data.kind != "tokens":
        return ByteText(vocab_size)
    path = tokenizer_file(data)
    if path is None:
        where = f"data.path {data.path!r}" if data.path else f"data.paths {list(data.paths)}"
        raise DataError(
            f"data.kind = 'tokens' and {where} holds no {prepared.TOKENIZER_FILE} (a directory written by "
            f"`diloco data prepare` has one): {purpose} cannot turn text into this run's tokens"
        )
    return TokenizerText(path, vocab_size, purpose)
