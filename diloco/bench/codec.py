"""`diloco bench codec`: compression ratio, encode/decode throughput and error of the pseudo-gradient codecs.

Feeds the DiLoCo cost model (docs/architecture.md, "Cost model"): bytes up per round are ``P * b/8 / z``; this
measures ``b`` (bits per value incl. block scales), ``z`` (zstd ratio on top) and what the host pays in time to get
them.

Data: a pseudo-gradient-like float32 matrix (rows x 4096): standard normal values times a per-row scale
drawn log-normally around 1e-3 (rows of a weight matrix move by very different amounts), with a few
outliers (heavy tails are what blockwise absmax scales must cope with).

Figures per (codec, zstd level):

* ``ratio``: float32 bytes / payload bytes.
* ``encode_gbps`` / ``decode_gbps``: float32 bytes / median wall time of ``encode`` / ``decode`` (host numpy
  in, real bytes out, incl. zstd), after one warm-up call so jit compilation is excluded; ``combined_gbps``
  = float32 bytes / (t_encode + t_decode).
* ``max_rel_err``: max over blocks of 256 consecutive values of ``max |x - x̂| / absmax(block)`` -- the
  quantity bounded by ``1 / (2 qmax)`` for intN (0.0039 for int8, 0.071 for int4) and ~2^-9 for bf16.
* ``mean_rel_err``: ``mean |x - x̂| / mean |x|``; ``rel_l2_err``: ``||x - x̂|| / ||x||``.

The sparse codec (chunks of ``--chunk``, ``--density``, ``--sparse-bits``) drops most values by design, so its
block error says little; its rows add ``kept_max_rel_err``, the largest error of a kept value over its chunk's
kept range ``hi - lo`` (bounded by ``2^-b``, floor/codec.py), and ``kept_energy``, the share of ``||x||²`` the kept
values carry (what one message moves; error feedback sends the rest later).

``pieces`` (``--pieces K``, default 8): error-fed encoding (`pytrees.feedback`) of the matrix whole against the same
matrix cut into K row blocks encoded one by one, as a leaf split by rows over K devices travels (pytrees/pieces.py),
side by side in this process for each codec without zstd: ``pieces_over_whole`` is the time ratio, and
``same_values`` says the decoded values and the new residual are the whole encoding's, bit for bit. The cost model:
the same arithmetic over the same bytes in K calls, plus writing each piece's decoded values and residual into the
leaf's, so about 1.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco.bench.errors import BenchError
from floor.codec import KINDS, QMAX, CodecSpec, decode
from pytrees.encode import encode
from pytrees.feedback import compress_split, compress_with_feedback
from pytrees.pieces import Split

_COLS = 4096
_ERR_BLOCK = 256


def make_pseudo_gradient(size_mb: float, seed: int = 0) -> np.ndarray:
    """A float32 (rows, 4096) matrix of about ``size_mb`` MiB that looks like a DiLoCo pseudo-gradient."""
    rows = max(1, round(size_mb * 2**20 / 4 / _COLS))
    rng = np.random.default_rng(seed)
    row_scale = (1e-3 * np.exp(rng.standard_normal((rows, 1)))).astype(np.float32)
    x = rng.standard_normal((rows, _COLS), dtype=np.float32) * row_scale
    idx = rng.integers(0, x.size, size=max(1, x.size // 100_000))
    x.reshape(-1)[idx] *= 20.0  # rare outliers
    # Hand it over the way flatten_named does for a CPU JAX array: a host view of a JAX-owned buffer.
    return np.asarray(jax.block_until_ready(jnp.asarray(x)))


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    result = fn()  # warm-up: jit compilation and first-touch page faults are not measured
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _errors(x: np.ndarray, xh: np.ndarray) -> dict[str, float]:
    flat, err = x.reshape(-1), np.abs(xh.reshape(-1).astype(np.float32) - x.reshape(-1))
    m = flat.size // _ERR_BLOCK * _ERR_BLOCK
    absmax = np.abs(flat[:m]).reshape(-1, _ERR_BLOCK).max(axis=1)
    blk_err = err[:m].reshape(-1, _ERR_BLOCK).max(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(absmax > 0, blk_err / absmax, 0.0)
    return {
        "max_rel_err": float(rel.max()) if rel.size else 0.0,
        "mean_rel_err": float(err.mean(dtype=np.float64) / np.abs(flat).mean(dtype=np.float64)),
        "rel_l2_err": float(np.linalg.norm(err) / np.linalg.norm(flat)),
    }


def _sparse_errors(x: np.ndarray, xh: np.ndarray, chunk: int) -> dict[str, float]:
    flat, back = x.reshape(-1), xh.reshape(-1)
    rows = flat.size // chunk
    xs, hs = flat[: rows * chunk].reshape(rows, chunk), back[: rows * chunk].reshape(rows, chunk)
    kept = hs != 0
    mags = np.where(kept, np.abs(xs), np.nan)
    spread = np.nanmax(mags, axis=1) - np.nanmin(mags, axis=1)
    err = np.where(kept, np.abs(xs - hs), 0.0).max(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(spread > 0, err / spread, 0.0)
    energy = float(np.square(xs[kept], dtype=np.float64).sum() / np.square(xs, dtype=np.float64).sum())
    return {"kept_max_rel_err": float(rel.max()) if rel.size else 0.0, "kept_energy": energy}


def pieces_against_whole(x: np.ndarray, spec: CodecSpec, pieces: int, repeats: int) -> dict[str, Any]:
    """Error-fed encoding of `x` whole against `x` cut into `pieces` row blocks, side by side (the module docstring's
    ``pieces``)."""
    rows = x.shape[0] // pieces
    split = Split(x.shape, tuple(((i * rows, 0), x[i * rows : (i + 1) * rows]) for i in range(pieces)))
    residual = np.full_like(x, 1e-5)
    t_whole, (_, decoded, kept) = _median_time(lambda: compress_with_feedback(x, residual, spec, name="bench"), repeats)
    t_pieces, (_, decoded_p, kept_p) = _median_time(
        lambda: compress_split(split, residual, spec, name="bench"), repeats
    )
    same = decoded.tobytes() == decoded_p.tobytes() and kept.tobytes() == kept_p.tobytes()
    return {
        "codec": spec.kind,
        "whole_s": t_whole,
        "pieces_s": t_pieces,
        "pieces_over_whole": t_pieces / t_whole,
        "same_values": same,
    }


def run_codec_bench(
    size_mb: float = 64,
    repeats: int = 5,
    zstd_level: int = 1,
    block_size: int = 256,
    sparse: CodecSpec | None = None,
    pieces: int = 8,
) -> dict[str, Any]:
    """Benchmark every codec with and without zstd on ``size_mb`` MiB of float32; returns a JSON-able dict.
    ``sparse``: the sparse codec's chunk, density and bits (default: CodecSpec's, SparseLoCo's). ``pieces``: the
    row blocks of the pieces comparison (below 2: none)."""
    if size_mb <= 0:
        raise BenchError(f"bench codec: --size-mb must be positive (got {size_mb})")
    if repeats < 1:
        raise BenchError(f"bench codec: --repeats must be at least 1 (got {repeats})")
    sparse = sparse or CodecSpec(kind="sparse", block_size=4096)
    x = make_pseudo_gradient(size_mb)
    dense = x.nbytes
    results = []
    for kind in KINDS:
        for level in (0, zstd_level):
            spec = (
                dataclasses.replace(sparse, zstd_level=level)
                if kind == "sparse"
                else CodecSpec(kind=kind, block_size=block_size, zstd_level=level)
            )
            t_enc, enc = _median_time(lambda spec=spec: encode("bench", x, spec), repeats)
            t_dec, xh = _median_time(lambda enc=enc: decode(enc), repeats)
            row: dict[str, Any] = {
                "codec": kind,
                "zstd_level": level,
                "bytes": enc.nbytes,
                "ratio": dense / enc.nbytes,
                "bits_per_value": 8 * enc.nbytes / x.size,
                "encode_s": t_enc,
                "decode_s": t_dec,
                "encode_gbps": dense / t_enc / 1e9,
                "decode_gbps": dense / t_dec / 1e9,
                "combined_gbps": dense / (t_enc + t_dec) / 1e9,
            }
            row.update(_errors(x, xh))
            if kind in QMAX:
                row["err_bound"] = 1 / (2 * QMAX[kind])
            if kind == "sparse":
                row.update(_sparse_errors(x, xh, spec.block_size))
                row["err_bound"] = 2.0**-spec.sparse_bits
                row["cost_model_ratio"] = 32 / spec.bits_per_value()
            results.append(row)
    cut = []
    if pieces > 1:
        if x.shape[0] % pieces or (x.shape[0] // pieces * _COLS) % max(block_size, sparse.block_size):
            raise BenchError(
                f"bench codec: --pieces {pieces} must cut the {x.shape[0]} rows into blocks of whole codec blocks"
            )
        for kind in KINDS:
            spec = sparse if kind == "sparse" else CodecSpec(kind=kind, block_size=block_size)
            cut.append(pieces_against_whole(x, spec, pieces, repeats))
    by = {(r["codec"], r["zstd_level"]): r for r in results}
    targets = {
        "int8_combined_gbps_ge_1": by[("int8", 0)]["combined_gbps"] >= 1.0,
        "int8_ratio_ge_3.9": by[("int8", 0)]["ratio"] >= 3.9,
        "int4_ratio_ge_7.5": by[("int4", 0)]["ratio"] >= 7.5,
        "sparse_combined_gbps_ge_0.5": by[("sparse", 0)]["combined_gbps"] >= 0.5,
        "sparse_ratio_ge_100": by[("sparse", 0)]["ratio"] >= 100,
    }
    return {
        "size_mb": dense / 2**20,
        "shape": list(x.shape),
        "numel": int(x.size),
        "block_size": block_size,
        "sparse": {"chunk": sparse.block_size, "density": sparse.density, "sparse_bits": sparse.sparse_bits},
        "repeats": repeats,
        "host_cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],  # other work on the host skews throughput; record it
        "jax_backend": jax.default_backend(),
        "results": results,
        "pieces": {"count": pieces, "results": cut} if cut else None,
        "targets": targets,
    }
