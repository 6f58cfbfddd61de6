"""The transport-independent service: authenticate, validate, reassemble, deduplicate, then call the handler.

Both the gRPC servicer and the in-process transport run every message through this class, so the checks
(docs/architecture.md, "Errors": bad input never touches state) and the idempotency rule are the same everywhere:

* the caller is known from the call metadata alone, before any message is read (`authenticate`): with
  secrets, the island they belong to; without, the island it names, which must be one of the run's
  (``islands``) either way, so invented names can neither act nor make the coordinator remember them;
* checks that need only the first chunk (run id, island, push metadata, tensor specs, declared sizes, and the
  handler's `admissible`: the round, or a retry of a push it accepted) run before any payload byte is buffered,
  and the declared total is reserved from a budget shared by all pushes in flight (``max_buffered_mb``);
  digest, decode and finiteness run once the bytes are in; a push that fails gives its buffer back at once. From
  those first checks until the handler has answered, the push is `CoordinatorHandler.receiving`: its island's
  pull for that sync, sent as soon as the push was on the wire, waits for it;
* idempotency is the handler's: a retried duplicate of an accepted push is answered by it as before
  (`CoordinatorHandler.push`);
* an island's Attend call is held open (`attending`) and its break reported to `CoordinatorHandler.absent`
  (transport/presence.py).

Every answer goes through `answering`: a refusal is a `Rejected` (code + reason) whose reason is made
`printable` (bounded, control characters escaped: it may carry an attacker's strings) and is reported once
through ``on_rejected(island, "CODE: reason")``; an unexpected exception of ours becomes INTERNAL with a
generic reason, its traceback logged once per place it comes from, and the process goes on. A failure of the
client's own stream (it cancelled, its link broke) is neither: it comes out as it went in.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import numpy as np

from floor.codec import CodecSpec
from transport import diloco_pb2 as pb
from transport.auth import ISLAND_KEY, OPERATOR_KEY, Authenticator, check_certified, check_operator
from transport.chunking import ByteBudget, Reassembler, build_header, check_header, iter_trailed_views
from transport.config import TransportConfig
from transport.errors import Rejected
from transport.handler import KIND_TO_PB, CoordinatorHandler, RejectionSink
from transport.presence import Presences
from transport.tensors import Wholes, decoder, known_codecs
from transport.validate import (
    ModelSpec,
    check_join,
    check_lease,
    check_leave,
    check_push_meta,
    check_run_and_island,
    check_tensor_metas,
    decode_one,
    printable,
    spec_for,
)
from transport.wire import PULL_DATA_FIELD, Undecodable, encode_data_chunk, serialize_chunk

Metadata = Iterable[tuple[str, str | bytes]] | None
T = TypeVar("T")
LOG = logging.getLogger(__name__)
OPERATOR = "(operator)"
"""The caller of an operator's call (Admit, Retire with the operator's credentials)."""
ANONYMOUS = "(anonymous)"
"""The caller of a Status that needs no credentials (its admission slots are shared by all such callers)."""
INTERNAL_REASON = "internal error while answering this call (the server logged it)"
_MAX_LOGGED_PLACES = 64


def claimed_island(metadata: Metadata) -> str:
    """The island the call metadata names (unchecked: anyone may claim any name)."""
    for key, value in metadata or ():
        if key == ISLAND_KEY:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return ""


class Answered(Rejected):
    """A refusal already made printable and reported through ``on_rejected``: report it no more."""


class ClientGone(Exception):
    """The client's own stream failed (it cancelled, its link broke, the watchdog ended it): ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def from_client(messages: Iterable[T]) -> Iterator[T]:
    """``messages`` with every failure of the client's side wrapped in `ClientGone`, so that it is told apart
    from a failure of ours (INTERNAL); a `Rejected` (a verdict on the stream) passes as it is."""
    it = iter(messages)
    while True:
        try:
            message = next(it)
        except StopIteration:
            return
        except Rejected:
            raise
        except Exception as e:
            raise ClientGone(e) from e
        yield message


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
        on_rejected: RejectionSink | None = None,
        status_requires_auth: bool = False,
        islands: Collection[str] | None = None,
        uplink: CodecSpec | None = None,
        operator: bytes | None = None,
    ) -> None:
        """``islands``: the run's island names, read at every call (the coordinator's `Enrollment`, which admissions
        and retirements change; None: any name, for tests); ``uplink``: the one codec pushes may use (None: any
        known one); ``operator``: SHA-256 of the operator's secret (None: no Admit, no Retire but an island's own).
        """
        self.handler = handler
        self.run_id = run_id
        self.model_spec = model_spec
        self.auth = authenticator or Authenticator(None)
        self.config = config or TransportConfig()
        self.on_rejected = on_rejected
        self.status_requires_auth = status_requires_auth
        self.islands = islands
        self.operator = operator
        self.uplink = uplink
        self.budget = ByteBudget(self.config.max_buffered_bytes)
        self.presences = Presences(self._absent)
        self._codecs = known_codecs()
        self._decode = decoder(() if uplink is None else (uplink,))
        self._logged_places: set[tuple[str, str, int]] = set()
        self._log_lock = threading.Lock()

    # -- answering ------------------------------------------------------------------------------------

    def report(self, metadata: Metadata, rejected: Rejected) -> Answered:
        """Report a refusal once (through ``on_rejected``) and return it printable, ready to raise."""
        if isinstance(rejected, Answered):
            return rejected
        answered = Answered(rejected.code, printable(rejected.reason))
        if self.on_rejected is not None:
            self.on_rejected(printable(claimed_island(metadata), 64), str(answered))
        return answered

    @contextmanager
    def answering(self, metadata: Metadata) -> Iterator[None]:
        """Run one answer: a `Rejected` comes out reported and printable, an unexpected exception as INTERNAL
        (logged once per place), a client failure (`ClientGone`) as the exception the client's stream raised."""
        try:
            yield
        except ClientGone as e:
            raise e.cause from None
        except Rejected as e:
            raise self.report(metadata, e) from None
        except Exception as e:
            self._log_unexpected(e)
            raise self.report(metadata, Rejected(grpc.StatusCode.INTERNAL, INTERNAL_REASON)) from None

    def _log_unexpected(self, exc: Exception) -> None:
        frames = traceback.extract_tb(exc.__traceback__)
        where = frames[-1] if frames else None
        place = (type(exc).__name__, where.filename if where else "?", where.lineno or 0 if where else 0)
        with self._log_lock:
            if place in self._logged_places:
                return
            if len(self._logged_places) < _MAX_LOGGED_PLACES:
                self._logged_places.add(place)
        LOG.error("unexpected %s while answering a call (logged once per place)", place[0], exc_info=exc)

    # -- identity -------------------------------------------------------------------------------------

    def authenticate(self, metadata: Metadata) -> str:
        """The calling island, from the call metadata alone (nothing of the call's messages is read).

        With secrets, the island they are valid for (UNAUTHENTICATED otherwise); without, the island the
        metadata names. Either way it must be one of ``islands``: an unknown name is PERMISSION_DENIED.
        """
        caller = self.auth.authenticate(metadata)
        name = caller if caller is not None else claimed_island(metadata)
        if not name:
            raise Rejected(grpc.StatusCode.UNAUTHENTICATED, f"no island name in the call metadata ({ISLAND_KEY})")
        if self.islands is not None and name not in self.islands:
            raise Rejected(
                grpc.StatusCode.PERMISSION_DENIED,
                f"island {name[:64]!r} is not on this run's roster (never admitted, or retired)",
            )
        check_certified(name, metadata)
        return name

    def status_caller(self, metadata: Metadata) -> str:
        """Who asks for Status: an authenticated island when Status requires credentials, else `ANONYMOUS`
        (the name in the metadata is then not trusted, and not needed)."""
        return self.authenticate(metadata) if self.status_requires_auth else ANONYMOUS

    def _identify(self, metadata: Metadata, run_id: str, island: str) -> None:
        check_run_and_island(run_id, island, self.run_id, self.authenticate(metadata))

    def first_message(self, metadata: Metadata, messages: Iterable[Any], expected: type[T]) -> T:
        """The one request message of a call, read from ``messages`` (a server reads nothing else of it)."""
        with self.answering(metadata):
            message = next(from_client(messages), None)
            if isinstance(message, Undecodable):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable {message.expected}: {message.error}")
            if not isinstance(message, expected):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"the call carries no {expected.__name__}")
            return message

    # -- unary RPCs -----------------------------------------------------------------------------------

    def join(self, metadata: Metadata, req: pb.JoinRequest) -> pb.JoinReply:
        """Join (or rejoin) after authentication."""
        with self.answering(metadata):
            self._identify(metadata, req.run_id, req.island)
            check_join(req)
            return self.handler.join(req)

    def heartbeat(self, metadata: Metadata, req: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        """Lease renewal."""
        with self.answering(metadata):
            self._identify(metadata, req.run_id, req.island)
            return self.handler.heartbeat(req)

    def leave(self, metadata: Metadata, req: pb.LeaveRequest) -> pb.LeaveReply:
        """Clean departure."""
        with self.answering(metadata):
            self._identify(metadata, req.run_id, req.island)
            check_leave(req)
            return self.handler.leave(req)

    def lease(self, metadata: Metadata, req: pb.LeaseRequest) -> pb.LeaseReply:
        """The chunks an island reads next (data.sampling = "chunks"; the handler's ledger decides)."""
        with self.answering(metadata):
            self._identify(metadata, req.run_id, req.island)
            check_lease(req)
            return self.handler.lease(req)

    @contextmanager
    def attending(
        self, metadata: Metadata, req: pb.AttendRequest, cancel: Callable[[], None]
    ) -> Iterator[pb.AttendReply]:
        """An island's presence call: the handler's reply, and (for a member) the call registered as the island's
        presence for the ``with`` block, which the caller holds for as long as the call is open. ``cancel`` ends the
        call when a newer one of the island replaces it (transport/presence.py).

        The call replaces the island's older one *before* the handler hears of it: an older call that ends meanwhile
        is then no break, and one that broke just before is forgiven by the handler's `attend`. The other order
        let an old connection's end, noticed as the island's new call arrived, count a present island as gone."""
        with self.answering(metadata):
            self._identify(metadata, req.run_id, req.island)
        attendance = self.presences.hold(req.island, cancel)
        try:
            with self.answering(metadata):
                reply = self.handler.attend(req)
        except BaseException:
            attendance.withdraw()
            raise
        if not reply.member:
            attendance.withdraw()
            yield reply
            return
        with attendance:
            yield reply

    def _absent(self, island: str) -> None:
        """An island's presence call broke (`Presences`): tell the handler; an error of its own is logged, not raised
        into the gRPC thread that saw the call end."""
        try:
            self.handler.absent(island)
        except Exception as exc:
            self._log_unexpected(exc)

    def status(self, metadata: Metadata) -> pb.StatusReply:
        """Status snapshot (read-only; credentials required only if configured)."""
        with self.answering(metadata):
            self.status_caller(metadata)
            return self.handler.status()

    # -- the roster: operator calls -------------------------------------------------------------------

    def operator_caller(self, metadata: Metadata) -> str:
        """`OPERATOR` when the call carries the operator's credentials (`transport.auth.check_operator`)."""
        check_operator(metadata, self.operator)
        return OPERATOR

    def retiring_caller(self, metadata: Metadata) -> str:
        """Who asks for a retirement: the operator (any island), or an island for itself with its own credentials.
        An island the run does not authenticate (no `network.secrets`) cannot retire itself: anyone who reaches the
        coordinator could claim its name and retire it for good, so only the operator retires it."""
        if any(key == OPERATOR_KEY for key, _ in metadata or ()):
            return self.operator_caller(metadata)
        if self.auth.authenticate(metadata) is None:
            raise Rejected(
                grpc.StatusCode.UNAUTHENTICATED,
                f"island {claimed_island(metadata)[:64]!r} has no credentials to retire itself with (the run has no "
                "network.secrets): only the operator retires it (diloco retire with network.operator_secret)",
            )
        return self.authenticate(metadata)

    def admit(self, metadata: Metadata, req: pb.AdmitRequest) -> pb.AdmitReply:
        """The operator admits an island into the live run (the handler decides: name, credential, limits)."""
        with self.answering(metadata):
            self.operator_caller(metadata)
            check_run_and_island(req.run_id, req.island, self.run_id, None)
            return self.handler.admit(req)

    def retire(self, metadata: Metadata, req: pb.RetireRequest) -> pb.RetireReply:
        """An island leaves the run for good: the operator retires any island, an island only itself."""
        with self.answering(metadata):
            caller = self.retiring_caller(metadata)
            check_run_and_island(req.run_id, req.island, self.run_id, None if caller == OPERATOR else caller)
            check_leave(req)
            return self.handler.retire(req, caller)

    # -- push -----------------------------------------------------------------------------------------

    def push(self, metadata: Metadata, chunks: Iterable[pb.PushChunk | Undecodable]) -> pb.PushReply:
        """Receive one chunked pseudo-gradient, validate it completely, then hand it to the coordinator."""
        with self.answering(metadata):
            return self._push(metadata, from_client(chunks))

    def _push(self, metadata: Metadata, chunks: Iterator[Any]) -> pb.PushReply:
        caller = self.authenticate(metadata)  # before the first chunk is read
        first = _decoded(next(chunks, None), 0)
        if first is None:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "empty push stream")
        if not (first.HasField("meta") and first.HasField("header")):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "the first chunk must carry meta and header")
        meta, header = first.meta, first.header
        check_run_and_island(meta.run_id, meta.island, self.run_id, caller)
        check_push_meta(meta, header.tensors, self.model_spec, self.uplink)
        self.handler.admissible(meta)
        check_header(header, self.config.max_payload_bytes, self.config.max_tensors, self._codecs)
        wholes = Wholes()
        if self.model_spec is not None:
            expected = spec_for(self.model_spec, meta.fragment)
            check_tensor_metas(header.tensors, expected)
            wholes = Wholes({m.name: tuple(expected[m.name][0]) for m in header.tensors if m.offset})
        elif any(m.offset for m in header.tensors):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "a tensor in pieces needs the model's shapes")

        buf = Reassembler(
            header, self.config.max_payload_bytes, self.config.max_tensors, self._codecs, budget=self.budget
        )
        with self.handler.receiving(meta):  # a pull its island sent meanwhile waits for the outcome
            try:
                tensors, arrays = self._receive(buf, first, chunks, wholes)
            finally:
                buf.close()  # the budget back; a failed stream's buffer is given up at once
            return self.handler.push(meta, tensors, arrays, buf.digest)

    def _receive(
        self, buf: Reassembler, first: Any, chunks: Iterator[Any], wholes: Wholes
    ) -> tuple[list, dict[str, np.ndarray]]:
        """Write every chunk into ``buf``, decoding each tensor as soon as its bytes are in (overlapping decode
        with the transfer), a piece into its region of its tensor (`wholes`); the arrays are only used after `finish`
        has checked the digest of the whole."""
        arrays: dict[str, np.ndarray] = {}
        chunk: Any = first
        while chunk is not None:
            if chunk is not first and (chunk.HasField("meta") or chunk.HasField("header")):
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {chunk.index} repeats the metadata")
            buf.add(chunk.index, chunk.data, chunk.digest)
            for t in buf.take_completed():
                array = decode_one(t, self._decode)
                arrays[t.name] = wholes.place(t, array) if t.offset else array
            chunk = _decoded(next(chunks, None), buf.received_chunks)
        return buf.finish(), arrays

    # -- pull -----------------------------------------------------------------------------------------

    def pull(self, metadata: Metadata, req: pb.PullRequest) -> Iterator[pb.PullChunk | bytes]:
        """Ask the coordinator for the payload, then stream it in chunks (header on the first)."""
        with self.answering(metadata):
            self._identify(metadata, req.run_id, req.island)
            if self.model_spec is not None:
                spec_for(self.model_spec, req.fragment)
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

        def chunks() -> Iterator[pb.PullChunk | bytes]:
            return _pull_chunks(pull_header, payload.tensors, self.config.chunk_bytes)

        shared = payload.shared
        stream = chunks() if shared is None else shared.stream(pull_header.SerializeToString(), chunks)
        return self._answered_chunks(metadata, stream, payload.on_done)

    def _answered_chunks(
        self, metadata: Metadata, chunks: Iterator[T], then: Callable[[], None] | None = None
    ) -> Iterator[T]:
        """``chunks``, with a failure while making one answered like any other; ``then`` runs once the stream is
        over (gRPC asks for the next chunk only when the last one is written, so after the last one is on the wire;
        or the stream failed, or was cancelled and this generator closed)."""
        try:
            with self.answering(metadata):
                yield from chunks
        finally:
            if then is not None:
                then()


def _decoded(chunk: Any, position: int) -> Any:
    """``chunk`` (the stream's ``position``-th, from 0), or INVALID_ARGUMENT when its bytes did not parse."""
    if isinstance(chunk, Undecodable):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"chunk #{position} is undecodable: {chunk.error}")
    return chunk


def _pull_chunks(header: pb.PullHeader, tensors: Iterable, chunk_bytes: int) -> Iterator[pb.PullChunk | bytes]:
    """Header on the first chunk (a message), digest trailer on the last, every chunk after the first
    pre-serialized (see ``transport.wire``); the payload is hashed as it streams."""
    for i, (pieces, digest) in enumerate(iter_trailed_views(list(tensors), chunk_bytes)):
        if i == 0:
            yield pb.PullChunk(index=0, header=header, data=b"".join(pieces), digest=digest)
        else:
            yield encode_data_chunk(PULL_DATA_FIELD, i, *pieces, digest=digest)


class SharedPull:
    """The serialized chunks of one pull payload, made once for every island that pulls it: the pulls of one
    commit carry the same bytes (`PullPayload.shared`). Each chunk is made (its pieces joined, the digest trailer
    computed) by the first stream that reaches it and kept for the others, so a commit's update is joined and hashed
    once however many islands pull it; the price is a serialized copy of it while the coordinator keeps the commit.
    When islands pull one commit at once on shared cores, the joining and hashing each pull would repeat is done
    once (BENCHMARKS.md, "Sync critical path").

    A stream's header must be the one the chunks were made with (the same commit, the same service); another one is
    made on its own. A stream that stops half-way leaves the chunks it made to the others. If making a chunk fails,
    the streams replaying end short (their islands pull again) and every later stream makes its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: bytes | None = None
        self._source: Iterator[pb.PullChunk | bytes] | None = None
        self._made: list[bytes] = []
        self._broken = False

    def stream(self, key: bytes, make: Callable[[], Iterator[pb.PullChunk | bytes]]) -> Iterator[pb.PullChunk | bytes]:
        """The chunks of the payload whose header serializes to ``key``; ``make`` makes them (once)."""
        with self._lock:
            if self._key is None:
                self._key, self._source = key, make()
            elif key != self._key or self._broken:
                return make()
        return self._replay()

    def _replay(self) -> Iterator[bytes]:
        i = 0
        while True:
            with self._lock:
                if i == len(self._made):
                    try:
                        chunk = None if self._source is None else next(self._source, None)
                    except BaseException:
                        self._source, self._broken = None, True
                        raise
                    if chunk is None:
                        self._source = None
                        return
                    self._made.append(serialize_chunk(chunk))
                made = self._made[i]
            yield made
            i += 1
