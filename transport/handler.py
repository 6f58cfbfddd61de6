"""The interface between the wire and the coordinator.

The transport owns bytes, credentials, limits and validation; the coordinator owns rounds and θ. It plugs
into the server (gRPC or in-process) by implementing `CoordinatorHandler`. The handler is only ever called
with messages that passed every check in `transport.validate`, from an island the service knows (one of its
``islands``, authenticated when secrets are set); it may still refuse one by raising
`transport.errors.Rejected(code, reason)`, which becomes a gRPC status and an ``on_rejected`` callback (a
`RejectionSink`). Any other exception it raises is answered INTERNAL with a generic reason and logged by the
service; it never reaches the client and never stops the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb

PullKindName = Literal["update", "full"]

RejectionSink = Callable[[str, str], None]
"""``on_rejected(island, "CODE: reason")``: called once per refused call. Both strings came over the wire in part,
so the service bounds them (island 64, reason about 200 characters) and escapes control characters; a flood of
hostile calls calls it once each, so a sink that writes them somewhere should rate-limit itself."""


class SharedStream(Protocol):
    """The serialized chunks of one pull payload, made once for every pull that sends them
    (`transport.service.SharedPull`)."""

    def stream(self, key: bytes, make: Callable[[], Iterator[pb.PullChunk | bytes]]) -> Iterator[pb.PullChunk | bytes]:
        """The chunks of the payload whose header serializes to ``key``; ``make`` makes them (once)."""
        ...


KIND_TO_PB: dict[str, int] = {"update": pb.PULL_KIND_UPDATE, "full": pb.PULL_KIND_FULL}
PB_TO_KIND: dict[int, PullKindName] = {pb.PULL_KIND_UPDATE: "update", pb.PULL_KIND_FULL: "full"}


@dataclass(frozen=True)
class PullPayload:
    """What a pull returns: the committed update û of a round, or the full global params.

    ``round`` is the round the island reaches after applying it; ``param_digest`` is the digest of the global
    parameters at that round, so the island can check it is bit-identical to the coordinator.
    """

    round: int
    fragment: int
    kind: PullKindName
    param_digest: bytes
    tensors: Sequence[EncodedTensor]
    shared: SharedStream | None = None
    """The serialized stream of these tensors, made once for every pull that sends them (one per commit;
    `transport.service.SharedPull`), or None to make it for this pull alone."""
    on_done: Callable[[], None] | None = None
    """Called by the transport once the pull's stream is over: its last chunk handed to the wire, or the stream
    failed or was cancelled (never for a stream that did not start)."""


class CoordinatorHandler(Protocol):
    """Implemented by the coordinator; called by the service after the wire-level checks passed."""

    def join(self, req: pb.JoinRequest) -> pb.JoinReply:
        """An island (re)joins: tell it the round and whether it needs the full parameters."""
        ...

    def heartbeat(self, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Renew the island's lease; reply with the current round and state."""
        ...

    def leave(self, req: pb.LeaveRequest) -> pb.LeaveReply:
        """The island leaves cleanly."""
        ...

    def lease(self, req: pb.LeaseRequest) -> pb.LeaseReply:
        """The spans of the corpus's chunks the island reads next (data.sampling = "chunks"), or `Rejected` (not
        that sampling, a count out of bounds, not a member)."""
        ...

    def attend(self, req: pb.AttendRequest) -> pb.AttendReply:
        """The island opened its presence call (transport/presence.py): it is heard from, as by a heartbeat. A reply
        with ``member`` false (not a member now: join first) ends the call at once."""
        ...

    def absent(self, island: str) -> None:
        """The island's presence call broke: its process, host or link is gone, unless it is heard from again soon
        (a newer call, a heartbeat). Called on a server thread; an island that is no member is ignored."""
        ...

    def admissible(self, meta: pb.PushMeta) -> None:
        """A push's first chunk passed the wire's checks: refuse it (`Rejected`) now, before its payload is buffered,
        when its round is not one the handler takes. A retry of a push the handler accepted must pass, so that
        `push` can answer it as before, however far the rounds moved on."""
        ...

    def receiving(self, meta: pb.PushMeta) -> AbstractContextManager[None]:
        """Held while a push whose first chunk passed every check streams in and is handed to `push` (or fails):
        the coordinator holds a pull of that island for that sync until it is through, instead of answering "push
        first" (an island asks for the commit as soon as its push is on the wire). A handler that does not care
        returns ``contextlib.nullcontext()``."""
        ...

    def push(
        self, meta: pb.PushMeta, tensors: Sequence[EncodedTensor], arrays: dict[str, np.ndarray], payload_digest: bytes
    ) -> pb.PushReply:
        """A validated pseudo-gradient: encoded tensors, their decoded, finite arrays, and the SHA-256 of the
        concatenated payloads (`transport.chunking.payload_digest`), checked against the bytes as they arrived.

        The handler owns idempotency: a push is keyed by (island, round, fragment); a retried duplicate (same
        payload digest) of an accepted push gets the same reply and changes nothing, another payload under an
        accepted key is ALREADY_EXISTS (diloco/coordinator/push_admission.py).

        The arrays are read-only (fp32 ones are zero-copy views of the receive buffer): copy before
        modifying in place. Both stay valid after the call; keep only what you need.
        """
        ...

    def pull(self, req: pb.PullRequest) -> PullPayload:
        """The committed update of a round, or the full params (new or lagging island)."""
        ...

    def status(self) -> pb.StatusReply:
        """A snapshot for `diloco status`."""
        ...

    def admit(self, req: pb.AdmitRequest) -> pb.AdmitReply:
        """The operator admits an island (its secret's SHA-256) into the live run, durably, or `Rejected` says why."""
        ...

    def retire(self, req: pb.RetireRequest, by: str) -> pb.RetireReply:
        """Retire an island for good (``by``: the operator, or the island itself): it stops counting at once and its
        credentials are refused from then on."""
        ...
