"""Pseudo-gradient codecs: float32 / bfloat16 / blockwise int8 and int4, each optionally zstd-compressed.

DiLoCo (arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512) send one pseudo-gradient per island per
round over a slow WAN link; Streaming DiLoCo shows that 4-bit values lose almost nothing when the sender
keeps *error feedback* (the residual of what quantization dropped is added to the next message, as in
1-bit SGD / EF-SGD). This module is the wire format of one encoded tensor: the codec spec, the byte layout, the
tensor with its metadata, and the decoder. It imports neither JAX nor gRPC, so every package may import it
(docs/architecture.md, "Package boundaries"); the jitted encoders are in `pytrees/encode.py`, error feedback in
`pytrees/feedback.py`.

Codecs (``CodecSpec.kind``)
---------------------------
``fp32``  lossless float32.
``bf16``  round-to-nearest-even bfloat16; per element ``|x - x̂| <= 2^-8 |x|`` (for |x| >= 2^-126; smaller
          values may be flushed to zero). Values that overflow bfloat16 (|x| >~ 3.39e38) are refused.
``int8``  symmetric blockwise absmax quantization (qmax = 127): the tensor, flattened in C order, is cut into
          blocks of ``block_size`` values (the last block may be short); each block has the float32 scale
          ``s = absmax(block) / qmax`` and codes ``q = clip(round_half_even(x / s), -qmax, qmax)``;
          decoding gives ``x̂ = q * s``. Per element, with ``a = absmax(block)``::

              |x - x̂| <= s/2 + 2^-20 * a + qmax * 2^-126   ( = a / (2*qmax) plus float32 rounding )

          The last two terms are float32 rounding and flush-to-zero of subnormals (a block whose
          ``s`` is below 2^-126 decodes as zeros).
``int4``  the same with qmax = 7, two codes per byte.

Default block size 256 with float32 scales: the scale overhead is 4 bytes per 256 values, so the ratio vs
float32 before zstd is 4 / (1 + 4/256) = 3.94x for int8 and 8 / (1 + 8/256) = 7.76x for int4.

Payload layout (header-free; the metadata -- name, codec, dtype, shape, block size, zstd level -- travels
separately as the fields of :class:`EncodedTensor`). ``n`` is the element count,
``nb = ceil(n / block_size)``, all multi-byte numbers little-endian:

* ``fp32``: ``n`` float32.
* ``bf16``: ``n`` uint16, the upper half of the (rounded) float32 bit pattern.
* ``int8``: ``nb`` float32 scales, then ``n`` int8 codes.
* ``int4``: ``nb`` float32 scales, then ``ceil(n/2)`` bytes; element ``2i`` in the low nibble and ``2i+1`` in
  the high nibble of byte ``i``, each a two's-complement nibble; for odd ``n`` the last high nibble is 0.
* ``zstd_level > 0``: the bytes above as one zstd frame that records its content size.

Three sizes describe one tensor, each with one name: *dense* (``dense_nbytes``, ``4 * n``: the float32
reference for compression ratios and for the decode size limit ``max_dense_nbytes``), *raw* (the layout above
before zstd: ``raw_payload_nbytes(kind, n, block_size)``, ``EncodedTensor.raw_nbytes``, what a received
payload must decode to) and *payload* (the bytes actually carried, after zstd: ``EncodedTensor.nbytes``).

Quantization runs as one jitted JAX function per codec (`pytrees/encode.py`: numpy inputs run on the host CPU
without a copy when they are 64-byte aligned; JAX arrays run on their own device, so a GPU island moves only the
compressed bytes to the host). Decoding is plain numpy (here), so the same bytes give the same array bit for bit on
every host: the coordinator commits ``decode(encode(u))`` and every island applies the identical array.

Decoding never trusts the sender: payload length is checked against shape, codec and block size; zstd
frames must claim and produce exactly the expected size (no decompression bombs); scales must be finite and
non-negative; the decoded array must be finite. Any failure raises :class:`CodecError` naming the tensor.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np
import zstandard

KINDS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
"""Codec names, in order of decreasing size."""

QMAX: dict[str, int] = {"int8": 127, "int4": 7}
"""Largest code magnitude of the blockwise integer codecs (symmetric; -128 / -8 are never produced)."""

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
"""Tensor dtypes accepted; all are encoded from float32 and decoded back to the recorded dtype."""

MAX_BLOCK_SIZE = 1 << 16
MAX_ZSTD_LEVEL = 22
MAX_NDIM = 32
DEFAULT_MAX_DENSE_NBYTES = 1 << 34
"""Default cap (16 GiB) on a decoded tensor's float32 (dense) size, so forged metadata cannot make us allocate."""

_F32_MAX = float(np.finfo(np.float32).max)


class CodecError(ValueError):
    """A tensor cannot be encoded (non-finite, bad dtype) or a message cannot be decoded (malformed)."""


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """How pseudo-gradients (or outer updates) are compressed on the wire."""

    kind: str = "int8"
    """One of ``fp32`` (lossless), ``bf16``, ``int8``, ``int4`` (blockwise absmax)."""

    block_size: int = 256
    """Values per quantization block (int8/int4 only; ignored by fp32/bf16). One float32 scale per block:
    256 keeps the scale overhead at 1.6% (int8 ratio 3.94x, int4 7.76x). Positive, even, <= 65536."""

    zstd_level: int = 0
    """zstd level applied after quantization, 1..22; 0 turns zstd off."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CodecError(f"codec.kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0 or bs % 2:
            raise CodecError(f"codec.block_size must be a positive multiple of 2 (got {bs!r})")
        if bs > MAX_BLOCK_SIZE:
            raise CodecError(f"codec.block_size must be at most {MAX_BLOCK_SIZE} (got {bs})")
        lvl = self.zstd_level
        if isinstance(lvl, bool) or not isinstance(lvl, int) or not 0 <= lvl <= MAX_ZSTD_LEVEL:
            raise CodecError(f"codec.zstd_level must be an integer in 0..{MAX_ZSTD_LEVEL}, 0 = off (got {lvl!r})")

    @property
    def blockwise(self) -> bool:
        """True for the integer codecs, which carry one scale per block."""
        return self.kind in QMAX

    def bits_per_value(self) -> float:
        """Bits per value before zstd, scale overhead included (for the cost model)."""
        return {"fp32": 32.0, "bf16": 16.0, "int8": 8.0, "int4": 4.0}[self.kind] + (
            32.0 / self.block_size if self.blockwise else 0.0
        )


@dataclasses.dataclass(frozen=True)
class EncodedTensor:
    """One tensor as bytes plus the small explicit metadata that travels beside it."""

    name: str
    """Stable leaf name, e.g. ``blocks/0/attn/wq`` (``pytrees.naming.flatten_named``'s)."""
    codec: str
    """Codec kind (one of :data:`KINDS`)."""
    dtype: str
    """Dtype of the original tensor and of the decoded array (a key of :data:`DTYPES`)."""
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    block_size: int
    """Quantization block size (int8/int4), 0 for fp32/bf16."""
    zstd_level: int
    """zstd level the payload was compressed with, 0 if the payload is not zstd-compressed."""
    payload: bytes | memoryview
    """The bytes laid out as the module docstring says (a received tensor's is a view of the receive buffer)."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the payload as carried (after zstd): what the wire moves for this tensor."""
        return memoryview(self.payload).nbytes

    @property
    def raw_nbytes(self) -> int:
        """Payload size before zstd, as implied by the metadata (equal to ``nbytes`` without zstd)."""
        return raw_payload_nbytes(self.codec, self.numel, self.block_size)

    @property
    def dense_nbytes(self) -> int:
        """Size of the same tensor as float32 (the reference for compression ratios)."""
        return 4 * self.numel


def raw_payload_nbytes(kind: str, numel: int, block_size: int) -> int:
    """Exact size of the ``kind`` layout of ``numel`` elements before zstd (the module docstring's layout).

    What a payload must be (or decompress to), computed from metadata alone, so a receiver can check a
    payload before trusting it. The bytes a tensor actually carries are ``EncodedTensor.nbytes``.
    """
    if kind == "fp32":
        return 4 * numel
    if kind == "bf16":
        return 2 * numel
    nb = -(-numel // block_size)
    if kind == "int8":
        return 4 * nb + numel
    if kind == "int4":
        return 4 * nb + (numel + 1) // 2
    raise CodecError(f"unknown codec {kind!r}")


def dtype_name(dtype: Any) -> str:
    """The key of :data:`DTYPES` for ``dtype``; refuses any other dtype."""
    dt = np.dtype(dtype)
    for name, d in DTYPES.items():
        if d == dt:
            return name
    raise CodecError(f"dtype {dt} is not supported (use one of {', '.join(DTYPES)})")


# zstd contexts are not thread-safe; keep one per thread (the gRPC server is threaded).
_tls = threading.local()


def _zstd_compress(data: bytes | memoryview, level: int) -> bytes:
    cache = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx.compress(data)


def _zstd_decompress(name: str, data: bytes, expected: int) -> bytes:
    """Decompress one zstd frame holding exactly ``expected`` bytes; refuses bombs and trailing data."""
    dctx = getattr(_tls, "dctx", None)
    if dctx is None:
        dctx = _tls.dctx = zstandard.ZstdDecompressor()
    try:
        size = zstandard.get_frame_parameters(data).content_size
        if size == zstandard.CONTENTSIZE_ERROR:
            raise CodecError(f"tensor {name!r}: invalid zstd frame header")
        if size != zstandard.CONTENTSIZE_UNKNOWN and size != expected:
            # zstandard ignores max_output_size when the header states a size, so check it first.
            raise CodecError(f"tensor {name!r}: zstd frame claims {size} bytes, expected {expected}")
        out = dctx.decompress(data, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CodecError(f"tensor {name!r}: bad zstd payload ({e})") from None
    if len(out) != expected:
        raise CodecError(f"tensor {name!r}: zstd frame holds {len(out)} bytes, expected {expected}")
    return out


def from_raw(name: str, spec: CodecSpec, dtype: str, shape: tuple[int, ...], raw: Any) -> EncodedTensor:
    """The tensor whose payload is ``raw``'s bytes, the layout above (zstd-compressed when the spec says so)."""
    data = np.asarray(raw).data  # host buffer, zero-copy on CPU
    # Without zstd the payload is a read-only view of that buffer, not a copy of it: a copy of all of θ would be on
    # every commit's and every push's path. For fp32 of a host array the buffer is the input's own: nothing in this
    # project changes an encoded array in place.
    payload = _zstd_compress(data, spec.zstd_level) if spec.zstd_level else data.cast("B").toreadonly()
    return EncodedTensor(
        name=name,
        codec=spec.kind,
        dtype=dtype,
        shape=shape,
        block_size=spec.block_size if spec.blockwise else 0,
        zstd_level=spec.zstd_level,
        payload=payload,
    )


def _check_meta(enc: EncodedTensor, max_dense_nbytes: int) -> None:
    name = enc.name
    if enc.codec not in KINDS:
        raise CodecError(f"tensor {name!r}: unknown codec {enc.codec!r}")
    if enc.dtype not in DTYPES:
        raise CodecError(f"tensor {name!r}: unsupported dtype {enc.dtype!r}")
    shape = enc.shape
    if (
        not isinstance(shape, tuple)
        or len(shape) > MAX_NDIM
        or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)
    ):
        raise CodecError(f"tensor {name!r}: invalid shape {shape!r}")
    if 4 * math.prod(shape) > max_dense_nbytes:
        raise CodecError(f"tensor {name!r}: shape {shape} exceeds the size limit of {max_dense_nbytes} bytes")
    if enc.codec in QMAX:
        bs = enc.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0 or bs % 2 or bs > MAX_BLOCK_SIZE:
            raise CodecError(f"tensor {name!r}: invalid block size {bs!r}")
    lvl = enc.zstd_level
    if isinstance(lvl, bool) or not isinstance(lvl, int) or not 0 <= lvl <= MAX_ZSTD_LEVEL:
        raise CodecError(f"tensor {name!r}: invalid zstd level {lvl!r}")
    if not isinstance(enc.payload, bytes | bytearray | memoryview):
        raise CodecError(f"tensor {name!r}: payload must be bytes (got {type(enc.payload).__name__})")


# Byte -> (low code, high code) for int4: one table lookup unpacks and sign-extends both nibbles. The pair is
# read as one int16 (little-endian: low code first): one gather of 2 bytes per byte, faster than a (256, 2) table.
_INT4_LUT = np.array([[((b & 15) ^ 8) - 8, ((b >> 4) ^ 8) - 8] for b in range(256)], dtype=np.int8)
_INT4_LUT16 = _INT4_LUT.view(np.int16).reshape(256)


def _dequantize(codes: np.ndarray, scale: np.ndarray, block_size: int) -> np.ndarray:
    """``codes * scale[block]`` in one pass, no padding: whole blocks as a 2-D broadcast, then the tail."""
    n = codes.shape[0]
    out = np.empty(n, np.float32)
    full = n // block_size
    m = full * block_size
    # Overflow only happens with forged scales; decode() then finds the Inf and refuses the message.
    with np.errstate(over="ignore"):
        if full:
            blocks = (full, block_size)
            np.multiply(codes[:m].reshape(blocks), scale[:full, None], out=out[:m].reshape(blocks))
        if m < n:
            np.multiply(codes[m:], scale[full], out=out[m:])
    return out


def decode(enc: EncodedTensor, *, max_dense_nbytes: int = DEFAULT_MAX_DENSE_NBYTES) -> np.ndarray:
    """Decode bytes into a new numpy array of ``enc.shape`` and ``enc.dtype``; deterministic bit for bit.

    Raises :class:`CodecError` (naming the tensor) on any malformed input: bad metadata, a payload of the
    wrong length, a zstd frame that claims or yields a size other than expected, non-finite or negative
    scales, or non-finite decoded values.
    """
    _check_meta(enc, max_dense_nbytes)
    name, n = enc.name, enc.numel
    expected = raw_payload_nbytes(enc.codec, n, enc.block_size)
    data: bytes | bytearray | memoryview = enc.payload
    if enc.zstd_level:
        data = _zstd_decompress(name, bytes(data), expected)
    elif len(data) != expected:
        raise CodecError(
            f"tensor {name!r}: payload is {len(data)} bytes, expected {expected} for {enc.codec} "
            f"shape {enc.shape} block {enc.block_size}"
        )
    check_all = True
    if enc.codec == "fp32":
        out = np.frombuffer(data, "<f4", count=n).astype(np.float32)
    elif enc.codec == "bf16":
        out = np.left_shift(np.frombuffer(data, "<u2", count=n), 16, dtype=np.uint32).view(np.float32)
    else:
        nb = -(-n // enc.block_size)
        scale = np.frombuffer(data, "<f4", count=nb)
        if not (np.isfinite(scale).all() and (scale >= 0).all()):
            raise CodecError(f"tensor {name!r}: scales must be finite and non-negative")
        if enc.codec == "int8":
            codes = np.frombuffer(data, np.int8, count=n, offset=4 * nb)
        else:
            packed = np.frombuffer(data, np.uint8, count=(n + 1) // 2, offset=4 * nb)
            codes = np.take(_INT4_LUT16, packed).view(np.int8)[:n]
        out = _dequantize(codes, scale, enc.block_size)
        # |code| <= 128, so with every scale below FLT_MAX/128 the products are finite: skip the full pass.
        check_all = nb > 0 and float(scale.max()) > _F32_MAX / 128
    if check_all and not np.isfinite(out).all():
        raise CodecError(f"tensor {name!r}: decoded values are not finite")
    out = out.reshape(enc.shape)
    if enc.dtype != "float32":
        out = out.astype(DTYPES[enc.dtype])
    return out


def decode_named(
    encoded: Iterable[EncodedTensor], *, max_dense_nbytes: int = DEFAULT_MAX_DENSE_NBYTES
) -> dict[str, np.ndarray]:
    """Decode a list of tensors into a name -> array dict (sorted by name); duplicate names are refused."""
    out: dict[str, np.ndarray] = {}
    for enc in encoded:
        if enc.name in out:
            raise CodecError(f"tensor {enc.name!r} appears twice")
        out[enc.name] = decode(enc, max_dense_nbytes=max_dense_nbytes)
    return dict(sorted(out.items()))
