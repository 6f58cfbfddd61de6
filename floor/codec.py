"""Pseudo-gradient codecs: float32 / bfloat16 / blockwise int8 and int4 / sparse low-bit top-k, each optionally
zstd-compressed.

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
``sparse`` chunked top-k with low-bit values (SparseLoCo, arXiv 2508.15706): the flattened tensor is cut into
          chunks of ``block_size`` values (the codec's *chunk*; the last chunk may be short); each chunk keeps
          its ``k(L) = min(L, max(1, floor(density * L + 1/2)))`` values of largest magnitude (L the chunk's length;
          ties go to the lower index) and sends their positions and ``b = sparse_bits`` bits for each value: a sign
          and ``b - 1`` bits of magnitude on a grid spanning the kept magnitudes, ``lo`` (the smallest) to ``hi``
          (the largest) in ``2^(b-1)`` levels of width ``step = (hi - lo) / 2^(b-1)``; level ``m`` decodes as
          ``lo + (m + 1/2) * step``. Every value not kept decodes as exactly 0 (what error feedback then keeps);
          every kept value within::

              |x - x̂| <= (hi - lo) / 2^b + 2^-21 * hi + 2^-126   ( half a level plus float32 rounding )

          so a chunk whose kept magnitudes are all equal (or that keeps one value) carries them exactly.

Default block size 256 with float32 scales: the scale overhead is 4 bytes per 256 values, so the ratio vs
float32 before zstd is 4 / (1 + 4/256) = 3.94x for int8 and 8 / (1 + 8/256) = 7.76x for int4.

``sparse``'s cost model, per full chunk of ``c`` values keeping ``k``: ``8 + k * (w + b) / 8`` bytes, with
``w = ceil(log2 c)`` index bits, ``b`` value bits and 8 bytes of ``(lo, step)``; 12 bytes of header per tensor. The
defaults (c = 4096 as SparseLoCo's 64 x 64 chunks, density 1/64 so k = 64, w = 12, b = 2) make 8 + 112 = 120 bytes
for 16384 of float32: 136.5x (b = 3: 128x; b = 4: 120.5x; density 0.03 and b = 2: 73x).

Pieces: a tensor split over an island's devices (or processes) is encoded shard by shard where the shard lives,
each shard a piece (``EncodedTensor.offset``: the region's place in the tensor); the receiver checks that a name's
pieces tile its tensor (``check_tiling``) and decodes each into its region. An island splits a tensor into pieces
only where each piece decodes to exactly what the whole tensor's encoding would (``piece_decodes_as_whole``: its
runs are whole blocks), so pieces never change a decoded value, nor any digest after it.

Payload layout (header-free; the metadata -- name, codec, dtype, shape, block size, zstd level -- travels
separately as the fields of :class:`EncodedTensor`). ``n`` is the element count,
``nb = ceil(n / block_size)``, all multi-byte numbers little-endian:

* ``fp32``: ``n`` float32.
* ``bf16``: ``n`` uint16, the upper half of the (rounded) float32 bit pattern.
* ``int8``: ``nb`` float32 scales, then ``n`` int8 codes.
* ``int4``: ``nb`` float32 scales, then ``ceil(n/2)`` bytes; element ``2i`` in the low nibble and ``2i+1`` in
  the high nibble of byte ``i``, each a two's-complement nibble; for odd ``n`` the last high nibble is 0.
* ``sparse``: with ``c = block_size``, ``nc = ceil(n / c)`` chunks, the last of length ``L = n - (nc - 1) * c``:

  - a 12-byte header: uint8 ``b`` (value bits, 2..8), uint8 ``w`` (index bits, ``ceil(log2 c)``), uint16 0,
    uint32 ``k`` (values kept in each chunk but the last), uint32 ``k_last`` (kept in the last chunk); for
    ``n = 0`` both counts are 0;
  - ``nc`` pairs of float32 ``(lo, step)``, one per chunk;
  - ``K = (nc - 1) * k + k_last`` indices of ``w`` bits, chunk after chunk, each the value's position inside its
    chunk, strictly increasing within a chunk; one little-endian bit stream (value ``i`` in bits ``i*w`` to
    ``i*w + w - 1``, bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``), zero-padded to a whole byte;
  - ``K`` codes of ``b`` bits in the same bit order, the value of index ``i``: the top bit its sign (1 negative),
    the low ``b - 1`` bits its level ``m``; zero-padded to a whole byte.

  ``12 + 8 * nc + ceil(K * w / 8) + ceil(K * b / 8)`` bytes (``sparse_payload_nbytes``): the counts and widths in
  the header, not the metadata, fix the size, so a received tensor's declared size is checked against the range
  its shape and chunk allow (``raw_payload_range``) and then against its own header.
* ``zstd_level > 0``: the bytes above as one zstd frame that records its content size.

Three sizes describe one tensor, each with one name: *dense* (``dense_nbytes``, ``4 * n``: the float32
reference for compression ratios and for the decode size limit ``max_dense_nbytes``), *raw* (the layout above
before zstd: ``raw_payload_nbytes(kind, n, block_size)``, ``EncodedTensor.raw_nbytes``, what a received
payload must decode to) and *payload* (the bytes actually carried, after zstd: ``EncodedTensor.nbytes``).

Quantization runs as one jitted JAX function per codec (`pytrees/encode.py`: numpy inputs run on the host CPU
without a copy when they are 64-byte aligned; JAX arrays run on their own device, so a GPU island moves only the
compressed bytes to the host). Decoding is plain numpy (here), so the same bytes give the same array bit for bit on
every host: the coordinator commits ``decode(encode(u))`` and every island applies the identical array.

Decoding never trusts the sender: payload length is checked against shape, codec and block size (and for
``sparse`` against its header); zstd frames must claim and produce exactly the expected size, or for ``sparse`` a
size within its range (no decompression bombs); scales must be finite and non-negative; ``sparse``'s header must
name widths that match the chunk and counts that fit it, and its indices must lie inside their chunk, each once;
the decoded array must be finite. Any failure raises :class:`CodecError` naming the tensor.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import zstandard

KINDS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "sparse")
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
SPARSE_BITS = range(2, 9)
"""Value bits the sparse codec sends (sign and 1..7 bits of magnitude level)."""
SPARSE_HEADER_NBYTES = 12
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
    """One of ``fp32`` (lossless), ``bf16``, ``int8``, ``int4`` (blockwise absmax), ``sparse`` (chunked top-k)."""

    block_size: int = 256
    """Values per quantization block (int8/int4; one float32 scale per block: 256 keeps the scale overhead at 1.6%,
    int8 ratio 3.94x, int4 7.76x), or per chunk (sparse: its top-k is taken per chunk; 4096 is SparseLoCo's 64 x 64).
    Ignored by fp32/bf16. Positive, even, <= 65536."""

    zstd_level: int = 0
    """zstd level applied after quantization, 1..22; 0 turns zstd off."""

    density: float = 1 / 64
    """sparse only: the fraction of each chunk kept, in (0, 1] (1/64 keeps 64 of 4096, as SparseLoCo does)."""

    sparse_bits: int = 2
    """sparse only: bits per kept value, 2..8 (a sign and sparse_bits - 1 bits of magnitude level)."""

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
        if self.kind == "sparse":
            d = self.density
            if isinstance(d, bool) or not isinstance(d, int | float) or not 0 < d <= 1:
                raise CodecError(f"codec.density must be a fraction in (0, 1] (got {d!r})")
            b = self.sparse_bits
            if isinstance(b, bool) or not isinstance(b, int) or b not in SPARSE_BITS:
                raise CodecError(f"codec.sparse_bits must be an integer in 2..8 (got {b!r})")

    @property
    def blockwise(self) -> bool:
        """True for the codecs whose tensors carry a block size: the integer codecs' blocks, sparse's chunks."""
        return self.kind in QMAX or self.kind == "sparse"

    def kept(self, length: int) -> int:
        """sparse: values a chunk of ``length`` keeps, ``min(L, max(1, floor(density * L + 1/2)))`` (0 for L = 0)."""
        return min(length, max(1, math.floor(self.density * length + 0.5)))

    def union(self, senders: int, density: float) -> CodecSpec:
        """sparse: this spec at the density of the union of ``senders`` messages of ``density`` each (SparseLoCo's
        all-gather: disjoint top-k sets), ``min(1, senders * density)``: never more than a whole chunk."""
        return dataclasses.replace(self, density=min(1.0, senders * density))

    def bits_per_value(self) -> float:
        """Bits per value before zstd, scale and index overhead included, for full blocks (the cost model)."""
        if self.kind == "sparse":
            c, k = self.block_size, self.kept(self.block_size)
            return (64 + k * (index_bits(c) + self.sparse_bits)) / c
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
    """Shape of the original tensor, or of the piece of it this is (`offset`): what the payload decodes to."""
    block_size: int
    """Quantization block size (int8/int4) or chunk (sparse), 0 for fp32/bf16."""
    zstd_level: int
    """zstd level the payload was compressed with, 0 if the payload is not zstd-compressed."""
    payload: bytes | memoryview
    """The bytes laid out as the module docstring says (a received tensor's is a view of the receive buffer)."""
    offset: tuple[int, ...] = ()
    """A piece: where the region of ``shape`` starts in the named tensor (one index per dimension), encoded alone
    ("Pieces" in the module docstring); () for the whole tensor."""

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
        """Payload size before zstd, as implied by the metadata (equal to ``nbytes`` without zstd); for sparse, whose
        size its header fixes, as implied by that header."""
        if self.codec == "sparse":
            most = raw_payload_range("sparse", self.numel, self.block_size)[1]
            data = self.payload if not self.zstd_level else _zstd_decompress(self.name, bytes(self.payload), None, most)
            return _SparseHeader.parse(self.name, data, self.numel, self.block_size).nbytes
        return raw_payload_nbytes(self.codec, self.numel, self.block_size)

    @property
    def dense_nbytes(self) -> int:
        """Size of the same tensor as float32 (the reference for compression ratios)."""
        return 4 * self.numel


def piece_decodes_as_whole(
    kind: str, block_size: int, whole: Sequence[int], offset: Sequence[int], shape: Sequence[int]
) -> bool:
    """True when the region ``[offset, offset + shape)`` of a tensor of shape ``whole``, encoded alone with ``kind``,
    decodes to exactly the values the whole tensor's encoding gives there ("Pieces" in the module docstring).

    fp32 and bf16 work value by value: any region. The blockwise codecs (int8, int4 and sparse's chunks) cut the
    C-order flattening into blocks: the region's elements lie in the whole's order as runs (one per index of the
    dimensions before the last one it does not span whole), and each run must be whole blocks that start on a block
    boundary, so the region's own blocks are the whole's, value for value."""
    if kind in ("fp32", "bf16"):
        return True
    ndim = len(whole)
    if ndim == 0 or math.prod(shape) == 0:
        return False
    k = ndim - 1
    while k > 0 and shape[k] == whole[k]:
        k -= 1
    inner = math.prod(whole[k + 1 :])
    if (shape[k] * inner) % block_size or (offset[k] * inner) % block_size:
        return False
    # Every other run starts a multiple of the stride of dimension k - 1 further on.
    several = any(o or s > 1 for o, s in zip(offset[:k], shape[:k], strict=True))
    return not (several and (whole[k] * inner) % block_size)


def check_tiling(name: str, whole: Sequence[int], pieces: Sequence[tuple[Sequence[int], Sequence[int]]]) -> None:
    """The regions ``(offset, shape)`` tile a tensor of shape ``whole`` exactly: each inside it, none overlapping,
    none missing. They must form a grid (as the shards of a sharded array do): along each dimension the pieces' edges
    cut it into intervals, each piece spans one interval per dimension, and each cell of the grid is one piece.
    Raises :class:`CodecError` naming the tensor; costs O(pieces x dimensions), whatever the shape."""
    ndim = len(whole)
    for offset, shape in pieces:
        if len(offset) != ndim or len(shape) != ndim:
            raise CodecError(f"tensor {name!r}: a piece has {len(offset)} offsets for {ndim} dimensions")
    cuts: list[list[int]] = []
    for d in range(ndim):
        edges = {0, int(whole[d])}
        for offset, shape in pieces:
            lo, hi = int(offset[d]), int(offset[d]) + int(shape[d])
            if lo < 0 or shape[d] <= 0 or hi > whole[d]:
                raise CodecError(
                    f"tensor {name!r}: piece at {tuple(offset)} of shape {tuple(shape)} is not inside {tuple(whole)}"
                )
            edges.update((lo, hi))
        cuts.append(sorted(edges))
    where = [{edge: i for i, edge in enumerate(c)} for c in cuts]
    seen: set[tuple[int, ...]] = set()
    for offset, shape in pieces:
        cell = tuple(where[d][int(offset[d])] for d in range(ndim))
        if any(where[d][int(offset[d]) + int(shape[d])] != cell[d] + 1 for d in range(ndim)) or cell in seen:
            raise CodecError(f"tensor {name!r}: piece at {tuple(offset)} of shape {tuple(shape)} overlaps another")
        seen.add(cell)
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
        if cells > len(seen):
            raise CodecError(f"tensor {name!r}: its {len(pieces)} pieces leave part of it out")


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
    if kind == "sparse":
        raise CodecError("a sparse tensor's size is fixed by its header (raw_payload_range, sparse_payload_nbytes)")
    raise CodecError(f"unknown codec {kind!r}")


def raw_payload_range(kind: str, numel: int, block_size: int) -> tuple[int, int]:
    """The fewest and the most bytes the ``kind`` layout of ``numel`` elements can have before zstd.

    One size for every codec but ``sparse``, whose header fixes its size: from one value per chunk at 2 bits to every
    value at 8 bits. What a receiver checks a declared size against before it has a payload to read.
    """
    if kind != "sparse":
        size = raw_payload_nbytes(kind, numel, block_size)
        return size, size
    nc = -(-numel // block_size)
    w = index_bits(block_size)
    return sparse_payload_nbytes(nc, nc, w, min(SPARSE_BITS)), sparse_payload_nbytes(nc, numel, w, max(SPARSE_BITS))


def index_bits(chunk: int) -> int:
    """Bits of one sparse index: ``ceil(log2 chunk)``, enough for every position of a chunk."""
    return max(1, (chunk - 1).bit_length())


def sparse_payload_nbytes(chunks: int, kept: int, index_width: int, value_bits: int) -> int:
    """Exact size of a sparse layout of ``chunks`` chunks keeping ``kept`` values in all (the docstring's formula)."""
    return SPARSE_HEADER_NBYTES + 8 * chunks + -(-kept * index_width // 8) + -(-kept * value_bits // 8)


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


def _zstd_decompress(name: str, data: bytes, expected: int | None, most: int | None = None) -> bytes:
    """Decompress one zstd frame holding exactly ``expected`` bytes, or (``expected`` None) a size its frame header
    states and that is at most ``most``; refuses bombs and trailing data."""
    dctx = getattr(_tls, "dctx", None)
    if dctx is None:
        dctx = _tls.dctx = zstandard.ZstdDecompressor()
    try:
        size = zstandard.get_frame_parameters(data).content_size
        if size == zstandard.CONTENTSIZE_ERROR:
            raise CodecError(f"tensor {name!r}: invalid zstd frame header")
        if expected is None:
            if size == zstandard.CONTENTSIZE_UNKNOWN:
                raise CodecError(f"tensor {name!r}: zstd frame does not state its size")
            if most is not None and size > most:
                raise CodecError(f"tensor {name!r}: zstd frame claims {size} bytes, at most {most} allowed")
            expected = size
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
    if enc.codec in QMAX or enc.codec == "sparse":
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


@dataclasses.dataclass(frozen=True)
class _SparseHeader:
    """A sparse payload's header, checked against the tensor's size and chunk (the module docstring's layout)."""

    bits: int
    """``b``, bits per value."""
    width: int
    """``w``, bits per index."""
    kept: int
    """``k``, values kept in each chunk but the last."""
    kept_last: int
    """``k_last``, values kept in the last chunk."""
    chunks: int
    last: int
    """Length of the last chunk."""

    @property
    def total(self) -> int:
        """``K``, values kept in all."""
        return (self.chunks - 1) * self.kept + self.kept_last if self.chunks else 0

    @property
    def nbytes(self) -> int:
        return sparse_payload_nbytes(self.chunks, self.total, self.width, self.bits)

    @classmethod
    def parse(cls, name: str, data: bytes | bytearray | memoryview, numel: int, chunk: int) -> _SparseHeader:
        if len(data) < SPARSE_HEADER_NBYTES:
            raise CodecError(
                f"tensor {name!r}: sparse payload of {len(data)} bytes has no {SPARSE_HEADER_NBYTES}-byte header"
            )
        bits, width, zero, kept, kept_last = np.frombuffer(data, "<u1,<u1,<u2,<u4,<u4", count=1)[0].tolist()
        if bits not in SPARSE_BITS:
            raise CodecError(f"tensor {name!r}: sparse header says {bits} value bits, not one of 2..8")
        if width != index_bits(chunk):
            raise CodecError(
                f"tensor {name!r}: sparse header says {width}-bit indices; chunks of {chunk} take {index_bits(chunk)}"
            )
        if zero:
            raise CodecError(f"tensor {name!r}: sparse header's reserved field is {zero}, not 0")
        chunks = -(-numel // chunk)
        last = numel - (chunks - 1) * chunk if chunks else 0
        if chunks == 0 and (kept or kept_last):
            raise CodecError(f"tensor {name!r}: sparse header keeps {kept} / {kept_last} values of an empty tensor")
        if chunks and not (1 <= kept <= chunk and 1 <= kept_last <= last):
            raise CodecError(
                f"tensor {name!r}: sparse header keeps {kept} of each chunk of {chunk} and {kept_last} of the last "
                f"of {last}: counts must be 1..the chunk's length"
            )
        return cls(bits, width, kept, kept_last, chunks, last)


def _unpack_bits(data: bytes | bytearray | memoryview, offset: int, count: int, width: int) -> np.ndarray:
    """``count`` unsigned ``width``-bit fields (width <= 16) of the little-endian bit stream at byte ``offset``."""
    nbytes = -(-count * width // 8)
    stream = np.zeros(nbytes + 3, np.uint8)  # room to read 3 bytes at every field's first byte
    stream[:nbytes] = np.frombuffer(data, np.uint8, count=nbytes, offset=offset)
    bit = np.arange(count, dtype=np.int64) * width
    byte = bit >> 3
    word = (
        stream[byte].astype(np.uint32)
        | stream[byte + 1].astype(np.uint32) << 8
        | stream[byte + 2].astype(np.uint32) << 16
    )
    return (word >> (bit & 7).astype(np.uint32)) & np.uint32((1 << width) - 1)


def _decode_sparse(
    name: str, data: bytes | bytearray | memoryview, n: int, chunk: int, sent_with: Sequence[CodecSpec] = ()
) -> np.ndarray:
    """The sparse layout into a dense float32 vector of ``n``; refuses what does not match its header or chunks,
    or (``sent_with``) every spec the run may have sent it with: value bits and density."""
    hdr = _SparseHeader.parse(name, data, n, chunk)
    if sent_with and hdr.chunks:
        wants = [(s.sparse_bits, s.kept(chunk) if hdr.chunks > 1 else hdr.kept, s.kept(hdr.last)) for s in sent_with]
        if (hdr.bits, hdr.kept, hdr.kept_last) not in wants:
            shown = ", ".join(f"{k} and {last}" for _, k, last in wants[:4]) + (", ..." if len(wants) > 4 else "")
            raise CodecError(
                f"tensor {name!r}: sparse header says {hdr.bits}-bit values, {hdr.kept} kept per chunk and "
                f"{hdr.kept_last} in the last; this run sends {wants[0][0]}-bit values, {shown} "
                "(codec.sparse_bits, codec.density)"
            )
    if len(data) != hdr.nbytes:
        raise CodecError(
            f"tensor {name!r}: sparse payload is {len(data)} bytes; its header ({hdr.total} values of {hdr.width}-bit "
            f"indices and {hdr.bits}-bit codes in {hdr.chunks} chunks) makes {hdr.nbytes}"
        )
    out = np.zeros(n, np.float32)
    if not hdr.chunks:
        return out
    scales = np.frombuffer(data, "<f4", count=2 * hdr.chunks, offset=SPARSE_HEADER_NBYTES).reshape(hdr.chunks, 2)
    if not (np.isfinite(scales).all() and (scales >= 0).all()):
        raise CodecError(f"tensor {name!r}: sparse scales must be finite and non-negative")
    total, offset = hdr.total, SPARSE_HEADER_NBYTES + 8 * hdr.chunks
    index = _unpack_bits(data, offset, total, hdr.width).astype(np.int64)
    codes = _unpack_bits(data, offset + -(-total * hdr.width // 8), total, hdr.bits)
    full = (hdr.chunks - 1) * hdr.kept
    rows = index[:full].reshape(hdr.chunks - 1, hdr.kept)
    tail = index[full:]
    if (rows.size and int(rows.max()) >= chunk) or int(tail.max()) >= hdr.last:
        raise CodecError(f"tensor {name!r}: a sparse index lies outside its chunk")
    if (np.diff(rows, axis=1) <= 0).any() or (np.diff(tail) <= 0).any():
        raise CodecError(f"tensor {name!r}: sparse indices must increase within a chunk (duplicate or out of order)")
    owner = np.repeat(np.arange(hdr.chunks, dtype=np.int64), [hdr.kept] * (hdr.chunks - 1) + [hdr.kept_last])
    level = (codes & np.uint32((1 << (hdr.bits - 1)) - 1)).astype(np.float32) + np.float32(0.5)
    with np.errstate(over="ignore"):  # forged scales overflow; the check below refuses them
        values = scales[owner, 0] + level * scales[owner, 1]
    if not np.isfinite(values).all():
        raise CodecError(f"tensor {name!r}: decoded values are not finite")
    np.negative(values, out=values, where=(codes >> np.uint32(hdr.bits - 1)).astype(bool))
    out[owner * chunk + index] = values
    return out


def decode(
    enc: EncodedTensor, *, max_dense_nbytes: int = DEFAULT_MAX_DENSE_NBYTES, sent_with: Sequence[CodecSpec] = ()
) -> np.ndarray:
    """Decode bytes into a new numpy array of ``enc.shape`` and ``enc.dtype``; deterministic bit for bit.

    Raises :class:`CodecError` (naming the tensor) on any malformed input: bad metadata, a payload of the
    wrong length, a zstd frame that claims or yields a size other than expected, non-finite or negative
    scales, or non-finite decoded values. ``sent_with``: the specs the sender may have used (empty: any); a sparse
    payload whose header names value bits and counts per chunk of none of them is refused (a self-consistent payload
    of another density would otherwise be applied as if it were the run's).
    """
    _check_meta(enc, max_dense_nbytes)
    name, n = enc.name, enc.numel
    data: bytes | bytearray | memoryview = enc.payload
    if enc.codec == "sparse":
        if enc.zstd_level:
            data = _zstd_decompress(name, bytes(data), None, raw_payload_range("sparse", n, enc.block_size)[1])
        return _finish(enc, _decode_sparse(name, data, n, enc.block_size, sent_with))
    expected = raw_payload_nbytes(enc.codec, n, enc.block_size)
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
    return _finish(enc, out)


def _finish(enc: EncodedTensor, flat: np.ndarray) -> np.ndarray:
    """The decoded float32 vector in the tensor's shape and dtype."""
    out = flat.reshape(enc.shape)
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
