"""A run's text as token ids and back: the run's Hugging Face tokenizer where it has one (`tokenizer_file`:
data.tokenizer, which a run from a Hugging Face checkpoint fills with the checkpoint's; else, for data.kind = "tokens",
the tokenizer.json that `diloco data prepare` wrote beside the run's tokens, islands/prepared.py), UTF-8 bytes for a
byte-level run. Pre-training documents (data.kind = "jsonl" / "parquet", islands/documents.py), post-training data
(islands/workloads/text.py) and `diloco sample` all read text through it.

A tokenizer.json may have a tokenizer_config.json beside it, as a Hugging Face checkpoint directory has: its special
tokens (bos_token, eos_token, pad_token: a string or an AddedToken object {"content": ...}) name ids of the tokenizer,
and its chat_template renders conversations (islands/chat.py), unless a chat_template.jinja beside it holds the
template (as transformers writes it since 4.50). Without them the tokenizer has no special tokens and no template.

`diloco sample` encodes prompts and decodes continuations through `text_codec`, `diloco export` ships the file
`tokenizer_file` names, and `diloco data prepare` loads tokenizers through `tokenizers_package` and `load_tokenizer`.
The tokenizer needs the tokenize extra (Hugging Face `tokenizers`), imported only when one is used.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from islands import prepared
from islands.data import DOCUMENT_KINDS, DataConfig, DataError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZE_EXTRA = "pip install 'diloco[tokenize]'"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers' save_pretrained keeps the chat template since 4.50 (tokenizer_config.json no longer holds it);
it wins over tokenizer_config.json's `chat_template`, as in transformers."""
TOKENIZER_COMPANIONS: tuple[str, ...] = (TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE)
"""The files beside a tokenizer.json that are part of it here: special tokens and the chat template."""
SPECIAL_TOKENS: tuple[str, ...] = ("bos_token", "eos_token", "pad_token", "unk_token")
"""tokenizer_config.json's special tokens, passed to a chat template under these names (as transformers does)."""
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


def special_content(value: object) -> str | None:
    """A special token's text as tokenizer_config.json writes it: a string or an AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def read_tokenizer_config(path: Path) -> dict[str, object]:
    """tokenizer_config.json beside the tokenizer.json `path` ({} when there is none); a DataError naming it when it
    is not a JSON object."""
    config = path.parent / TOKENIZER_CONFIG
    if not config.is_file():
        return {}
    try:
        loaded = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"{config}: not a JSON file we can read ({str(err)[:80]})") from None
    if not isinstance(loaded, dict):
        raise DataError(f"{config}: not a JSON object")
    return loaded


class TokenizerText:
    """A run's Hugging Face tokenizer (`tokenizer_file`: data.tokenizer, else the one a data.kind = "tokens" corpus was
    prepared with), with its special tokens and chat template from tokenizer_config.json. Text is encoded
    with no special tokens added, as `diloco data prepare` encodes: a chat template writes its own."""

    kind = "tokenizer"

    def __init__(self, path: Path, vocab_size: int, purpose: str) -> None:
        self.path = path
        self.vocab_size = vocab_size
        self._tokenizer = load_tokenizer(path, f"the run's tokenizer '{path}'", purpose)
        self.vocab: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        config = read_tokenizer_config(path)
        self.special: dict[str, str] = {}
        """tokenizer_config.json's special tokens that it sets: name ("eos_token") -> text."""
        for name in SPECIAL_TOKENS:
            text = special_content(config.get(name))
            if text is None:
                continue
            if name != "unk_token" and self._tokenizer.token_to_id(text) is None:  # an id the run writes
                raise DataError(f"{path.parent / TOKENIZER_CONFIG}: {name} {text!r} is not a token of {path}")
            self.special[name] = text
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = path.parent / CHAT_TEMPLATE_FILE
        self.template_file = jinja if jinja.is_file() else path.parent / TOKENIZER_CONFIG
        """Where the chat template is read from (the messages about it name the file)."""
        if jinja.is_file():
            try:
                template = jinja.read_text(encoding="utf-8")
            except (OSError, ValueError) as err:
                raise DataError(f"{jinja}: not a UTF-8 file we can read ({str(err)[:80]})") from None
        self.chat_template: str | None = template if isinstance(template, str) and template else None
        """The Jinja template that renders a conversation (islands/chat.py); None when the tokenizer has none."""

    def special_id(self, name: str) -> int | None:
        """The id of special token `name` ("bos_token", "eos_token", "pad_token"), None when it has none."""
        text = self.special.get(name)
        return None if text is None else self._tokenizer.token_to_id(text)

    @property
    def eos(self) -> int | None:
        """The end-of-sequence id: what ends a document of the corpus, an answer, and a sampled continuation."""
        return self.special_id("eos_token")

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Each document's ids with the special tokens the tokenizer's post-processor adds (the BOS of a Llama
        tokenizer; none for most), as transformers' `tokenizer(texts)` gives them; the batch spread over the cores."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=True)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, each id's (start, end) character range in `text`), no special tokens added."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(o) for o in encoding.offsets]  # type: ignore[misc]

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
    """The run's tokenizer, the one place it is decided: data.tokenizer when set (a user's, or the checkpoint's that
    diloco/config.py `with_checkpoint_model` fills in for a run from a Hugging Face checkpoint), else the tokenizer.json
    beside a data.kind = "tokens" run's prepared corpus (data.path, else the first of data.paths that has one); None
    for a byte-level run, or a corpus that `diloco data prepare` did not write."""
    if data.tokenizer:
        return Path(data.tokenizer).expanduser()
    if data.kind != "tokens":
        return None
    for spec in (data.path, *data.paths):
        _, meta = prepared.locate(spec) if spec else ("", None)
        if meta is not None and (meta.parent / prepared.TOKENIZER_FILE).is_file():
            return meta.parent / prepared.TOKENIZER_FILE
    return None


def text_codec(data: DataConfig, vocab_size: int, purpose: str) -> TextCodec:
    """How the run whose [data] this is reads text: its tokenizer (`tokenizer_file`), else bytes (a DataError naming
    the missing tokenizer when a data.kind = "tokens", "jsonl" or "parquet" run has none, and the extra when
    `tokenizers` is not installed)."""
    path = tokenizer_file(data)
    if path is not None:
        return TokenizerText(path, vocab_size, purpose)
    if data.kind in DOCUMENT_KINDS:
        raise DataError(
            f"data.kind = {data.kind!r} tokenizes with the run's tokenizer and the run has none: set "
            f"data.tokenizer=PATH/tokenizer.json ({purpose} needs it)"
        )
    if data.kind == "tokens":
        where = f"data.path {data.path!r}" if data.path else f"data.paths {list(data.paths)}"
        raise DataError(
            f"data.kind = 'tokens' and {where} holds no {prepared.TOKENIZER_FILE} (a directory written by "
            f"`diloco data prepare` has one): {purpose} cannot turn text into this run's tokens"
        )
    return ByteText(vocab_size)


def corpus_tokenizer(data: DataConfig, vocab_size: int) -> TokenizerText | None:
    """The tokenizer that tokenizes a data.kind = "jsonl" or "parquet" corpus (`islands.data.load_sources` receives
    it), None for the other kinds, which hold their tokens (or bytes) already."""
    if data.kind not in DOCUMENT_KINDS:
        return None
    codec = text_codec(data, vocab_size, f"data.kind = {data.kind!r}")
    assert isinstance(codec, TokenizerText)
    return codec
