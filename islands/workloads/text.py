"""Text to token ids and back, as the run's data is tokenized: UTF-8 bytes for a byte-level run, or the Hugging Face
tokenizer `diloco data prepare` wrote beside data.path (data.kind = "tokens", islands/prepared.py).

Every answer ends with a stop token, so that a model learns where its answer ends and generation knows where to cut:
the newline, a byte (10) for byte-level runs, the tokenizer's id of "\\n" otherwise. A prompt or an answer holding a
newline itself is fine for training; an answer is read back up to its first stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from floor.errors import UserError
from islands import prepared
from islands.data import DataConfig

STOP_TEXT = "\n"
"""What the stop token stands for."""


class TextError(UserError, ValueError):
    """The run's texts cannot be tokenized as configured (no tokenizer, a vocabulary too small)."""


class TextCodec(Protocol):
    """Token ids of texts for one run, and its stop token."""

    stop: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class ByteText:
    """A byte-level model's tokens: the text's UTF-8 bytes."""

    stop: int = ord(STOP_TEXT)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes as text; a sequence cut inside a character (an answer that ran out of tokens) keeps what it can."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TokenizerText:
    """The tokens of a Hugging Face tokenizer.json (the `tokenize` extra)."""

    def __init__(self, tokenizer: Any, where: str) -> None:
        self.tokenizer = tokenizer
        stop = tokenizer.encode(STOP_TEXT, add_special_tokens=False).ids
        if len(stop) != 1:
            raise TextError(f"{where}: the tokenizer makes {len(stop)} tokens of a newline; answers need a stop token")
        self.stop = int(stop[0])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids]))


def text_codec(data: DataConfig, vocab_size: int) -> TextCodec:
    """How this run turns text into tokens: bytes, or with data.kind = "tokens" the tokenizer.json of data.path's
    prepared directory (data.paths[0]'s with one source per island)."""
    if data.kind != "tokens":
        if vocab_size < 256:
            raise TextError(f"model.vocab_size ({vocab_size}) must be >= 256 to hold byte-level text's tokens")
        return ByteText()
    spec = data.path or data.paths[0]
    _, meta = prepared.locate(spec)
    where = f"data.path {spec!r}" if data.path else f"data.paths[0] {spec!r}"
    if meta is None:
        raise TextError(
            f"{where} has no tokenizer beside it (a directory written by `diloco data prepare`): post-training with "
            "data.kind = 'tokens' tokenizes its texts with it"
        )
    path = Path(meta).parent / prepared.TOKENIZER_FILE
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TextError(
            "post-training with data.kind = 'tokens' needs the tokenizers package: pip install 'diloco[tokenize]'"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises its own exception types for a bad file
        raise TextError(f"{path} is not a Hugging Face tokenizer.json ({err})") from None
    return TokenizerText(tokenizer, str(path))
