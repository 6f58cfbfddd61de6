"""In-process transport: an ``IslandClient`` that calls a `DilocoService` directly, no sockets.

For tests (``tests/test_grpc_transport.py`` runs every client test against it and against gRPC) and any
caller that wants a coordinator in its own process. It still builds the same chunks (header, ~1 MiB pieces,
digest trailer, data chunks serialized and parsed by the same hand-rolled codec), runs them through the same
service checks (credentials, validation, reassembly, idempotency), charges the same link shaper per message and
per chunk, and retries and maps failures the same way (``transport.client_core``); only sockets and gRPC
framing are skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Unpack

from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.client import IN_PROCESS_TARGET, NOT_A_MEMBER
from transport.client_core import ClientOptions, RetryingClient, receive_pull
from transport.errors import Rejected
from transport.handler import PullPayload
from transport.service import DilocoService, Metadata
from transport.wire import parse_push_chunk


class InProcessTransport(RetryingClient):
    """``IslandClient`` calling ``service`` in this process; ``target`` is ``"in-process"``."""

    def __init__(
        self, service: DilocoService, island: str, secret: str | None = None, **options: Unpack[ClientOptions]
    ) -> None:
        """A client of ``service`` for ``island``; `ClientOptions` for the rest (config defaults to the service's)."""
        super().__init__(IN_PROCESS_TARGET, island, secret, options, default_config=service.config)
        self.service = service

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        """See ``IslandClient.join``."""
        return self._retried(lambda: self.service.join(self._metadata, req))

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """See ``IslandClient.heartbeat``."""
        return self._retried(lambda: self.service.heartbeat(self._metadata, req))

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        """See ``IslandClient.leave``."""
        return self._retried(lambda: self.service.leave(self._metadata, req))

    def status(self) -> pb.StatusReply:
        """See ``IslandClient.status``."""
        return self._retried(lambda: self.service.status(self._metadata))

    def lease(self, req: pb.LeaseRequest) -> pb.LeaseReply:
        """See ``IslandClient.lease``."""
        return self._retried(lambda: self.service.lease(self._metadata, req))

    def attend(self, req: pb.AttendRequest) -> _InProcessPresence:
        """See ``IslandClient.attend``: the same registration with the service; the call ends when it is closed
        or a newer one of the island replaces it."""
        return _InProcessPresence(self.service, self._metadata, req)

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], on_sent: Callable[[], None] | None = None
    ) -> pb.PushReply:
        """Push a pseudo-gradient through the same chunking and checks as over gRPC."""
        stream = self._push_stream(meta, tensors, on_sent)
        # The same serialized chunks a gRPC push sends, parsed by the same parser the server uses.
        return self._retried(
            lambda: self.service.push(
                self._metadata, (parse_push_chunk(c) if isinstance(c, bytes) else c for c in stream())
            )
        )

    def pull(self, req: pb.PullRequest) -> PullPayload:
        """Pull the committed update (or full params) through the same chunking and checks."""
        return self._retried(
            lambda: receive_pull(self.service.pull(self._metadata, req), self.config, self.shaper),
            behind_push=req.after_push,
        )


class _InProcessPresence:
    """A presence call to a service in this process (`transport.client.Presence`): open while `wait` runs."""

    def __init__(self, service: DilocoService, metadata: Metadata, req: pb.AttendRequest) -> None:
        self._service = service
        self._metadata = metadata
        self._req = req
        self._closed = threading.Event()

    def wait(self) -> str:
        """See ``Presence.wait``."""
        try:
            with self._service.attending(self._metadata, self._req, self._closed.set) as reply:
                if not reply.member:
                    return NOT_A_MEMBER
                self._closed.wait()
        except Rejected as e:
            return f"{e.code.name}: {e.reason}"
        return "closed"

    def close(self) -> None:
        """See ``Presence.close``."""
        self._closed.set()
