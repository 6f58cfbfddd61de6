"""Digests that prove two replicas hold bit-identical parameters (stdlib blake2b, fixed leaf order)."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np


def tree_digest(tree: Any) -> str:
    """blake2b over every leaf's path, dtype, shape and bytes, leaves in jax's (sorted-key) flatten order."""
    h = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.ascontiguousarray(np.asarray(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{arr.dtype.str}{arr.shape}".encode())
        h.update(arr.tobytes())
    return h.hexdigest()
