"""Validation before state: every check a message must pass before the coordinator's handler sees it.

The fault model (docs/architecture.md) promises that malformed, oversized, NaN or forged pseudo-gradients are
rejected with a reason and never touch θ. The checks here are pure functions that raise `Rejected(code, reason)`;
the service runs them in order (identity, run id, push metadata, round, tensor specs, then after the bytes
arrived: digest, decode, finiteness) and only then calls the handler.

Every field is the sender's word, so each is held to what an honest island can send: the numbers of a push
(loss, seconds, tokens) finite, non-negative where they count something, never subnormal (no measurement is
1e-310 s, and a total divided by one becomes infinite); its fragment one the model has; its codec the run's;
texts no longer than anything legitimate (a join's config, a leave's reason). Decoded float32 tensors have
their subnormal values flushed to zero, as XLA does on the coordinator's own arithmetic, so they cannot slow
numpy down and no honest push is refused for them. What is sent back or logged of an attacker's text goes
through `printable`: bounded and with control characters escaped.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np

from floor.codec import CodecError, CodecSpec, EncodedTensor, check_tiling
from transport import diloco_pb2 as pb
from transport.errors import Rejected

TensorSpec = tuple[tuple[int, ...], str]
"""Expected (shape, decoded dtype) of one tensor."""

ModelSpec = Mapping[str, TensorSpec] | Callable[[int], Mapping[str, TensorSpec]]
"""The tensors a push must carry: one mapping for a model of one fragment (0), or ``fragment -> mapping``."""

MAX_TEXT = 200
"""Characters of an attacker's text that `printable` keeps; also the longest leave reason accepted."""
MAX_CONFIG_JSON = 1 << 20
"""Longest config a join may carry (a resolved run config is a few KiB)."""
MAX_SECONDS = 1e9
"""Longest compute or wall time a push may report (31 years): sums of them stay finite."""
MAX_CHUNK_SPANS = 4096
"""Most chunk spans a push may name (data.sampling = "chunks"); the coordinator's ledger bounds them to what one
round can read, this only bounds what is parsed before it is asked."""
_F32_TINY = float(np.finfo(np.float32).tiny)
_SUBNORMAL_STEP = 1 << 18  # float32 values per block of the subnormal scan (bounded temporaries)


def printable(text: str, limit: int = MAX_TEXT) -> str:
    """At most ``limit`` characters of ``text``, non-printable ones escaped (``\\n``, ``\\x1b``): what may be sent
    back or logged of a string that came over the wire. A cut text ends with the length of the whole."""
    out: list[str] = []
    size = 0
    for ch in text:
        piece = ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
        if size + len(piece) > limit:
            marker = f"...[{len(text)} chars]"
            kept = "".join(out)
            return kept[: max(0, limit - len(marker))] + marker
        out.append(piece)
        size += len(piece)
    return "".join(out)


def check_run_and_island(run_id: str, island: str, expected_run_id: str, caller: str | None) -> None:
    """The message is for this run, and (when authenticated) from the island the credentials belong to."""
    if run_id != expected_run_id:
        raise Rejected(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"run_id {run_id!r} does not match this coordinator's run {expected_run_id!r}",
        )
    if not island:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "island name is empty")
    if caller is not None and island != caller:
        raise Rejected(
            grpc.StatusCode.PERMISSION_DENIED,
            f"credentials of island {caller!r} cannot act as island {island!r}",
        )


def check_round(round_: int, current: int, max_staleness: int = 0) -> None:
    """Accept pushes for the current round, or up to ``max_staleness`` rounds behind (async mode)."""
    if round_ > current:
        raise Rejected(
            grpc.StatusCode.FAILED_PRECONDITION, f"round {round_} is in the future (current round {current})"
        )
    if round_ < current - max_staleness:
        raise Rejected(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"round {round_} is stale (current round {current}, max staleness {max_staleness})",
        )


def _check_number(key: str, value: float, tiny: float, nonnegative: bool, most: float = math.inf) -> None:
    """One reported number: finite, not subnormal, and in range."""
    if not math.isfinite(value) or value != 0 and abs(value) < tiny:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{key} must be a finite, normal number (got {value!r})")
    if nonnegative and not 0 <= value <= most:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{key} must be in [0, {most:g}] (got {value!r})")


def check_push_meta(
    meta: pb.PushMeta,
    tensors: Sequence[pb.TensorMeta],
    model_spec: ModelSpec | None = None,
    uplink: CodecSpec | None = None,
) -> None:
    """What a push claims about itself: its numbers, its fragment, the codec of each of its ``tensors``.

    ``model_spec`` (when given) says which fragments exist; ``uplink`` (when given) is the codec the run's islands
    encode with, its kind, block size and zstd level: a payload encoded otherwise is refused even when it decodes
    (an int4 push where the run says fp32, or a zstd frame where it says no zstd, is not a push of this run). The
    coordinator caps ``tokens``; here it must only be positive.
    """
    if meta.tokens == 0:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "tokens must be > 0 (it is the aggregation weight)")
    if len(meta.chunks) > MAX_CHUNK_SPANS:
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the push names {len(meta.chunks)} chunk spans, at most {MAX_CHUNK_SPANS}",
        )
    _check_number("loss", meta.loss, _F32_TINY, nonnegative=False)
    for key in ("compute_s", "wall_s"):
        _check_number(key, getattr(meta, key), sys.float_info.min, nonnegative=True, most=MAX_SECONDS)
    if model_spec is not None:
        spec_for(model_spec, meta.fragment)
    if uplink is None:
        return
    expected = (uplink.kind, uplink.block_size if uplink.blockwise else 0, uplink.zstd_level)
    for t in tensors:
        sent = (t.codec, t.block_size, t.zstd_level)
        if sent != expected:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {t.name!r} is {_codec_name(*sent)}; this run's islands send {_codec_name(*expected)} "
                "(codec.uplink, codec.block_size, codec.zstd_level)",
            )


def _codec_name(kind: str, block_size: int, zstd_level: int) -> str:
    """How a refusal names a tensor's encoding: "int8 (blocks of 256, zstd level 3)", "fp32 (no zstd)"."""
    blocks = f"blocks of {block_size}, " if block_size else ""
    return f"{kind!r} ({blocks}{f'zstd level {zstd_level}' if zstd_level else 'no zstd'})"


def check_join(req: pb.JoinRequest) -> None:
    """A join's texts are no bigger than a real config and a release name."""
    if len(req.config_json) > MAX_CONFIG_JSON:
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"config_json is {len(req.config_json)} characters; a run config is at most {MAX_CONFIG_JSON}",
        )
    if len(req.release) > MAX_TEXT:
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT, f"release is {len(req.release)} characters, at most {MAX_TEXT}"
        )


SOURCE_DIGEST_BYTES = 32
"""A source's content identity on a lease: a SHA-256 (islands/chunks.py `source_digest`)."""
MAX_SOURCE_SEQUENCES = 1 << 40
"""The most sequences a source named on a lease may hold (about a trillion: far beyond any corpus one island reads),
so the coordinator's arithmetic over its chunks stays bounded whatever the wire says."""


def check_lease(req: pb.LeaseRequest) -> None:
    """A lease asks for at least one sequence (the coordinator bounds the most: one round's worth); a source it names
    is a SHA-256 with a count of sequences from 1 to `MAX_SOURCE_SEQUENCES`, or absent with no count."""
    if req.sequences == 0:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "a lease asks for at least one sequence (got 0)")
    if not req.source:
        if req.source_sequences:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "a lease names source_sequences without a source")
        return
    if len(req.source) != SOURCE_DIGEST_BYTES:
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a lease's source is {len(req.source)} bytes; a source is named by its {SOURCE_DIGEST_BYTES}-byte SHA-256",
        )
    if not 1 <= req.source_sequences <= MAX_SOURCE_SEQUENCES:
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a lease's source holds 1 to {MAX_SOURCE_SEQUENCES} sequences, not {req.source_sequences}",
        )


def check_leave(req: pb.LeaveRequest | pb.RetireRequest) -> None:
    """A leave's or retirement's reason is a short note (the coordinator writes it to its events)."""
    if len(req.reason) > MAX_TEXT:
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT, f"leave reason is {len(req.reason)} characters, at most {MAX_TEXT}"
        )


def spec_for(spec: ModelSpec, fragment: int) -> Mapping[str, TensorSpec]:
    """The expected tensors of ``fragment``; a fragment the model does not have is refused (never read as 0)."""
    if callable(spec):
        try:
            return spec(fragment)
        except (KeyError, IndexError, ValueError):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fragment {fragment}") from None
    if fragment != 0:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fragment {fragment} (the model has only 0)")
    return spec


def check_tensor_metas(metas: Sequence[pb.TensorMeta], expected: Mapping[str, TensorSpec]) -> None:
    """Names, shapes and dtypes exactly as the model spec says; nothing missing, nothing extra. A tensor sent as
    pieces (`TensorMeta.offset`) is sent as pieces alone, which tile its shape exactly (`floor.codec.check_tiling`)."""
    names = [m.name for m in metas]
    missing = sorted(set(expected) - set(names))
    if missing:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"missing tensors: {', '.join(missing[:5])}")
    pieces: dict[str, list[pb.TensorMeta]] = {}
    for m in metas:
        if m.name not in expected:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected tensor {m.name!r}")
        shape, dtype = expected[m.name]
        if m.offset:
            pieces.setdefault(m.name, []).append(m)
        elif tuple(m.shape) != tuple(shape):
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {m.name!r}: shape {tuple(m.shape)} != expected {tuple(shape)}",
            )
        want = dtype if isinstance(dtype, str) else str(np.dtype(dtype))
        if m.dtype != want:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"tensor {m.name!r}: dtype {m.dtype!r} != expected {want!r}"
            )
    entries = Counter(names)
    for name, parts in pieces.items():
        if entries[name] != len(parts):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {name!r} is sent whole and in pieces")
        try:
            check_tiling(name, expected[name][0], [(m.offset, m.shape) for m in parts])
        except CodecError as e:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def decode_one(tensor: EncodedTensor, decode: Callable[[EncodedTensor], np.ndarray]) -> np.ndarray:
    """Decode one tensor; undecodable, misshapen or non-finite -> INVALID_ARGUMENT."""
    try:
        array = decode(tensor)
    except Rejected:
        raise
    except Exception as e:  # a codec error on untrusted bytes is the sender's fault, not ours
        why = str(e) if repr(tensor.name) in str(e) else f"tensor {tensor.name!r}: {e}"
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {why}") from None
    if tuple(array.shape) != tuple(tensor.shape):
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor {tensor.name!r} decodes to shape {tuple(array.shape)}, declared {tuple(tensor.shape)}",
        )
    if not all_finite(array):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {tensor.name!r} has non-finite values")
    return without_subnormals(array)


def all_finite(array: np.ndarray) -> bool:
    """No NaN or inf. For real floats, min and max (NaN propagates) avoid a payload-sized bool temporary."""
    if array.size == 0:
        return True
    if array.dtype.kind == "f":
        return bool(np.isfinite(array.min()) and np.isfinite(array.max()))
    return bool(np.isfinite(array).all())


def without_subnormals(array: np.ndarray) -> np.ndarray:
    """``array`` itself when no float32 value is subnormal, else a read-only copy with those values set to zero.

    Scanned in blocks on the bit patterns (0 < |bits| < the smallest normal's), so the scan costs a fraction of
    the digest and no payload-sized temporary. Other dtypes pass unchanged: a float16 tensor's small values are
    legitimately subnormal, and the coordinator's tensors are float32.
    """
    if array.dtype != np.float32 or array.size == 0:
        return array
    bits = np.ascontiguousarray(array).reshape(-1).view(np.uint32)
    scratch = np.empty(min(bits.size, _SUBNORMAL_STEP), np.uint32)
    for start in range(0, bits.size, _SUBNORMAL_STEP):
        block = bits[start : start + _SUBNORMAL_STEP]
        tmp = scratch[: block.size]
        np.bitwise_and(block, 0x7FFFFFFF, out=tmp)
        np.subtract(tmp, 1, out=tmp)  # 0 wraps around: only 1 .. 0x7FFFFF (the subnormals) fall below
        if (tmp < 0x7FFFFF).any():
            flushed = np.where(np.abs(array) < _F32_TINY, np.float32(0), array)
            flushed.flags.writeable = False
            return flushed
    return array
