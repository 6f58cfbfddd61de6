"""The codecs' encoders: one named float tensor (numpy or JAX array) into the bytes `floor/codec.py` lays out.

Quantization runs as one jitted JAX function per codec: numpy inputs run on the host CPU without a copy when they
are 64-byte aligned; JAX arrays run on their own device, so a GPU island moves only the compressed bytes to the
host. The sparse codec is the exception: its selection runs in numpy on the host (`_enc_sparse` says why). The byte
layout, the metadata and the decoder are JAX-free and live in `floor/codec.py`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from floor.codec import QMAX, CodecError, CodecSpec, EncodedTensor, dtype_name, from_raw, index_bits

# The encoder writes native-endian bit patterns (lax.bitcast_convert_type); the wire format is little-endian.
if sys.byteorder != "little":  # pragma: no cover - every platform JAX supports is little-endian
    raise ImportError("pytrees.encode requires a little-endian host")

_ALIGN = 64  # XLA:CPU aliases host buffers (no copy) only when they are 64-byte aligned


# --------------------------------------------------------------------------------------------------------
# Jitted encoders: flat float32 vector -> uint8 payload (before zstd) [+ finiteness flags]


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x))


@jax.jit
def _enc_bf16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = x.astype(jnp.bfloat16)
    # NaN/Inf in x stay NaN/Inf in y, so one reduction over y catches non-finite input and overflow alike.
    return jax.lax.bitcast_convert_type(y, jnp.uint16), jnp.all(jnp.isfinite(y))


@functools.partial(jax.jit, static_argnames=("block_size", "qmax"))
def _quantize(x: jax.Array, block_size: int, qmax: int) -> tuple[jax.Array, jax.Array]:
    """Blockwise absmax quantization of a flat vector; returns (codes padded to whole blocks, scales)."""
    n = x.shape[0]
    nb = -(-n // block_size)
    if nb * block_size != n:
        x = jnp.pad(x, (0, nb * block_size - n))
    xb = x.reshape(nb, block_size)
    # absmax as max(max, -min): the same value as max(abs) (NaN and +-Inf propagate, so non-finite input
    # shows up as a non-finite scale), but XLA:CPU lowers max(abs) over a reshaped vector to a much slower
    # fusion.
    scale = jnp.maximum(jnp.max(xb, axis=1), -jnp.min(xb, axis=1)) / qmax
    # Multiply by the reciprocal (cheaper than dividing every element); the extra rounding is inside the
    # documented 2^-20 * absmax term, and clip guards codes that round one step past qmax.
    inv = jnp.where(scale > 0, 1.0 / scale, 0.0)
    q = jnp.clip(jnp.round(xb * inv[:, None]), -qmax, qmax).astype(jnp.int8)
    return q.reshape(-1), scale


@functools.partial(jax.jit, static_argnames=("block_size",))
def _enc_int8(x: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    q, scale = _quantize(x, block_size, QMAX["int8"])
    codes = jax.lax.bitcast_convert_type(q[: x.shape[0]], jnp.uint8)
    sbytes = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(-1)
    return jnp.concatenate([sbytes, codes]), scale


@functools.partial(jax.jit, static_argnames=("block_size",))
def _enc_int4(x: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    q, scale = _quantize(x, block_size, QMAX["int4"])  # padded length is even: block_size is even
    u = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(-1, 2) & jnp.uint8(0x0F)
    packed = (u[:, 0] | (u[:, 1] << 4))[: (x.shape[0] + 1) // 2]
    sbytes = jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(-1)
    return jnp.concatenate([sbytes, packed]), scale


def _pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned ``width``-bit fields (width <= 16) as the little-endian bit stream floor/codec.py lays out, zero-padded
    to bytes."""
    bits = np.unpackbits(values.astype("<u2").view(np.uint8).reshape(-1, 2), axis=1, bitorder="little")
    return np.packbits(bits[:, :width].reshape(-1), bitorder="little")


def _top_k(rows: np.ndarray, k: int) -> np.ndarray | None:
    """Flat positions (row-major, so increasing within each row) of each row's ``k`` values of largest magnitude,
    ties to the lower index; None when a value is NaN or infinite (no order ranks it).

    One partition finds each row's k-th largest magnitude; every value at least that large is kept, and a row where
    ties at that magnitude make more than k gives up its highest-indexed ties (all-zero rows, in practice)."""
    width = rows.shape[1]
    mag = np.abs(rows)
    if not np.isfinite(mag.max()):  # NaN propagates through max: one reduction checks every value
        return None
    kth = np.partition(mag, width - k, axis=1)[:, width - k, None]
    keep = mag >= kth
    for row in np.flatnonzero(np.count_nonzero(keep, axis=1) != k):
        ties = np.flatnonzero(mag[row] == kth[row, 0])
        keep[row, ties[k - np.count_nonzero(mag[row] > kth[row, 0]) :]] = False
    return np.flatnonzero(keep)


def _enc_sparse(flat: np.ndarray, spec: CodecSpec) -> np.ndarray | None:
    """The sparse layout of a flat float32 vector (header included); None when a value is not finite.

    On the host, in numpy: a partition per chunk selects faster on a CPU than XLA's top_k, and an island's Δ is a
    host array already (`Island.take_delta`)."""
    n, chunk = flat.shape[0], spec.block_size
    chunks = -(-n // chunk)
    full = max(chunks - 1, 0)
    last = n - full * chunk
    kept, kept_last = (spec.kept(chunk), spec.kept(last)) if chunks else (0, 0)
    width = index_bits(chunk)
    header = np.array([(spec.sparse_bits, width, 0, kept, kept_last)], "<u1,<u1,<u2,<u4,<u4").view(np.uint8)
    if not chunks:
        return header
    head = _top_k(flat[: full * chunk].reshape(full, chunk), kept) if full else np.zeros(0, np.int64)
    tail = _top_k(flat[full * chunk :].reshape(1, last), kept_last)
    if head is None or tail is None:
        return None
    position = np.concatenate([head, tail + full * chunk])
    values = flat[position]
    mag = np.abs(values)
    owner = np.repeat(np.arange(chunks), [kept] * full + [kept_last])
    starts = np.arange(chunks) * kept
    lo, hi = np.minimum.reduceat(mag, starts), np.maximum.reduceat(mag, starts)
    levels = 1 << (spec.sparse_bits - 1)
    step = (hi - lo) / np.float32(levels)
    safe = np.where(step > 0, step, np.float32(1))
    # Division, not a reciprocal's product: the level chosen is within float32 rounding of the nearest one.
    level = np.clip(np.floor((mag - lo[owner]) / safe[owner]), 0, levels - 1).astype(np.uint32)
    code = level | (values < 0).astype(np.uint32) << np.uint32(spec.sparse_bits - 1)
    scales = np.stack([lo, step], axis=1).astype("<f4").view(np.uint8).reshape(-1)
    index = (position - owner * chunk).astype(np.uint32)
    raw = np.concatenate([header, scales, _pack_bits(index, width), _pack_bits(code, spec.sparse_bits)])
    return raw


def aligned_copy(x: Any, dtype: Any = None) -> np.ndarray:
    """A C-contiguous, 64-byte aligned copy of ``x`` (as ``dtype``, default its own): XLA:CPU places such a buffer
    without copying it again (`jax.device_put` aliases it), where numpy's own large arrays, 16-byte aligned, are
    copied a second time."""
    x = np.asarray(x)
    dtype = x.dtype if dtype is None else np.dtype(dtype)
    buf = np.empty(x.size * dtype.itemsize + _ALIGN, np.uint8)
    off = (-buf.ctypes.data) % _ALIGN
    out = buf[off : off + x.size * dtype.itemsize].view(dtype).reshape(x.shape)
    np.copyto(out, x, casting="same_kind")
    return out


def _aligned_f32(x: np.ndarray) -> np.ndarray:
    """C-contiguous, 64-byte aligned float32 view or copy of ``x`` (so XLA:CPU can alias it)."""
    if x.dtype == np.float32 and x.flags.c_contiguous and x.ctypes.data % _ALIGN == 0:
        return x
    return aligned_copy(x, np.float32)


@functools.cache
def _host_device() -> jax.Device:
    # This process's own: in a multi-process JAX program (a multi-host island) jax.devices()[0] is process 0's.
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # a platform list without "cpu" (e.g. JAX_PLATFORMS=proxy): use the default device
        return jax.local_devices()[0]


def _to_device_flat(x: Any) -> jax.Array:
    if isinstance(x, jax.Array):
        return x.reshape(-1).astype(jnp.float32)
    xa = _aligned_f32(np.asarray(x)).reshape(-1)
    # Host arrays are quantized on the host CPU, aliasing the numpy buffer (no copy).
    return jax.device_put(xa, _host_device(), may_alias=True)


def encode(name: str, x: Any, spec: CodecSpec) -> EncodedTensor:
    """Encode one float tensor (numpy or JAX array) into bytes; refuses NaN/Inf with a :class:`CodecError`."""
    if not isinstance(x, jax.Array | np.ndarray):
        x = np.asarray(x)
    dtype = dtype_name(x.dtype)
    shape = tuple(int(d) for d in np.shape(x))
    if spec.kind == "fp32":
        # The layout is the host float32 array itself; only finiteness needs checking, and numpy checks a host array
        # in one pass with no dispatch (a jitted check would cost a dispatch per leaf, ~100 for a model). A device
        # array comes to the host here, as its payload had to anyway.
        raw = np.ascontiguousarray(np.asarray(x, np.float32)).reshape(-1)
        if not np.isfinite(raw).all():
            raise CodecError(f"tensor {name!r} has non-finite values (NaN or Inf); refusing to encode")
        return from_raw(name, spec, dtype, shape, raw)
    if spec.kind == "sparse":
        raw = _enc_sparse(np.asarray(x, np.float32).reshape(-1), spec)
        if raw is None:
            raise CodecError(f"tensor {name!r} has non-finite values (NaN or Inf); refusing to encode")
        return from_raw(name, spec, dtype, shape, raw)
    flat = _to_device_flat(x)
    if spec.kind == "bf16":
        raw, ok = _enc_bf16(flat)
        if not bool(ok) and not bool(_all_finite(flat)):
            raise CodecError(f"tensor {name!r} has non-finite values (NaN or Inf); refusing to encode")
        if not bool(ok):
            raise CodecError(f"tensor {name!r} has values too large for bfloat16 (|x| > 3.39e38)")
    else:
        enc = _enc_int8 if spec.kind == "int8" else _enc_int4
        raw, scale = enc(flat, block_size=spec.block_size)
        # A NaN or Inf anywhere makes its block's absmax, hence its scale, non-finite: checking the
        # small scale vector replaces a pass over the whole tensor.
        if not np.isfinite(np.asarray(scale)).all():
            raise CodecError(f"tensor {name!r} has non-finite values (NaN or Inf); refusing to encode")
    return from_raw(name, spec, dtype, shape, raw)


def encode_named(named: Mapping[str, Any], spec: CodecSpec) -> list[EncodedTensor]:
    """Encode every tensor of a named tree (``pytrees.naming.flatten_named``'s), in sorted name order."""
    return [encode(name, named[name], spec) for name in sorted(named)]
