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

from floor.codec import QMAX, CodecError, CodecSpec, EncodedTensor, dtype_name, from_raw

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
