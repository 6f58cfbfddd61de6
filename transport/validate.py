"""Validation before state: every check a message must pass before the coordinator's handler sees it.

The fault model (docs/architecture.md) promises that malformed, oversized, NaN or forged pseudo-gradients are
rejected with a reason and never touch θ. The checks here are pure functions that raise `Rejected(code, reason)`;
the service runs them in order (identity, run id, round, tensor specs, then after the bytes arrived: digest, decode,
finiteness) and only then calls the handler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import grpc
import numpy as np

from transport import diloco_pb2 as pb
from transport.errors import Rejected

if TYPE_CHECKING:  # transport.codecs imports JAX; the wire only needs its type
    from transport.codecs import EncodedTensor

TensorSpec = tuple[tuple[int, ...], str]
"""Expected (shape, decoded dtype) of one tensor."""

ModelSpec = Mapping[str, TensorSpec] | Callable[[int], Mapping[str, TensorSpec]]
"""The tensors a push must carry: one mapping for every fragment, or ``fragment -> mapping``."""


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


def check_push_meta(meta: pb.PushMeta) -> None:
    """Fields of a push that must make sense on their own."""
    if meta.tokens == 0:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "tokens must be > 0 (it is the aggregation weight)")


def spec_for(spec: ModelSpec, fragment: int) -> Mapping[str, TensorSpec]:
    """The expected tensors of ``fragment``."""
    if callable(spec):
        try:
            return spec(fragment)
        except (KeyError, IndexError, ValueError):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fragment {fragment}") from None
    return spec


def check_tensor_metas(metas: Sequence[pb.TensorMeta], expected: Mapping[str, TensorSpec]) -> None:
    """Names, shapes and dtypes exactly as the model spec says; nothing missing, nothing extra."""
    names = [m.name for m in metas]
    missing = sorted(set(expected) - set(names))
    if missing:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"missing tensors: {', '.join(missing[:5])}")
    for m in metas:
        if m.name not in expected:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected tensor {m.name!r}")
        shape, dtype = expected[m.name]
        if tuple(m.shape) != tuple(shape):
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {m.name!r}: shape {tuple(m.shape)} != expected {tuple(shape)}",
            )
        want = dtype if isinstance(dtype, str) else str(np.dtype(dtype))
        if m.dtype != want:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"tensor {m.name!r}: dtype {m.dtype!r} != expected {want!r}"
            )


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
    return array


def all_finite(array: np.ndarray) -> bool:
    """No NaN or inf. For real floats, min and max (NaN propagates) avoid a payload-sized bool temporary."""
    if array.size == 0:
        return True
    if array.dtype.kind == "f":
        return bool(np.isfinite(array.min()) and np.isfinite(array.max()))
    return bool(np.isfinite(array).all())
