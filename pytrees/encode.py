"""The codecs' encoders: one named float tensor (numpy or JAX array) into the bytes `floor/codec.py` lays out.

Quantization runs as one jitted JAX function per codec: numpy inputs run on the host CPU without a copy when they
are 64-byte aligned; JAX arrays run on their own device, so a GPU island moves only the compressed bytes to the
host. The byte layout, the metadata and the decoder are JAX-free and live in `floor/codec.py`.
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


def _pack_bits(values: jax.Array, width: int) -> jax.Array:
    """Unsigned ``width``-bit fields as the little-endian bit stream floor/codec.py lays out, zero-padded to bytes."""
    bits = (values[:, None] >> jnp.arange(width, dtype=jnp.uint32)) & jnp.uint32(1)
    flat = bits.reshape(-1).astype(jnp.uint8)
    flat = jnp.pad(flat, (0, -flat.shape[0] % 8))
    return jnp.sum(flat.reshape(-1, 8) << jnp.arange(8, dtype=jnp.uint8), axis=1, dtype=jnp.uint8)


def _top_k_sorted(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Per row, the ``k`` values of largest magnitude (ties to the lower index) in increasing index order."""
    _, index = jax.lax.top_k(jnp.abs(rows), k)
    index = jnp.sort(index, axis=1)
    return index, jnp.take_along_axis(rows, index, axis=1)


@functools.partial(jax.jit, static_argnames=("chunk", "kept", "kept_last", "bits"))
def _enc_sparse(x: jax.Array, chunk: int, kept: int, kept_last: int, bits: int) -> tuple[jax.Array, jax.Array]:
    """Chunked top-k with ``bits``-bit values: the sparse layout after its header, and whether x is finite."""
    n = x.shape[0]
    full = (n - 1) // chunk  # chunks before the last
    index, values = _top_k_sorted(x[full * chunk :][None, :], kept_last)
    owners = [jnp.full(kept_last, full, jnp.int32)]
    if full:
        head_index, head_values = _top_k_sorted(x[: full * chunk].reshape(full, chunk), kept)
        index, values = jnp.concatenate([head_index, index], axis=None), jnp.concatenate([head_values, values], None)
        owners.insert(0, jnp.repeat(jnp.arange(full, dtype=jnp.int32), kept))
    index, values, owner = index.reshape(-1), values.reshape(-1), jnp.concatenate(owners)
    mag = jnp.abs(values)
    lo = jax.ops.segment_min(mag, owner, num_segments=full + 1, indices_are_sorted=True)
    hi = jax.ops.segment_max(mag, owner, num_segments=full + 1, indices_are_sorted=True)
    levels = 1 << (bits - 1)
    step = (hi - lo) / levels
    # Division, not a reciprocal's product: the level chosen is then within float32 rounding of the nearest one.
    safe = jnp.where(step > 0, step, 1.0)[owner]
    level = jnp.clip(jnp.floor((mag - lo[owner]) / safe), 0, levels - 1).astype(jnp.uint32)
    code = level | (values < 0).astype(jnp.uint32) << (bits - 1)
    scales = jax.lax.bitcast_convert_type(jnp.stack([lo, step], axis=1), jnp.uint8).reshape(-1)
    width = index_bits(chunk)
    body = jnp.concatenate([scales, _pack_bits(index.astype(jnp.uint32), width), _pack_bits(code, bits)])
    return body, jnp.all(jnp.isfinite(x))


def _sparse_header(spec: CodecSpec, n: int) -> tuple[np.ndarray, int, int]:
    """The sparse layout's 12-byte header for ``n`` values, and the counts it states."""
    chunk = spec.block_size
    chunks = -(-n // chunk)
    last = n - (chunks - 1) * chunk if chunks else 0
    kept, kept_last = (spec.kept(chunk), spec.kept(last)) if chunks else (0, 0)
    header = np.array([(spec.sparse_bits, index_bits(chunk), 0, kept, kept_last)], "<u1,<u1,<u2,<u4,<u4")
    return header.view(np.uint8), kept, kept_last


def _aligned_f32(x: np.ndarray) -> np.ndarray:
    """C-contiguous, 64-byte aligned float32 view or copy of ``x`` (so XLA:CPU can alias it)."""
    if x.dtype == np.float32 and x.flags.c_contiguous and x.ctypes.data % _ALIGN == 0:
        return x
    buf = np.empty(x.size * 4 + _ALIGN, np.uint8)
    off = (-buf.ctypes.data) % _ALIGN
    out = buf[off : off + x.size * 4].view(np.float32).reshape(x.shape)
    np.copyto(out, x, casting="same_kind")
    return out


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
    flat = _to_device_flat(x)
    if spec.kind == "bf16":
        raw, ok = _enc_bf16(flat)
        if not bool(ok) and not bool(_all_finite(flat)):
            raise CodecError(f"tensor {name!r} has non-finite values (NaN or Inf); refusing to encode")
        if not bool(ok):
            raise CodecError(f"tensor {name!r} has values too large for bfloat16 (|x| > 3.39e38)")
    elif spec.kind == "sparse":
        header, kept, kept_last = _sparse_header(spec, flat.shape[0])
        if flat.shape[0]:
            body, ok = _enc_sparse(flat, chunk=spec.block_size, kept=kept, kept_last=kept_last, bits=spec.sparse_bits)
            if not bool(ok):
                raise CodecError(f"tensor {name!r} has non-finite values (NaN or Inf); refusing to encode")
            header = np.concatenate([header, np.asarray(body)])
        raw = header
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
