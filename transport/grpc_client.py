"""gRPC client for the diloco.v1 protocol: an island's ``IslandClient`` to a coordinator in another process.

Every RPC carries the island's credentials as metadata, has a deadline from `TransportConfig` (streams get
extra time proportional to their size), is retried with backoff on retryable codes only, and fails for good
with a `TransportError(code, reason)` (``transport.client_core``, shared with the in-process transport). The
two streaming RPCs take the chunk fast path: push data chunks go out pre-serialized, pull data chunks are
parsed zero-copy (``transport.wire``). All RPCs are idempotent on the server, which is what makes the retries
safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport import diloco_pb2_grpc as pb_grpc
from transport.auth import TlsConfig
from transport.client import NOT_A_MEMBER
from transport.client_core import ClientOptions, RetryingClient, push_size, receive_pull
from transport.config import TransportConfig
from transport.errors import TransportError
from transport.handler import PullPayload
from transport.shaper import LinkDown
from transport.wire import parse_pull_chunk, serialize_chunk

T = TypeVar("T")


class GrpcTransport(RetryingClient):
    """``IslandClient`` over one gRPC channel to ``target`` (``host:port``). Thread-safe."""

    def __init__(
        self,
        target: str,
        island: str,
        secret: str | None = None,
        *,
        tls: TlsConfig | None = None,
        **options: Unpack[ClientOptions],
    ) -> None:
        """Open a channel to ``target`` (TLS when ``tls`` is given) for ``island``; `ClientOptions` for the rest."""
        super().__init__(target, island, secret, options, default_config=TransportConfig())
        channel_options = self.config.grpc_options()
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=channel_options)
        else:
            self._channel = grpc.secure_channel(
                target, tls.channel_credentials(), options=channel_options + tls.channel_options()
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

    def _unary(self, method: Callable[..., T], request: Any) -> T:
        """A unary RPC with the per-call deadline and the credentials, retried."""
        return self._retried(lambda: method(request, timeout=self.config.rpc_timeout_s, metadata=self._metadata))

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        """See ``IslandClient.join``."""
        return self._unary(self._stub.Join, req)

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """See ``IslandClient.heartbeat``."""
        return self._unary(self._stub.Heartbeat, req)

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        """See ``IslandClient.leave``."""
        return self._unary(self._stub.Leave, req)

    def status(self) -> pb.StatusReply:
        """See ``IslandClient.status``."""
        return self._unary(self._stub.Status, pb.StatusRequest())

    def lease(self, req: pb.LeaseRequest) -> pb.LeaseReply:
        """See ``IslandClient.lease``."""
        return self._unary(self._stub.Lease, req)

    def attend(self, req: pb.AttendRequest) -> _GrpcPresence:
        """See ``IslandClient.attend``: no deadline, the call lasts as long as the island runs."""
        return _GrpcPresence(self._stub.Attend(req, metadata=self._metadata))

    def health(self, service: str = "") -> str:
        """The server's standard gRPC health status (``SERVING``, ``NOT_SERVING``, ...): one attempt, no retries,
        since the answer is about this moment. A call that fails raises `TransportError` with its code."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.config.rpc_timeout_s)
        except grpc.RpcError as e:
            raise TransportError(e.code(), e.details() or "") from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], on_sent: Callable[[], None] | None = None
    ) -> pb.PushReply:
        """Stream one pseudo-gradient, with a deadline that grows with its size; retries are deduplicated."""
        timeout = self.config.stream_deadline_s(push_size(tensors))
        stream = self._push_stream(meta, tensors, on_sent)

        def once() -> pb.PushReply:
            link_failure: list[BaseException] = []
            call_ready = threading.Event()
            call: list[grpc.Future] = []

            def chunks() -> Iterator[pb.PushChunk | bytes]:
                try:
                    yield from stream()
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
                if link_failure:  # the call failed because the link did: report that, so it maps to UNAVAILABLE
                    raise LinkDown(str(link_failure[0])) from None
                raise

        return self._retried(once)

    def pull(self, req: pb.PullRequest) -> PullPayload:
        """Receive the committed update (or full params) as chunks, checked like a push."""
        timeout = self.config.stream_deadline_s(self.config.max_payload_bytes)

        def once() -> PullPayload:
            call = self._pull_call(req, timeout=timeout, metadata=self._metadata)
            try:
                return receive_pull(call, self.config, self.shaper)
            except BaseException:
                call.cancel()  # stop the server streaming the rest of a payload we refused
                raise

        return self._retried(once, behind_push=req.after_push)


class _GrpcPresence:
    """A presence call over gRPC (`transport.client.Presence`)."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def wait(self) -> str:
        """See ``Presence.wait``."""
        try:
            for reply in self._call:
                if not reply.member:
                    return NOT_A_MEMBER
            return "the coordinator ended the call"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"

    def close(self) -> None:
        """See ``Presence.close``."""
        self._call.cancel()


class OperatorClient:
    """The operator's calls to a live coordinator (`diloco admit`, `diloco retire`): one channel, the operator's
    secret (or, for an island retiring itself, the island's credentials) as call metadata, one attempt per call:
    the answer says what happened, and a repeated admission would only be told the island is already enrolled."""

    def __init__(
        self,
        target: str,
        metadata: Sequence[tuple[str, str]],
        tls: TlsConfig | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._metadata = tuple(metadata)
        self._timeout_s = timeout_s
        if tls is None:
            self._channel = grpc.insecure_channel(target)
        else:
            self._channel = grpc.secure_channel(target, tls.channel_credentials(), options=tls.channel_options())
        self._stub = pb_grpc.DilocoStub(self._channel)

    def __enter__(self) -> OperatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()

    def _call(self, method: Callable[..., T], request: Any) -> T:
        try:
            return method(request, timeout=self._timeout_s, metadata=self._metadata, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise TransportError(exc.code(), exc.details() or "no reason given") from None

    def admit(self, req: pb.AdmitRequest) -> pb.AdmitReply:
        return self._call(self._stub.Admit, req)

    def retire(self, req: pb.RetireRequest) -> pb.RetireReply:
        return self._call(self._stub.Retire, req)

    def status(self) -> pb.StatusReply:
        return self._call(self._stub.Status, pb.StatusRequest())
