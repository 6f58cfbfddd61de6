"""A prepared token directory, as `diloco data prepare` writes it, and what a run checks against it.

    DIR/tokens.bin       the corpus's token ids, a flat little-endian array of meta's token_dtype (data.kind = "tokens")
    DIR/tokenizer.json   the Hugging Face tokenizer that made them (to decode samples, or to prepare more text alike)
    DIR/meta.json        vocab_size, token_dtype, tokens, the tokenizer's sha256, the sources, the tool's version

meta.json is written last, so a directory that has it is complete. A run whose data.path (or a data.paths entry) is
such a directory, or its tokens.bin, reads tokens.bin and refuses to start when model.vocab_size or data.token_dtype
disagrees with meta.json: a wrong vocabulary trains on the wrong ids (or indexes past the embedding) without any error
of its own, and a wrong dtype reads the bytes as other numbers.

meta.json records the sha256 of the tokenizer that made the tokens, so a run whose model reads another tokenizer's
ids (a run from a Hugging Face checkpoint, diloco/config.py `with_checkpoint_model`) is refused too
(`other_tokenizer`); a token file without meta.json records no tokenizer, and only its ids are checked
(islands/data.py `check_vocab`).

This module only reads and compares (pure, no tokenizer needed); `diloco/ops/data_prepare.py` writes the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from floor.files import file_sha256

TOKENS_FILE = "tokens.bin"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
META_FORMAT = 1
"""meta.json's `format`: bumped when a field a run reads changes meaning."""

META_KEYS: tuple[str, ...] = ("format", "vocab_size", "token_dtype", "tokens")
"""The fields a run reads; the others (sources, sha256, versions) are provenance for people."""


def token_dtype_for(vocab_size: int) -> str:
    """The smallest data.token_dtype that holds every id below vocab_size."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def locate(spec: str) -> tuple[str, Path | None]:
    """(the path to read, the meta.json that describes it or None).

    A directory holding meta.json is read as its tokens.bin; a tokens.bin with meta.json beside it keeps its path. A
    glob, "stdlib:" or any other file has no meta.json (None) and is read as it is."""
    path = Path(os.path.expanduser(spec))
    if any(c in spec for c in "*?["):
        return spec, None
    if path.is_dir() and (path / META_FILE).is_file():
        return str(path / TOKENS_FILE), path / META_FILE
    if path.name == TOKENS_FILE and (path.parent / META_FILE).is_file():
        return spec, path.parent / META_FILE
    return spec, None


def read_meta(path: Path) -> dict[str, Any] | str:
    """meta.json's contents, or why it cannot be used (one phrase)."""
    try:
        meta = json.loads(path.read_text())
    except OSError as err:
        return f"cannot read {path} ({err.strerror or err})"
    except ValueError:
        return f"{path} is not valid JSON"
    if not isinstance(meta, dict) or any(key not in meta for key in META_KEYS):
        return f"{path} lacks {', '.join(META_KEYS)}: not written by `diloco data prepare`"
    if meta["format"] != META_FORMAT:
        return f"{path} has format {meta['format']!r}; this diloco reads format {META_FORMAT}"
    vocab = meta["vocab_size"]
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1 or not isinstance(meta["token_dtype"], str):
        return f"{path} has vocab_size {vocab!r} and token_dtype {meta['token_dtype']!r}: not a count and a dtype name"
    return meta


def mismatches(meta: dict[str, Any], vocab_size: int, token_dtype: str) -> list[str]:
    """What a run's settings get wrong about a prepared directory, each naming both values and the key to set.

    A model vocabulary larger than the tokenizer's is fine (ids it never sees): accelerator configs pad it to a
    multiple of 64 (configs/gpt2-small.toml: 50304 for GPT-2's 50257). A smaller one would index past the embedding."""
    problems = []
    if vocab_size < meta["vocab_size"]:
        problems.append(
            f"its tokenizer has a vocabulary of {meta['vocab_size']} but model.vocab_size is {vocab_size} "
            f"(set model.vocab_size={meta['vocab_size']} or more)"
        )
    if meta["token_dtype"] != token_dtype:
        problems.append(
            f"its tokens are {meta['token_dtype']} but data.token_dtype is {token_dtype} "
            f"(set data.token_dtype={meta['token_dtype']})"
        )
    return problems


def other_tokenizer(meta: dict[str, Any], tokenizer: Path) -> str | None:
    """Why the tokens of a prepared directory are not `tokenizer`'s ids (one phrase), or None: meta.json's tokenizer
    sha256 differs from the file's. None too where meta.json records no sha256 (nothing to compare)."""
    recorded = meta.get("tokenizer")
    sha = recorded.get("sha256") if isinstance(recorded, dict) else None
    if not isinstance(sha, str) or sha == file_sha256(tokenizer):
        return None
    return (
        f"its tokens were made by another tokenizer ({meta['vocab_size']} ids, sha256 {sha[:12]}...) than "
        f"'{tokenizer}' (sha256 {file_sha256(tokenizer)[:12]}...): prepare them with `diloco data prepare "
        f"--tokenizer {tokenizer}`"
    )
