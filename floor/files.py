"""Files replaced whole: a crash leaves the old content or the new, never half of either."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """Write `text` to a sibling file (created with `mode`, never through a symlink), fsync it, rename it over
    `path`."""
    partial = path.with_name(path.name + ".tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)
