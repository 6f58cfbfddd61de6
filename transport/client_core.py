"""What every client transport does the same way: chunk and shape pushes, receive and check pulls, retry.

Shared by the gRPC client and the in-process transport so both move exactly the same chunks through the same
checks. The link shaper (``transport.shaper.LinkShaper``) is charged once per RPC (`start_message`) and once
per chunk (`transmit`: "up" for push chunks, "down" for pull chunks); its ``LinkDown`` becomes UNAVAILABLE,
which is retried. Retries use tenacity at this RPC boundary only: exponential backoff with full jitter,
attempts and deadlines from `TransportConfig`, and only for codes in ``RETRYABLE_CODES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import tenacity

from transport import diloco_pb2 as pb
from transport.chunking import Reassembler, build_header, check_header, iter_trailed_views
from transport.config import TransportConfig
from transport.errors import Rejected, TransportError
from transport.handler import PB_TO_KIND, PullPayload
from transport.tensors import EncodedTensorLike, known_codecs, payload_nbytes
from transport.wire import PUSH_DATA_FIELD, encode_data_chunk, parse_pull_chunk

T = TypeVar("T")

try:  # the shaper is optional for the wire; LinkDown is a ConnectionError either way
    from transport.shaper import LinkDown
except ImportError:  # pragma: no cover - shaper ships with the package
    LinkDown = ConnectionError  # type: ignore[misc,assignment]


def link_down_error(e: BaseException) -> TransportError:
    """``LinkDown`` as the gRPC status a real network would give."""
    return TransportError(grpc.StatusCode.UNAVAILABLE, f"link down: {e}")


def push_chunks(
    meta: pb.PushMeta, tensors: Sequence[EncodedTensorLike], chunk_bytes: int, shaper: Any | None = None
) -> Iterator[pb.PushChunk]:
    """The chunks of one push as messages: meta + header on the first, the digest trailer on the last; each
    pays its link time first."""
    header = build_header(tensors, chunk_bytes)
    for i, (pieces, digest) in enumerate(iter_trailed_views(tensors, chunk_bytes)):
        data = b"".join(pieces)
        if shaper is not None:
            shaper.transmit(len(data), "up")
        if i == 0:
            yield pb.PushChunk(index=0, meta=meta, header=header, data=data, digest=digest)
        else:
            yield pb.PushChunk(index=i, data=data, digest=digest)


def push_wire_chunks(
    meta: pb.PushMeta,
    tensors: Sequence[EncodedTensorLike],
    chunk_bytes: int,
    shaper: Any | None = None,
    header: pb.PayloadHeader | None = None,
) -> Iterator[pb.PushChunk | bytes]:
    """Same chunks as `push_chunks`, but every chunk after the first already serialized (one copy each).

    The payload is hashed chunk by chunk as the chunks are pulled by the wire (``iter_trailed_views``), so
    the first byte goes out at once. ``header`` (from `build_header`) may be passed to reuse it across retries.
    """
    header = header if header is not None else build_header(tensors, chunk_bytes)
    for i, (pieces, digest) in enumerate(iter_trailed_views(tensors, chunk_bytes)):
        if shaper is not None:
            shaper.transmit(sum(p.nbytes for p in pieces), "up")
        if i == 0:
            yield pb.PushChunk(index=0, meta=meta, header=header, data=b"".join(pieces), digest=digest)
        else:
            yield encode_data_chunk(PUSH_DATA_FIELD, i, *pieces, digest=digest)


def receive_pull(chunks: Iterable[Any], config: TransportConfig, shaper: Any | None = None) -> PullPayload:
    """Reassemble a pull stream with the same checks the server applies to pushes.

    Items are parsed chunks, or serialized ones (``bytes``, from the in-process transport).
    """
    it = (parse_pull_chunk(c) if isinstance(c, bytes) else c for c in chunks)
    first = next(it, None)
    if first is None or not first.HasField("header"):
        raise Rejected(grpc.StatusCode.DATA_LOSS, "pull stream without a header")
    header = first.header
    check_header(header.payload, config.max_payload_bytes, config.max_tensors, known_codecs())
    buf = Reassembler(header.payload, config.max_payload_bytes, config.max_tensors, known_codecs())
    if header.kind not in PB_TO_KIND:
        raise Rejected(grpc.StatusCode.DATA_LOSS, f"unknown pull kind {header.kind}")
    chunk: pb.PullChunk | None = first
    while chunk is not None:
        if shaper is not None:
            shaper.transmit(len(chunk.data), "down")
        if chunk is not first and chunk.HasField("header"):
            raise Rejected(grpc.StatusCode.DATA_LOSS, f"pull chunk {chunk.index} repeats the header")
        buf.add(chunk.index, chunk.data, chunk.digest)
        chunk = next(it, None)
    tensors = buf.finish()
    return PullPayload(
        round=header.round,
        fragment=header.fragment,
        kind=PB_TO_KIND[header.kind],
        param_digest=bytes(header.param_digest),
        tensors=tensors,
    )


def push_size(tensors: Sequence[EncodedTensorLike]) -> int:
    """Payload bytes of a push (for its deadline); no digest, so it costs nothing."""
    return sum(payload_nbytes(t) for t in tensors)


def with_retries(config: TransportConfig, attempt: Callable[[], T], sleep: Callable[[float], None] | None = None) -> T:
    """Run ``attempt`` until it succeeds, fails with a non-retryable code, or attempts run out."""
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(config.max_attempts),
        wait=tenacity.wait_random_exponential(multiplier=config.backoff_initial_s, max=config.backoff_max_s),
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, TransportError) and e.retryable),
        reraise=True,
        **({"sleep": sleep} if sleep is not None else {}),
    )
    try:
        return retrying(attempt)
    except TransportError as e:
        e.attempts = int(retrying.statistics.get("attempt_number", 1))
        raise
