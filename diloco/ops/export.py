"""`diloco export RUN_DIR --out DIR`: a run's newest committed θ as files any framework loads (docs/export.md).

    DIR/model.safetensors   every parameter, float32, named by its pytree path (pytrees/naming.py:
                            "blocks/0/attn/wqkv"); written by floor/safetensors.py, no runtime dependency
    DIR/config.json         FORMAT, the [model] section, how text becomes tokens (`text_kind`),
                            the round θ was committed at, its digest, where it was read from
    DIR/tokenizer.json      the run's Hugging Face tokenizer, for a data.kind = "tokens" run

θ is what `diloco sample` and `init.from` read (diloco/ops/trained.py). An existing DIR that holds anything is refused
unless `force`, which replaces these three files (and removes a tokenizer.json that the run has none for).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from diloco.config import to_dict
from diloco.ops.trained import load_trained
from floor import safetensors
from floor.errors import UserError
from islands.models.base import param_count
from islands.prepared import TOKENIZER_FILE
from islands.text import tokenizer_file
from pytrees.naming import flatten_named

FORMAT = "diloco-export/1"
"""config.json's `format`: bumped when a field a loader reads changes meaning."""
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class ExportError(UserError, ValueError):
    """`diloco export` cannot write where it was told to (a non-empty --out without --force, a file)."""


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out that is a file, or a directory holding anything unless `force`."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {str(out)!r} is not empty: choose another directory, or --force to replace an export")


def text_kind(data_kind: str, tokenizer: Path | None) -> str:
    """config.json's `text`: "bytes" (a token is a UTF-8 byte), "tokenizer" (tokenizer.json beside it) or "ids" (a
    data.kind = "tokens" run whose corpus has no tokenizer.json: the ids mean what its preparer made them mean)."""
    if data_kind != "tokens":
        return "bytes"
    return "tokenizer" if tokenizer is not None else "ids"


def export(run_dir: Path, out: Path, force: bool = False) -> dict[str, Any]:
    """Write the export of the run's newest committed θ into `out`; returns config.json's contents."""
    check_out(out, force)
    trained = load_trained(run_dir)
    tensors = flatten_named(trained.params)
    tokenizer = tokenizer_file(trained.data)
    config = {
        "format": FORMAT,
        "model": to_dict(trained.model),
        "text": text_kind(trained.data.kind, tokenizer),
        "tokenizer": TOKENIZER_FILE if tokenizer is not None else None,
        "round": trained.round,
        "digest": trained.digest,
        "param_count": param_count(trained.params),
        "tensors": len(tensors),
        "source": str(trained.step_dir),
    }
    out.mkdir(parents=True, exist_ok=True)
    safetensors.write(out / WEIGHTS, tensors, {"format": "np", "diloco": FORMAT, "digest": trained.digest})
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER_FILE)
    else:
        (out / TOKENIZER_FILE).unlink(missing_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return config
