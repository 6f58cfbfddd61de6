"""Compressing a pytree for the wire with error feedback, shared by the uplink and the downlink.

An island sends its pseudo-gradient Δ and the coordinator sends its outer update u through the same function:
flatten to named leaves, `encode(x + e)`, keep `e' = (x + e) - decode(encode(x + e))` (error feedback, so what
quantization drops is sent next round instead of lost), and hand back exactly the decoded tree the receiver will
reconstruct. Both sides then compute with the decoded values, which is what keeps every replica bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from transport.codecs import CodecSpec, EncodedTensor, compress_tree_with_feedback, flatten_named, unflatten_named

PyTree = Any
Residual = dict[str, np.ndarray] | None


@dataclass(frozen=True)
class Compressed:
    encoded: list[EncodedTensor]
    decoded: PyTree
    """The tree the receiver reconstructs from `encoded` (float32 numpy leaves, same structure as the input)."""
    residual: Residual
    """What this message could not carry, to add to the next one (None for a lossless codec)."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.encoded)


def is_lossless(spec: CodecSpec) -> bool:
    return spec.kind == "fp32"


def compress_tree(tree: PyTree, residual: Residual, spec: CodecSpec) -> Compressed:
    named = flatten_named(tree)
    if is_lossless(spec):
        encoded, decoded, _ = compress_tree_with_feedback(named, None, spec)
        return Compressed(encoded, unflatten_named(decoded, tree), None)
    encoded, decoded, new_residual = compress_tree_with_feedback(named, residual, spec)
    return Compressed(encoded, unflatten_named(decoded, tree), new_residual)


def decoded_tree(arrays: dict[str, np.ndarray], like: PyTree) -> PyTree:
    """Named arrays (as the transport delivers them) back into the model's tree structure."""
    return unflatten_named(arrays, like)
