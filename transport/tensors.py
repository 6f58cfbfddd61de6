"""Bridge between encoded tensors (``transport.codecs``) and the wire's ``TensorMeta`` messages.

The wire only moves bytes; what they mean is the codec's business. An encoded tensor is any object with
``name, codec, dtype, shape, block_size, zstd_level, payload`` (the codecs module's ``EncodedTensor``). On the
receiving side payloads are zero-copy ``memoryview`` slices of the one reassembly buffer, which is what keeps
memory bounded while a large payload streams in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from transport import diloco_pb2 as pb


class EncodedTensorLike(Protocol):
    """What the wire needs from an encoded tensor."""

    name: str
    codec: str
    dtype: str
    shape: tuple[int, ...]
    block_size: int
    zstd_level: int
    payload: bytes | memoryview


@dataclass(frozen=True)
class WireTensor:
    """An encoded tensor as received off the wire (used when ``transport.codecs`` is unavailable)."""

    name: str
    codec: str
    dtype: str
    shape: tuple[int, ...]
    block_size: int
    zstd_level: int
    payload: bytes | memoryview


def _codecs() -> Any | None:
    try:
        return importlib.import_module("transport.codecs")
    except ImportError:
        return None


def payload_nbytes(tensor: EncodedTensorLike) -> int:
    """Encoded size of a tensor's payload in bytes."""
    return memoryview(tensor.payload).nbytes


def to_meta(tensor: EncodedTensorLike) -> pb.TensorMeta:
    """The ``TensorMeta`` that describes ``tensor`` on the wire."""
    return pb.TensorMeta(
        name=tensor.name,
        codec=tensor.codec,
        dtype=str(tensor.dtype),
        shape=[int(d) for d in tensor.shape],
        block_size=int(tensor.block_size or 0),
        zstd_level=int(tensor.zstd_level or 0),
        nbytes=payload_nbytes(tensor),
    )


def from_meta(meta: pb.TensorMeta, payload: bytes | memoryview) -> EncodedTensorLike:
    """Rebuild an encoded tensor from its meta and payload bytes (the codecs' own type when available)."""
    fields = dict(
        name=meta.name,
        codec=meta.codec,
        dtype=meta.dtype,
        shape=tuple(int(d) for d in meta.shape),
        block_size=int(meta.block_size),
        zstd_level=int(meta.zstd_level),
        payload=payload,
    )
    codecs = _codecs()
    cls = getattr(codecs, "EncodedTensor", None) if codecs is not None else None
    if cls is not None:
        return cls(**fields)
    return WireTensor(**fields)


def known_codecs() -> frozenset[str]:
    """Codec names this process can decode."""
    codecs = _codecs()
    names = getattr(codecs, "KINDS", None) if codecs is not None else None
    if names is not None:
        return frozenset(names)
    return frozenset({"fp32"})


def _decode_fp32(tensor: EncodedTensorLike) -> np.ndarray:
    """Lossless fp32 without zstd: a zero-copy view of the payload (finiteness is checked by the caller)."""
    expected = int(np.prod(tensor.shape, dtype=np.int64)) * 4
    if payload_nbytes(tensor) != expected:
        raise ValueError(f"{tensor.name}: fp32 payload is {payload_nbytes(tensor)} bytes, not {expected}")
    return np.frombuffer(tensor.payload, dtype="<f4").reshape(tensor.shape)


def _is_plain_fp32(tensor: EncodedTensorLike) -> bool:
    return tensor.codec == "fp32" and not tensor.zstd_level and tensor.dtype == "float32"


def decoder() -> Callable[[EncodedTensorLike], np.ndarray]:
    """The decode function used on received tensors; its arrays are read-only.

    ``transport.codecs.decode`` for every codec, except plain fp32 (no zstd, float32), whose layout is the
    array itself: that one is a zero-copy view of the receive buffer, so a lossless payload costs its size
    in memory once, not twice. Read-only, so nobody can modify the received bytes through it by accident.
    """
    codecs = _codecs()
    full = getattr(codecs, "decode", None) if codecs is not None else None

    def decode(tensor: EncodedTensorLike) -> np.ndarray:
        if _is_plain_fp32(tensor) or full is None:
            array = _decode_fp32(tensor)
        else:
            array = full(tensor)
        array.flags.writeable = False
        return array

    return decode


def metas_of(tensors: Sequence[EncodedTensorLike]) -> list[pb.TensorMeta]:
    """``to_meta`` of each tensor, in order."""
    return [to_meta(t) for t in tensors]
