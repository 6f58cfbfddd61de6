"""Error feedback: compressing a tensor, a named dict or a pytree for the wire, shared by the uplink and the downlink.

An island sends its pseudo-gradient Δ and the coordinator sends its outer update u through the same function:
flatten to named leaves, `encode(x + e)`, keep `e' = (x + e) - decode(encode(x + e))` (error feedback, so what
quantization drops is sent next round instead of lost), and hand back exactly the decoded tree the receiver will
reconstruct. Both sides then compute with the decoded values, which is what keeps every replica bit-identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from floor.codec import CodecError, CodecSpec, EncodedTensor, decode
from pytrees.encode import encode, encode_named
from pytrees.naming import PyTree, flatten_named, to_host, unflatten_named
from pytrees.pieces import Split, values_at

Residual = dict[str, Any] | None
"""Error-feedback state: leaf name -> float32 array, or None for a lossless codec (nothing is ever dropped). On a
multi-process island whose parameters are split across its processes, the residual of such a leaf is a JAX array laid
out as its parameter, each process holding (and checkpointing) its own regions (`islands.island.Island.start`)."""


def compress_with_feedback(
    x: Any, residual: np.ndarray | None, spec: CodecSpec, *, name: str = "tensor", decay: float = 1.0
) -> tuple[EncodedTensor, np.ndarray, np.ndarray]:
    """Error-feedback compression (EF-SGD): send ``encode(x + β·e)`` and keep what it lost.

    Returns ``(encoded, decoded, new_residual)`` with ``decoded = decode(encoded)`` (exactly what the
    receiver will get) and ``new_residual = (x + β·e) - decoded`` in float32. ``residual=None`` means zeros.
    With ``decay`` β = 1, summed over rounds, the decoded messages equal the summed inputs minus the current
    residual, so the drift stays bounded by one quantization error instead of growing with the number of rounds.
    β < 1 is SparseLoCo's accumulator (outer.kind = "sparseloco"): what was not sent fades, and the residual, a
    decayed sum of past pseudo-gradients, is the outer momentum it replaces. Pure: on a :class:`CodecError` the
    caller's residual is unchanged.
    """
    target = np.asarray(x, dtype=np.float32)
    if residual is not None:
        if np.shape(residual) != target.shape:
            raise CodecError(f"tensor {name!r}: residual shape {np.shape(residual)} does not match {target.shape}")
        carried = np.asarray(residual, dtype=np.float32)
        target = target + (carried if decay == 1.0 else np.float32(decay) * carried)
    encoded = encode(name, target, spec)
    decoded = decode(encoded)
    return encoded, decoded, target - decoded.astype(np.float32)


def compress_split(
    split: Split, residual: np.ndarray | Split | None, spec: CodecSpec, *, name: str, decay: float = 1.0
) -> tuple[list[EncodedTensor], np.ndarray | Split, np.ndarray | Split]:
    """:func:`compress_with_feedback` piece by piece (`pytrees.pieces`): each piece of the leaf with its region of the
    residual, encoded alone as a piece of tensor `name`. Returns (the pieces, the decoded leaf, the new residual), the
    same values as compressing the whole leaf gives (`islands.island.delta_of` splits only where they are).

    A partial `split` (this process's pieces of a leaf split across processes) takes its residual as a `Split` of the
    same regions and gives its decoded values and new residual as such `Split`s."""
    if isinstance(residual, np.ndarray) and np.shape(residual) != split.shape:
        raise CodecError(f"tensor {name!r}: residual shape {np.shape(residual)} does not match {split.shape}")
    encoded, decoded, new_residual = [], [], []
    for offset, where, values in split.regions():
        carried = None if residual is None else values_at(residual, offset, where)
        enc, dec, res = compress_with_feedback(values, carried, spec, name=name, decay=decay)
        encoded.append(replace(enc, offset=offset))
        decoded.append((offset, dec.astype(np.float32, copy=False)))
        new_residual.append((offset, res))
    decoded_split, residual_split = Split(split.shape, tuple(decoded)), Split(split.shape, tuple(new_residual))
    if not split.complete:
        return encoded, decoded_split, residual_split
    return encoded, decoded_split.whole(), residual_split.whole()


def compress_named(
    named: Mapping[str, Any], residuals: Mapping[str, Any] | None, spec: CodecSpec, decay: float = 1.0
) -> tuple[list[EncodedTensor], dict[str, Any], dict[str, Any]]:
    """:func:`compress_with_feedback` over a named tree (a `Split` leaf by :func:`compress_split`); returns (encoded
    list, decoded, new residuals)."""
    encoded: list[EncodedTensor] = []
    decoded: dict[str, Any] = {}
    new_res: dict[str, Any] = {}
    for name in sorted(named):
        res = None if residuals is None else residuals.get(name)
        leaf = named[name]
        if isinstance(leaf, Split):
            pieces, decoded[name], new_res[name] = compress_split(leaf, res, spec, name=name, decay=decay)
            encoded.extend(pieces)
            continue
        enc, decoded[name], new_res[name] = compress_with_feedback(leaf, res, spec, name=name, decay=decay)
        encoded.append(enc)
    return encoded, decoded, new_res


@dataclass(frozen=True)
class Compressed:
    encoded: list[EncodedTensor]
    decoded: PyTree
    """The tree the receiver reconstructs from `encoded` (float32 numpy leaves, same structure as the input); None
    once a sender that never reads it let it go (`islands.island.RoundPush.for_the_wire`)."""
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
    restores into the freshly built state as it is (diloco/run/checkpoint.py) with no special case.
    """
    if is_lossless(spec):
        return None
    return {name: np.zeros(np.shape(leaf), np.float32) for name, leaf in flatten_named(tree, to_numpy=False).items()}


def compress_tree(tree: PyTree, residual: Residual, spec: CodecSpec, decay: float = 1.0) -> Compressed:
    """`tree` compressed for the wire with error feedback (`residual` decayed by `decay` first, as
    :func:`compress_with_feedback` says); a lossless codec has no residual to decay."""
    named = {
        name: leaf if isinstance(leaf, Split) else to_host(leaf)
        for name, leaf in flatten_named(tree, to_numpy=False).items()
    }
    if is_lossless(spec):
        # fp32 (zstd or not) carries every bit: decode(encode(x)) is x itself, so x is what the receiver will hold.
        # Handing x back skips a decode and a residual pass over every leaf, on the path of every commit and push.
        whole = {name: x for name, x in named.items() if not isinstance(x, Split)}
        decoded = {name: np.asarray(x, np.float32) for name, x in whole.items()}
        encoded = encode_named(decoded, spec)
        for name, split in named.items():
            if isinstance(split, Split):
                encoded.extend(replace(encode(name, v, spec), offset=o) for o, v in split.pieces)
                decoded[name] = split.whole() if split.complete else split
        return Compressed(sorted(encoded, key=lambda t: t.name), unflatten_named(decoded, tree), None)
    encoded, decoded, new_residual = compress_named(named, residual, spec, decay)
    return Compressed(encoded, unflatten_named(decoded, tree), new_residual)
