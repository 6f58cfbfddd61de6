"""Bridge between encoded tensors (``transport.codecs``) and the wire's ``TensorMeta`` messages.

The wire only moves bytes; what they mean is the codec's business: an encoded tensor is a
``transport.codecs.EncodedTensor`` (name, codec, dtype, shape, block size, zstd level, payload). On the
receiving side payloads are zero-copy ``memoryview`` slices of the one reassembly buffer, which is what keeps
memory bounded while a large payload streams in.

`transport.codecs` (and with it JAX, which its encoders need) is imported when a tensor is first rebuilt or
decoded, not when this module is: a client that only asks for Status (`diloco status`, `launch`'s display)
starts without JAX (docs/architecture.md, "Errors").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from transport import diloco_pb2 as pb

if TYPE_CHECKING:  # transport.codecs imports JAX, loaded only when a tensor is rebuilt or decoded
    from transport.codecs import EncodedTensor


def payload_nbytes(tensor: EncodedTensor) -> int:
    """Bytes the tensor's payload actually has (after zstd, as carried), which ``TensorMeta.nbytes`` declares.

    Not to be confused with ``codecs.raw_payload_nbytes``, the size a codec's layout *should* have before zstd.
    """
    return memoryview(tensor.payload).nbytes


def to_meta(tensor: EncodedTensor) -> pb.TensorMeta:
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


def from_meta(meta: pb.TensorMeta, payload: bytes | memoryview) -> EncodedTensor:
    """Rebuild an encoded tensor from its meta and payload bytes."""
    from transport import codecs

    return codecs.EncodedTensor(
        name=meta.name,
        codec=meta.codec,
        dtype=meta.dtype,
        shape=tuple(int(d) for d in meta.shape),
        block_size=int(meta.block_size),
        zstd_level=int(meta.zstd_level),
        payload=payload,
    )


def known_codecs() -> frozenset[str]:
    """Codec names this process can decode."""
    from transport import codecs

    return frozenset(codecs.KINDS)


def _decode_fp32(tensor: EncodedTensor) -> np.ndarray:
    """Lossless fp32 without zstd: a zero-copy view of the payload (finiteness is checked by the caller)."""
    from transport import codecs

    expected = codecs.raw_payload_nbytes("fp32", int(np.prod(tensor.shape, dtype=np.int64)), 0)
    if payload_nbytes(tensor) != expected:
        raise ValueError(f"{tensor.name}: fp32 payload is {payload_nbytes(tensor)} bytes, not {expected}")
    return np.frombuffer(tensor.payload, dtype="<f4").reshape(tensor.shape)


def _is_plain_fp32(tensor: EncodedTensor) -> bool:
    return tensor.codec == "fp32" and not tensor.zstd_level and tensor.dtype == "float32"


def decoder() -> Callable[[EncodedTensor], np.ndarray]:
    """The decode function used on received tensors; its arrays are read-only.

    ``transport.codecs.decode`` for every codec, except plain fp32 (no zstd, float32), whose layout is the
    array itself: that one is a zero-copy view of the receive buffer, so a lossless payload costs its size
    in memory once, not twice. Read-only, so nobody can modify the received bytes through it by accident.
    """

    from transport import codecs

    def decode(tensor: EncodedTensor) -> np.ndarray:
        array = _decode_fp32(tensor) if _is_plain_fp32(tensor) else codecs.decode(tensor)
        array.flags.writeable = False
        return array

    return decode


def metas_of(tensors: Sequence[EncodedTensor]) -> list[pb.TensorMeta]:
    """``to_meta`` of each tensor, in order."""
    return [to_meta(t) for t in tensors]
