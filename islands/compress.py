"""Compressing a pytree for the wire with error feedback, shared by the uplink and the downlink.

An island sends its pseudo-gradient Δ and the coordinator sends its outer update u through the same function:
flatten to named leaves, `encode(x + e)`, keep `e' = (x + e) - decode(encode(x + e))` (error feedback, so what
quantization drops is sent next round instead of lost), and hand back exactly the decoded tree the receiver will
reconstruct. Both sides then compute with the decoded values, which is what keeps every replica bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transport.codecs import (
    CodecSpec,
    EncodedTensor,
    PyTree,
    compress_tree_with_feedback,
    encode_tree,
    flatten_named,
    unflatten_named,
)

Residual = dict[str, np.ndarray] | None
"""Error-feedback state: leaf name -> float32 array, or None for a lossless codec (nothing is ever dropped)."""


@dataclass(frozen=True)
class Compressed:
    encoded: list[EncodedTensor]
    decoded: PyTree
    """The tree the receiver reconstructs from `encoded` (float32 numpy leaves, same structure as the input)."""
    residual: Residual
    """What this message could not carry, to add to the next one (None for a lossless codec)."""

    @property
    def payload_nbytes(self) -> int:
        """Bytes this message puts on the wire (its tensors' encoded payloads; the metadata is not counted)."""
        return sum(t.nbytes for t in self.encoded)


def is_lossless(spec: CodecSpec) -> bool:
    return spec.kind == "fp32"


def zero_residual(tree: PyTree, spec: CodecSpec) -> Residual:
    """The residual a sender starts with: zeros for every leaf of `tree` when `spec` is lossy, else None.

    Starting from zeros (not None) gives a state whose structure never changes during a run, so a checkpoint
    restores into the freshly built state as it is (diloco/checkpoint.py) with no special case.
    """
    if is_lossless(spec):
        return None
    return {name: np.zeros(np.shape(leaf), np.float32) for name, leaf in flatten_named(tree, to_numpy=False).items()}


def compress_tree(tree: PyTree, residual: Residual, spec: CodecSpec) -> Compressed:
    named = flatten_named(tree)
    if is_lossless(spec):
        # fp32 (zstd or not) carries every bit: decode(encode(x)) is x itself, so x is what the receiver will hold.
        # Handing x back skips a decode and a residual pass over every leaf, on the path of every commit and push.
        decoded = {name: np.asarray(x, np.float32) for name, x in named.items()}
        return Compressed(encode_tree(decoded, spec), unflatten_named(decoded, tree), None)
    encoded, decoded, new_residual = compress_tree_with_feedback(named, residual, spec)
    return Compressed(encoded, unflatten_named(decoded, tree), new_residual)


def decoded_tree(arrays: dict[str, np.ndarray], like: PyTree) -> PyTree:
    """Named arrays (as the transport delivers them) back into the model's tree structure."""
    return unflatten_named(arrays, like)
