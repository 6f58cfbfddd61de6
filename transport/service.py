"""The transport-independent service: authenticate, validate, reassemble, deduplicate, then call the handler.

Both the gRPC servicer and the in-process transport run every message through this class, so the checks
(docs/architecture.md, "Errors": bad input never touches state) and the idempotency rule are the same everywhere:

* a push is keyed by (island, round, fragment); the server remembers the digest and reply of each accepted
  push, so a retried duplicate (same digest) gets the same reply without reaching the handler again, and a
  different payload for an already-accepted key is refused with ALREADY_EXISTS. The digest is the stream's
  trailer (last chunk), so a duplicate is recognised once the whole stream is in; a key already accepted
  skips the round check, so a retry after the round closed still gets its original reply;
* checks that need only the first chunk (credentials, run id, island, round, tensor specs, declared sizes)
  run before any payload byte is buffered; digest, decode and finiteness run once the bytes are in.
Every refusal is a `Rejected` (code + reason) and is reported through ``on_rejected(island, reason)``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
import numpy as np

from transport import diloco_pb2 as pb
from transport.auth import ISLAND_KEY, Authenticator
from transport.chunking import Reassembler, build_header, check_header, iter_trailed_views
from transport.config import TransportConfig
from transport.errors import Rejected
from transport.handler import KIND_TO_PB, CoordinatorHandler
from transport.tensors import decoder, known_codecs
from transport.validate import (
    ModelSpec,
    check_push_meta,
    check_round,
    check_run_and_island,
    check_tensor_metas,
    decode_one,
    spec_for,
)
from transport.wire import PULL_DATA_FIELD, encode_data_chunk

Metadata = Iterable[tuple[str, str | bytes]] | None
T = TypeVar("T")


def _claimed_island(metadata: Metadata) -> str:
    for key, value in metadata or ():
        if key == ISLAND_KEY:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return ""


class DilocoService:
    """One coordinator endpoint, independent of how bytes arrive."""

    def __init__(
        self,
        handler: CoordinatorHandler,
        run_id: str,
        model_spec: ModelSpec | None,
        *,
        authenticator: Authenticator | None = None,
        config: TransportConfig | None = None,
        on_rejected: Callable[[str, str], None] | None = None,
        max_staleness: int = 0,
        status_requires_auth: bool = False,
    ) -> None:
        self.handler = handler
        self.run_id = run_id
        self.model_spec = model_spec
        self.auth = authenticator or Authenticator(None)
        self.config = config or TransportConfig()
        self.on_rejected = on_rejected
        self.max_staleness = max_staleness
        self.status_requires_auth = status_requires_auth
        self._codecs = known_codecs()
        self._decode = decoder()
        self._accepted: OrderedDict[tuple[str, int, int], tuple[bytes, pb.PushReply]] = OrderedDict()
        # Serialises the dedup check and the handler call, so concurrent duplicates are applied once.
        self._commit_lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------------------

    def _guard(self, metadata: Metadata, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Rejected as e:
            if self.on_rejected is not None:
                self.on_rejected(_claimed_island(metadata), str(e))
            raise

    def _identify(self, metadata: Metadata, run_id: str, island: str) -> None:
        caller = self.auth.authenticate(metadata)
        check_run_and_island(run_id, island, self.run_id, caller)

    # -- unary RPCs -----------------------------------------------------------------------------------

    def join(self, metadata: Metadata, req: pb.JoinRequest) -> pb.JoinReply:
        """Join (or rejoin) after authentication."""

        def run() -> pb.JoinReply:
            self._identify(metadata, req.run_id, req.island)
            return self.handler.join(req)

        return self._guard(metadata, run)

    def heartbeat(self, metadata: Metadata, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Lease renewal."""

        def run() -> pb.HeartbeatReply:
            self._identify(metadata, req.run_id, req.island)
            return self.handler.heartbeat(req)

        return self._guard(metadata, run)

    def leave(self, metadata: Metadata, req: pb.LeaveRequest) -> pb.LeaveReply:
        """Clean departure."""

        def run() -> pb.LeaveReply:
            self._identify(metadata, req.run_id, req.island)
            return self.handler.leave(req)

        return self._guard(metadata, run)

    def status(self, metadata: Metadata) -> pb.StatusReply:
        """Status snapshot (read-only; credentials required only if configured)."""

        def run() -> pb.StatusReply:
            if self.status_requires_auth:
                self.auth.authenticate(metadata)
            return self.handler.status()

        return self._guard(metadata, run)

    # -- push -----------------------------------------------------------------------------------------

    def push(self, metadata: Metadata, chunks: Iterable[pb.PushChunk]) -> pb.PushReply:
        """Receive one chunked pseudo-gradient, validate it completely, then hand it to the coordinator."""
        return self._guard(metadata, lambda: self._push(metadata, iter(chunks)))

    def _cached(self, key: tuple[str, int, int], digest: bytes) -> pb.PushReply | None:
        hit = self._accepted.get(key)
        if hit is None:
            return None
        if hit[0] != digest:
            raise Rejected(
                grpc.StatusCode.ALREADY_EXISTS,
                f"island {key[0]!r} already pushed a different payload for round {key[1]} fragment {key[2]}",
            )
        return hit[1]

    def _push(self, metadata: Metadata, chunks: Iterator[pb.PushChunk]) -> pb.PushReply:
        first = next(chunks, None)
        if first is None:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "empty push stream")
        if not (first.HasField("meta") and first.HasField("header")):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "the first chunk must carry meta and header")
        meta, header = first.meta, first.header
        self._identify(metadata, meta.run_id, meta.island)
        key = (meta.island, meta.round, meta.fragment)
        with self._commit_lock:
            seen = key in self._accepted
        check_push_meta(meta)
        if not seen:
            # A retry of an accepted push may come after its round closed; it is answered from the cache
            # once its digest (the trailer) has arrived, so only a new key is held to the current round here.
            check_round(meta.round, self.handler.current_round(meta.fragment), self.max_staleness)
        check_header(header, self.config.max_payload_bytes, self.config.max_tensors, self._codecs)
        if self.model_spec is not None:
            check_tensor_metas(header.tensors, spec_for(self.model_spec, meta.fragment))

        buf = Reassembler(header, self.config.max_payload_bytes, self.config.max_tensors, self._codecs)
        arrays: dict[str, np.ndarray] = {}
        chunk: Any = first
        while chunk is not None:
            if chunk is not first and (chunk.HasField("meta") or chunk.HasField("header")):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {chunk.index} repeats the metadata")
            buf.add(chunk.index, chunk.data, chunk.digest)
            # Decode each tensor as soon as its bytes are in, overlapping decode with the transfer. The
            # arrays are only used after `finish` has checked the digest of the whole payload.
            for t in buf.take_completed():
                arrays[t.name] = decode_one(t, self._decode)
            chunk = next(chunks, None)
        tensors = buf.finish()

        with self._commit_lock:
            cached = self._cached(key, buf.digest)
            if cached is not None:
                # A retried duplicate of an accepted push: same answer, handler not called again.
                return cached
            # The round may have closed while the bytes streamed in.
            check_round(meta.round, self.handler.current_round(meta.fragment), self.max_staleness)
            reply = self.handler.push(meta, tensors, arrays)
            if reply.accepted:
                reply = pb.PushReply(accepted=True, round=reply.round, detail=reply.detail, digest=buf.digest)
                self._accepted[key] = (buf.digest, reply)
                while len(self._accepted) > self.config.idempotency_cache:
                    self._accepted.popitem(last=False)
            return reply

    # -- pull -----------------------------------------------------------------------------------------

    def pull(self, metadata: Metadata, req: pb.PullRequest) -> Iterator[pb.PullChunk | bytes]:
        """Ask the coordinator for the payload, then stream it in chunks (header on the first)."""

        def prepare() -> Iterator[pb.PullChunk | bytes]:
            self._identify(metadata, req.run_id, req.island)
            payload = self.handler.pull(req)
            header = build_header(payload.tensors, self.config.chunk_bytes)
            limit = self.config.max_payload_bytes
            if header.total_bytes > limit:
                raise Rejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"pull payload {header.total_bytes} bytes exceeds the maximum {limit}",
                )
            pull_header = pb.PullHeader(
                run_id=self.run_id,
                round=payload.round,
                fragment=payload.fragment,
                kind=KIND_TO_PB[payload.kind],
                param_digest=payload.param_digest,
                payload=header,
            )
            return _pull_chunks(pull_header, payload.tensors, self.config.chunk_bytes)

        return self._guard(metadata, prepare)


def _pull_chunks(header: pb.PullHeader, tensors: Iterable, chunk_bytes: int) -> Iterator[pb.PullChunk | bytes]:
    """Header on the first chunk (a message), digest trailer on the last, every chunk after the first
    pre-serialized (see ``transport.wire``); the payload is hashed as it streams."""
    for i, (pieces, digest) in enumerate(iter_trailed_views(list(tensors), chunk_bytes)):
        if i == 0:
            yield pb.PullChunk(index=0, header=header, data=b"".join(pieces), digest=digest)
        else:
            yield encode_data_chunk(PULL_DATA_FIELD, i, *pieces, digest=digest)
