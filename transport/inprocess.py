"""In-process transport: the gRPC client's API, calling a `DilocoService` directly.

Used by ``diloco simulate`` and fast tests so the same coordinator and island code runs in one process. It
still builds the same chunks (header, ~1 MiB pieces, digest trailer), runs them through the same service checks
(credentials, validation, reassembly, idempotency), charges the same link shaper per message and per chunk,
and retries the same way; only the sockets and protobuf serialisation are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from transport import diloco_pb2 as pb
from transport.auth import call_metadata
from transport.chunking import build_header
from transport.client_core import LinkDown, link_down_error, push_wire_chunks, receive_pull, with_retries
from transport.config import TransportConfig
from transport.errors import Rejected, TransportError
from transport.handler import PullPayload
from transport.service import DilocoService
from transport.tensors import EncodedTensorLike
from transport.wire import parse_push_chunk

T = TypeVar("T")


class InProcessTransport:
    """Same API as `transport.grpc_client.GrpcTransport`, no sockets."""

    def __init__(
        self,
        service: DilocoService,
        island: str,
        secret: str | None = None,
        *,
        config: TransportConfig | None = None,
        shaper: Any | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.service = service
        self.island = island
        self.config = config or service.config
        self.shaper = shaper
        self._sleep = sleep
        self._metadata = call_metadata(island, secret)

    def close(self) -> None:
        """Nothing to release; for API parity."""

    def __enter__(self) -> InProcessTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[], T]) -> T:
        def once() -> T:
            try:
                if self.shaper is not None:
                    self.shaper.start_message("up")
                return fn()
            except LinkDown as e:
                raise link_down_error(e) from None
            except Rejected as e:
                raise TransportError(e.code, e.reason) from None

        return with_retries(self.config, once, self._sleep)

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        """Join the run."""
        return self._call(lambda: self.service.join(self._metadata, req))

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Renew the lease."""
        return self._call(lambda: self.service.heartbeat(self._metadata, req))

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        """Leave the run."""
        return self._call(lambda: self.service.leave(self._metadata, req))

    def status(self) -> pb.StatusReply:
        """Coordinator status."""
        return self._call(lambda: self.service.status(self._metadata))

    def push(self, meta: pb.PushMeta, tensors: Sequence[EncodedTensorLike]) -> pb.PushReply:
        """Push a pseudo-gradient through the same chunking and checks as over gRPC."""

        header = build_header(tensors, self.config.chunk_bytes)  # metas only; the digest is hashed as it streams

        def send() -> pb.PushReply:
            wire = push_wire_chunks(meta, tensors, self.config.chunk_bytes, self.shaper, header)
            # The same serialized chunks a gRPC push sends, parsed by the same parser the server uses.
            return self.service.push(self._metadata, (parse_push_chunk(c) if isinstance(c, bytes) else c for c in wire))

        return self._call(send)

    def pull(self, req: pb.PullRequest) -> PullPayload:
        """Pull the committed update (or full params) through the same chunking and checks."""
        return self._call(lambda: receive_pull(self.service.pull(self._metadata, req), self.config, self.shaper))
