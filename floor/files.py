"""Files replaced whole (a crash leaves the old content or the new, never half of either), and files named by their
content."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """Write `text` to a sibling file (created with `mode`, never through a symlink), fsync it, rename it over
    `path`, fsync the directory (the rename itself is durable only once the directory is: a power loss before that
    can bring the old file back)."""
    partial = path.with_name(path.name + ".tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
