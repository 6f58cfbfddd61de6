"""Bridge between encoded tensors (``floor.codec``) and the wire's ``TensorMeta`` messages.

The wire only moves bytes; what they mean is the codec's business: an encoded tensor is a
``floor.codec.EncodedTensor`` (name, codec, dtype, shape, block size, zstd level, payload). On the
receiving side payloads are zero-copy ``memoryview`` slices of the one reassembly buffer, which is what keeps
memory bounded while a large payload streams in. The floor imports no JAX, so neither does the wire: a client that
only asks for Status (`diloco status`, `launch`'s display) starts without it (docs/architecture.md, "Errors").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from floor import codec
from floor.codec import CodecSpec, EncodedTensor
from transport import diloco_pb2 as pb


def payload_nbytes(tensor: EncodedTensor) -> int:
    """Bytes the tensor's payload actually has (after zstd, as carried), which ``TensorMeta.nbytes`` declares.

    Not to be confused with ``codec.raw_payload_nbytes``, the size a codec's layout *should* have before zstd.
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
        offset=[int(i) for i in tensor.offset],
    )


def from_meta(meta: pb.TensorMeta, payload: bytes | memoryview) -> EncodedTensor:
    """Rebuild an encoded tensor from its meta and payload bytes."""
    return EncodedTensor(
        name=meta.name,
        codec=meta.codec,
        dtype=meta.dtype,
        shape=tuple(int(d) for d in meta.shape),
        block_size=int(meta.block_size),
        zstd_level=int(meta.zstd_level),
        payload=payload,
        offset=tuple(int(i) for i in meta.offset),
    )


def known_codecs() -> frozenset[str]:
    """Codec names this process can decode."""
    return frozenset(codec.KINDS)


def _decode_fp32(tensor: EncodedTensor) -> np.ndarray:
    """Lossless fp32 without zstd: a zero-copy view of the payload (finiteness is checked by the caller)."""
    expected = codec.raw_payload_nbytes("fp32", int(np.prod(tensor.shape, dtype=np.int64)), 0)
    if payload_nbytes(tensor) != expected:
        raise ValueError(f"{tensor.name}: fp32 payload is {payload_nbytes(tensor)} bytes, not {expected}")
    return np.frombuffer(tensor.payload, dtype="<f4").reshape(tensor.shape)


def _is_plain_fp32(tensor: EncodedTensor) -> bool:
    return tensor.codec == "fp32" and not tensor.zstd_level and tensor.dtype == "float32"


def decoder(sent_with: Sequence[CodecSpec] = ()) -> Callable[[EncodedTensor], np.ndarray]:
    """The decode function used on received tensors; its arrays are read-only. ``sent_with``: the codecs the senders
    may have used (a sparse header's bits and density are checked against them: `floor.codec.decode`).

    ``floor.codec.decode`` for every codec, except plain fp32 (no zstd, float32), whose layout is the
    array itself: that one is a zero-copy view of the receive buffer, so a lossless payload costs its size
    in memory once, not twice. Read-only, so nobody can modify the received bytes through it by accident.
    """

    def decode(tensor: EncodedTensor) -> np.ndarray:
        array = _decode_fp32(tensor) if _is_plain_fp32(tensor) else codec.decode(tensor, sent_with=sent_with)
        array.flags.writeable = False
        return array

    return decode


class Wholes:
    """The tensors of one message sent in pieces (``EncodedTensor.offset``), each assembled as its pieces are decoded:
    an array of the tensor's shape, allocated at its first piece, each piece written into its region; read-only once
    every value is in. The pieces' tiling is the validator's to check (`transport.validate.check_tensor_metas`)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.shapes = dict(shapes or {})
        self._arrays: dict[str, np.ndarray] = {}
        self._missing: dict[str, int] = {}

    def place(self, tensor: EncodedTensor, piece: np.ndarray) -> np.ndarray:
        """Write `piece`, the decoded `tensor`, into its tensor; return that tensor (whole once every piece is in)."""
        whole = self._arrays.get(tensor.name)
        if whole is None:
            shape = self.shapes[tensor.name]
            whole = self._arrays[tensor.name] = np.empty(shape, piece.dtype)
            self._missing[tensor.name] = math.prod(shape)
        whole[tuple(slice(o, o + n) for o, n in zip(tensor.offset, piece.shape, strict=True))] = piece
        self._missing[tensor.name] -= piece.size
        if not self._missing[tensor.name]:
            whole.flags.writeable = False
        return whole
