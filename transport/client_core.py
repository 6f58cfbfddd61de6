"""What both island clients do the same way: one attempt, one mapping of failures, retries, chunks, pulls.

``transport.grpc_client.GrpcTransport`` and ``transport.inprocess.InProcessTransport`` implement the same
``transport.client.IslandClient`` and differ only in how one attempt reaches a ``DilocoService`` (a gRPC
channel, or a direct call). Everything else lives here once, so both move exactly the same chunks through the
same checks and fail the same way:

* **One attempt** (`call_once`): charge the link shaper's one-way latency of the request (up) and of its reply
  (down, once the reply is in: a lost reply is an UNAVAILABLE call too), run the call, and map every failure to
  ``TransportError``: the shaper's ``LinkDown`` becomes UNAVAILABLE (what a real network would give, so it is
  retried; a push retried after its reply was lost gets the same reply again, `DilocoService`), a ``Rejected``
  from the service keeps its code and reason, and a ``grpc.RpcError`` keeps its status (it only occurs over
  gRPC). This is the only place failures are mapped.
* **Retries** (`with_retries`): tenacity at this RPC boundary only, exponential backoff with full jitter,
  attempts and deadlines from ``TransportConfig``, and only for codes in ``RETRYABLE_CODES``.
* **Pushes** (`push_wire_chunks`): ~1 MiB chunks, meta + header on the first, the digest trailer on the last;
  each chunk pays its link time ("up") before it goes.
* **Pulls** (`receive_pull`): reassembled with the checks the server applies to pushes; each chunk pays its
  link time ("down") as it arrives.

`RetryingClient` bundles the state both clients hold (island, credentials, config, shaper) and the
attempt-plus-retries wrapper; each subclass adds its constructor and its six calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, Self, TypedDict, TypeVar

import grpc
import tenacity

from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.auth import call_metadata
from transport.chunking import (
    ONE_OFF_BUFFERS,
    RECEIVE_BUFFERS,
    Reassembler,
    build_header,
    check_header,
    iter_trailed_views,
)
from transport.config import TransportConfig
from transport.errors import Rejected, TransportError
from transport.handler import PB_TO_KIND, PullPayload
from transport.shaper import Direction, LinkDown
from transport.tensors import known_codecs, payload_nbytes
from transport.wire import PUSH_DATA_FIELD, encode_data_chunk, parse_pull_chunk

T = TypeVar("T")

Sleep = Callable[[float], None]
"""How a client waits between retries (``time.sleep`` unless a test passes a recorder)."""


class ShaperLike(Protocol):
    """What a client needs from a link shaper (``transport.shaper.LinkShaper`` or a test double).

    Both calls block for the simulated link time and raise ``LinkDown`` while the link is down.
    """

    def start_message(self, direction: Direction) -> None:
        """Pay the one-way latency of one message (twice per RPC attempt: its request up, its reply down)."""
        ...

    def transmit(self, nbytes: int, direction: Direction) -> None:
        """Pay the bandwidth of ``nbytes`` payload bytes (once per chunk)."""
        ...


class ClientOptions(TypedDict, total=False):
    """The keyword options both island clients take (``GrpcTransport``, ``InProcessTransport``), said once."""

    config: TransportConfig | None
    """Deadlines, retries, chunk size and limits; None is the client's default (``TransportConfig()`` over gRPC,
    the service's own config in-process)."""
    shaper: ShaperLike | None
    """Link shaper charged per message and per chunk, to make the link behave like a WAN one; None: unshaped."""
    sleep: Sleep | None
    """How to wait between retries; None is ``time.sleep`` (tests pass a recorder to see the backoff)."""


def call_once(shaper: ShaperLike | None, fn: Callable[[], T], request_latency: bool = True) -> T:
    """One attempt of an RPC, whose every failure comes out as a ``TransportError`` that `with_retries` judges.

    ``request_latency=False``: the request rides right behind a push's last bytes on the same link (a pull with
    ``after_push``), so it arrives with them. The shaper charges a message's one-way latency before its bytes go,
    so the push's latency already covers the request's: charging it again would make the request arrive one
    latency after the push, which no real link does.

    The single mapping of failures for both clients: ``LinkDown`` -> UNAVAILABLE (retryable, like a real
    network outage), ``Rejected`` -> its own code and reason, ``grpc.RpcError`` -> its status and details.
    """
    try:
        if shaper is not None and request_latency:
            shaper.start_message("up")
        result = fn()
        if shaper is not None:  # the reply crosses the link too: an RPC costs a round trip, not half of one
            shaper.start_message("down")
        return result
    except LinkDown as e:
        raise TransportError(grpc.StatusCode.UNAVAILABLE, f"link down: {e}") from None
    except Rejected as e:
        raise TransportError(e.code, e.reason) from None
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        raise TransportError(code, details or "") from None


def with_retries(config: TransportConfig, attempt: Callable[[], T], sleep: Sleep | None = None) -> T:
    """Run ``attempt`` until it succeeds, fails with a non-retryable code, or attempts run out.

    The final ``TransportError`` records how many attempts were made (``attempts``).
    """
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


class RetryingClient:
    """The part of an island client that does not depend on how bytes reach the service.

    Holds what every call needs (``target``, ``island``, credentials as call metadata, and the `ClientOptions`:
    ``config``, the optional ``shaper``, the retry ``sleep``) and runs each call as attempts of `call_once`
    under `with_retries`. Subclasses implement the ``IslandClient`` calls with `_retried` and `_push_stream`;
    ``close`` releases nothing unless a subclass holds something (a channel).
    """

    def __init__(
        self, target: str, island: str, secret: str | None, options: ClientOptions, default_config: TransportConfig
    ) -> None:
        self.target = target
        self.island = island
        self.config = options.get("config") or default_config
        self.shaper = options.get("shaper")
        self._sleep = options.get("sleep")
        self._metadata = call_metadata(island, secret)

    def _retried(self, fn: Callable[[], T], behind_push: bool = False) -> T:
        """``fn`` as one RPC: attempts of `call_once` (shaper charge + failure mapping), retried. ``behind_push``:
        the first attempt rides behind a push's bytes (`call_once`'s ``request_latency``); a retry goes later."""
        attempts = 0

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            return call_once(self.shaper, fn, request_latency=not (behind_push and attempts == 1))

        return with_retries(self.config, attempt, self._sleep)

    def _push_stream(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], on_sent: Callable[[], None] | None = None
    ) -> Callable[[], Iterator[pb.PushChunk | bytes]]:
        """A fresh chunk stream per attempt; the header (metas only, no digest) is built once for all of them."""
        header = build_header(tensors, self.config.chunk_bytes)
        return lambda: push_wire_chunks(meta, tensors, self.config.chunk_bytes, self.shaper, header, on_sent)

    def close(self) -> None:
        """Nothing to release here; a subclass that holds a channel closes it."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def push_wire_chunks(
    meta: pb.PushMeta,
    tensors: Sequence[EncodedTensor],
    chunk_bytes: int,
    shaper: ShaperLike | None = None,
    header: pb.PayloadHeader | None = None,
    on_sent: Callable[[], None] | None = None,
) -> Iterator[pb.PushChunk | bytes]:
    """The chunks of one push: the first a message (meta + header), every later one already serialized; once the
    transport has taken the last one (it asks for the next), ``on_sent`` is called.

    Serializing the data chunks by hand (``transport.wire``) costs one copy each instead of protobuf's three.
    The payload is hashed chunk by chunk as the wire pulls them (``iter_trailed_views``), so the first byte goes
    out at once and the digest rides on the last chunk. ``header`` (from `build_header`) may be passed to reuse
    it across retries.
    """
    header = header if header is not None else build_header(tensors, chunk_bytes)
    for i, (pieces, digest) in enumerate(iter_trailed_views(tensors, chunk_bytes)):
        if shaper is not None:
            shaper.transmit(sum(p.nbytes for p in pieces), "up")
        if i == 0:
            yield pb.PushChunk(index=0, meta=meta, header=header, data=b"".join(pieces), digest=digest)
        else:
            yield encode_data_chunk(PUSH_DATA_FIELD, i, *pieces, digest=digest)
    if on_sent is not None:
        on_sent()


def receive_pull(
    chunks: Iterable[pb.PullChunk | bytes], config: TransportConfig, shaper: ShaperLike | None = None
) -> PullPayload:
    """Reassemble a pull stream with the same checks the server applies to pushes.

    Items are parsed chunks, or serialized ones (``bytes``, as the in-process service yields them).
    """
    it = (parse_pull_chunk(c) if isinstance(c, bytes) else c for c in chunks)
    first = next(it, None)
    if first is None or not first.HasField("header"):
        raise Rejected(grpc.StatusCode.DATA_LOSS, "pull stream without a header")
    header = first.header
    check_header(header.payload, config.max_payload_bytes, config.max_tensors, known_codecs())
    if header.kind not in PB_TO_KIND:
        raise Rejected(grpc.StatusCode.DATA_LOSS, f"unknown pull kind {header.kind}")
    pool = ONE_OFF_BUFFERS if PB_TO_KIND[header.kind] == "full" else RECEIVE_BUFFERS
    buf = Reassembler(header.payload, config.max_payload_bytes, config.max_tensors, known_codecs(), pool)
    chunk: pb.PullChunk | None = first
    try:
        while chunk is not None:
            if shaper is not None:
                shaper.transmit(len(chunk.data), "down")
            if chunk is not first and chunk.HasField("header"):
                raise Rejected(grpc.StatusCode.DATA_LOSS, f"pull chunk {chunk.index} repeats the header")
            buf.add(chunk.index, chunk.data, chunk.digest)
            chunk = next(it, None)
        tensors = buf.finish()
    finally:
        buf.close()  # a stream that failed gives its buffer and its hashing thread up at once
    return PullPayload(
        round=header.round,
        fragment=header.fragment,
        kind=PB_TO_KIND[header.kind],
        param_digest=bytes(header.param_digest),
        tensors=tensors,
    )


def push_size(tensors: Sequence[EncodedTensor]) -> int:
    """Payload bytes of a push (for its deadline); no digest, so it costs nothing."""
    return sum(payload_nbytes(t) for t in tensors)
