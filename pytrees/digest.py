"""Digests that prove two replicas hold bit-identical parameters (XXH3-128, fixed leaf order)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import xxhash

DIGEST_BYTES = 16
"""128 bits: a digest names a replica's θ among the few a run ever holds, and is compared, never searched."""


def tree_digest(tree: Any) -> str:
    """XXH3-128 over every leaf's path, dtype, shape and bytes, leaves in jax's (sorted-key) flatten order; hex.

    The digest proves that a replica's arithmetic reproduced the coordinator's θ bit for bit (docs/architecture.md,
    "Digests"): it catches divergence, not forgery, so it need not be cryptographic. Nobody gains by forging one: an
    island's `base_digest` only has to equal the coordinator's own, which any island may echo, and the island
    trusts the authenticated coordinator's `param_digest` anyway. Payload digests, which name what a hostile sender
    streamed, stay SHA-256 (`transport.chunking`). XXH3 because this digest is on every sync's critical path twice
    (the coordinator's commit, the island's check of what it pulled), where it is an order of magnitude faster than
    SHA-256 (BENCHMARKS.md). The bytes are hashed where they lie (a view, not a copy).
    """
    h = xxhash.xxh3_128()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.ascontiguousarray(np.asarray(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{arr.dtype.str}{arr.shape}".encode())
        h.update(arr.reshape(-1).view(np.uint8).data)  # any dtype (bfloat16 has no buffer format of its own)
    return h.hexdigest()
