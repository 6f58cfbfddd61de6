"""What an island talks to the coordinator through: the `IslandClient` protocol.

An island (``diloco.worker.island_worker``) only ever needs these nine calls, so it is written against this protocol
and not against a concrete client. Two implementations ship, and both move the same chunks through the same
service checks, shaper charges and retries (``transport.client_core``):

* ``transport.grpc_client.GrpcTransport``: over a gRPC channel to a coordinator process (``target`` is its
  ``host:port``);
* ``transport.inprocess.InProcessTransport``: calling a ``DilocoService`` in the same process, no sockets
  (``target`` is ``"in-process"``); the transport tests run every client test against both.

Every call either returns the coordinator's reply or raises ``transport.errors.TransportError`` (after
retries, with the final gRPC status code and the peer's reason); nothing else escapes, so a caller has one
failure type to handle. Every call is idempotent on the coordinator, which is what makes the retries safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.handler import PullPayload

IN_PROCESS_TARGET = "in-process"
"""The ``target`` of a client that calls the service in the same process."""
NOT_A_MEMBER = "the coordinator does not count this island a member (its lease expired, or it left): join first"
"""Why a presence call ended at once (`Presence.wait`)."""


class Presence(Protocol):
    """An island's open presence call (`IslandClient.attend`, transport/presence.py)."""

    def wait(self) -> str:
        """Block until the call ends; why it ended (`NOT_A_MEMBER`, closed, or the call's status). Never raises."""
        ...

    def close(self) -> None:
        """End the call (the island leaves; idempotent). The coordinator sees it end as a break, which a Leave
        sent before makes moot."""
        ...


@runtime_checkable
class IslandClient(Protocol):
    """One island's connection to the coordinator; every method raises only ``TransportError``.

    Runtime-checkable so the tests can assert both implementations still have every member.
    """

    target: str
    """Where the calls go, for messages: ``host:port`` over gRPC, ``"in-process"`` without sockets."""

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        """(Re)join the run: the reply says the current round and whether full parameters are needed."""
        ...

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Renew the island's lease; the reply may tell it to rejoin."""
        ...

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        """Leave the run cleanly, so the coordinator stops waiting for this island."""
        ...

    def status(self) -> pb.StatusReply:
        """A snapshot of the coordinator (membership, round, losses, bytes)."""
        ...

    def lease(self, req: pb.LeaseRequest) -> pb.LeaseReply:
        """The spans of the corpus's chunks this island reads next (data.sampling = "chunks")."""
        ...

    def attend(self, req: pb.AttendRequest) -> Presence:
        """Open this island's presence call: held for as long as the island runs, so that the coordinator notices
        at once when its process dies (and, with the server's keepalive on, when its host or link goes silent).
        Opening never blocks and never raises; the call's fate is `Presence.wait`'s."""
        ...

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], on_sent: Callable[[], None] | None = None
    ) -> pb.PushReply:
        """Send one encoded pseudo-gradient; a retried push is deduplicated by (island, round, fragment).
        ``on_sent`` is called (on the sending thread) each time an attempt has handed its last chunk to the wire:
        the island then asks for the commit without waiting for the push's reply (`IslandSync._collect`)."""
        ...

    def pull(self, req: pb.PullRequest) -> PullPayload:
        """Receive the committed update of a round, or the full parameters, checked like a push."""
        ...

    def close(self) -> None:
        """Release the connection; the client is unusable afterwards."""
        ...
