"""gRPC client for the diloco.v1 protocol (used by an island to talk to the coordinator).

Every RPC carries the island's credentials as metadata, has a deadline from `TransportConfig` (streams get
extra time proportional to their size), is retried with backoff on retryable codes only, and fails for good
with a `TransportError(code, reason)`. Pushes are streamed as ~1 MiB chunks through the optional link shaper.
All RPCs are idempotent on the server, which is what makes the retries safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from transport import diloco_pb2 as pb
from transport import diloco_pb2_grpc as pb_grpc
from transport.auth import TlsConfig, call_metadata
from transport.chunking import build_header
from transport.client_core import (
    LinkDown,
    link_down_error,
    push_size,
    push_wire_chunks,
    receive_pull,
    with_retries,
)
from transport.config import TransportConfig
from transport.errors import Rejected, TransportError
from transport.handler import PullPayload
from transport.tensors import EncodedTensorLike
from transport.wire import parse_pull_chunk, serialize_chunk

T = TypeVar("T")


class GrpcTransport:
    """Client side of the diloco.v1 service over one gRPC channel. Thread-safe."""

    def __init__(
        self,
        target: str,
        island: str,
        secret: str | None = None,
        *,
        config: TransportConfig | None = None,
        tls: TlsConfig | None = None,
        shaper: Any | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.target = target
        self.island = island
        self.config = config or TransportConfig()
        self.shaper = shaper
        self._sleep = sleep
        self._metadata = call_metadata(island, secret)
        options = self.config.grpc_options()
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(
                target, tls.channel_credentials(), options=options + tls.channel_options()
            )
        self._stub = pb_grpc.DilocoStub(self._channel)
        # The two streaming RPCs use the chunk fast path (pre-serialized / zero-copy parsed data chunks).
        self._push_call = self._channel.stream_unary(
            "/diloco.v1.Diloco/PushPseudoGrad",
            request_serializer=serialize_chunk,
            response_deserializer=pb.PushReply.FromString,
        )
        self._pull_call = self._channel.unary_stream(
            "/diloco.v1.Diloco/PullGlobal",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=parse_pull_chunk,
        )

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> GrpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------------------

    def _attempt(self, fn: Callable[[], T]) -> T:
        try:
            if self.shaper is not None:
                self.shaper.start_message("up")
            return fn()
        except LinkDown as e:
            raise link_down_error(e) from None
        except Rejected as e:
            raise TransportError(e.code, e.reason) from None
        except grpc.RpcError as e:
            raise TransportError(e.code(), e.details() or "") from None

    def _unary(self, method: Callable[..., T], request: Any) -> T:
        return with_retries(
            self.config,
            lambda: self._attempt(lambda: method(request, timeout=self.config.rpc_timeout_s, metadata=self._metadata)),
            self._sleep,
        )

    # -- API ------------------------------------------------------------------------------------------

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        """Join the run."""
        return self._unary(self._stub.Join, req)

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Renew the lease."""
        return self._unary(self._stub.Heartbeat, req)

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        """Leave the run."""
        return self._unary(self._stub.Leave, req)

    def status(self) -> pb.StatusReply:
        """Coordinator status."""
        return self._unary(self._stub.Status, pb.StatusRequest())

    def push(self, meta: pb.PushMeta, tensors: Sequence[EncodedTensorLike]) -> pb.PushReply:
        """Stream one pseudo-gradient; retried pushes are deduplicated by the server."""
        timeout = self.config.stream_deadline_s(push_size(tensors))
        header = build_header(tensors, self.config.chunk_bytes)  # metas only; the digest is hashed as it streams

        def once() -> pb.PushReply:
            link_failure: list[BaseException] = []
            call_ready = threading.Event()
            call: list[grpc.Future] = []

            def chunks() -> Iterator[pb.PushChunk | bytes]:
                try:
                    yield from push_wire_chunks(meta, tensors, self.config.chunk_bytes, self.shaper, header)
                except LinkDown as e:
                    # Runs in gRPC's sending thread. Cancel (RST) before this iterator ends, so the server
                    # sees a cancelled call rather than a truncated stream it would report as malformed.
                    link_failure.append(e)
                    call_ready.wait(self.config.rpc_timeout_s)
                    if call:
                        call[0].cancel()
                    raise

            future = self._push_call.future(chunks(), timeout=timeout, metadata=self._metadata)
            call.append(future)
            call_ready.set()
            try:
                return future.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                if link_failure:
                    raise LinkDown(str(link_failure[0])) from None
                raise

        return with_retries(self.config, lambda: self._attempt(once), self._sleep)

    def pull(self, req: pb.PullRequest) -> PullPayload:
        """Receive the committed update (or full params) as chunks, checked like a push."""
        timeout = self.config.stream_deadline_s(self.config.max_payload_bytes)

        def once() -> PullPayload:
            call = self._pull_call(req, timeout=timeout, metadata=self._metadata)
            try:
                return receive_pull(call, self.config, self.shaper)
            except BaseException:
                call.cancel()
                raise

        return with_retries(self.config, lambda: self._attempt(once), self._sleep)
