"""gRPC server for the diloco.v1 protocol: a thin adapter from RPCs to `DilocoService`, hardened for hostile clients.

Sync gRPC with a thread pool; message size limits are set explicitly from `TransportConfig`. Every call, in
this order, before any of its messages is read:

1. is identified from its metadata (``DilocoService.authenticate``; Status per ``status_requires_auth``);
2. takes an admission slot in its lane (transport/admission.py), or is refused with UNAVAILABLE (retry later) at
   once; the pool has a thread for every slot, so idle streams never hold the threads heartbeats need;
3. gets a `Watch` (transport/watchdog.py) that cancels it when its client stays quiet too long.

All seven methods are registered with a *streamed* request, the unary ones too: on the wire a unary call is a
stream of one message, so clients see no difference, but a unary handler of gRPC's would only run once the
request message has fully arrived, leaving a client that opens a call and never sends it in control of a
thread. Here the handler runs first, and reads the one message under the first-message deadline. Request
bytes are parsed by tolerant parsers (``transport.wire.tolerant``): bytes that do not parse become
INVALID_ARGUMENT from the handler, counted like any other refusal, instead of gRPC's INTERNAL.

Attend, an island's presence call (transport/presence.py), is held open after its one reply until its client goes
(its connection closed, or unanswered keepalive pings, when on, closed it: `TransportConfig.server_options`), a
newer call of the island replaces it, or the server stops; it takes a slot of its own lane, so presence never takes
the threads of pushes, pulls or heartbeats.

A `Rejected` from the service becomes ``context.abort(code, reason)`` so the island sees why; a call whose
client went away (or that the watchdog cancelled) ends quietly.

The server also answers the standard gRPC health check (``grpc.health.v1.Health/Check``, grpcio-health-checking)
for "" and "diloco.v1.Diloco": NOT_SERVING until a service is attached (a coordinator may listen while it restores
its checkpoint: every diloco call is then UNAVAILABLE, which islands retry) and from the moment `stop` begins,
SERVING in between. ``Watch`` is refused (UNIMPLEMENTED): a watch holds a server thread for as long as the client
likes, outside every admission lane; pollers use ``Check``. ``on_call(method, claimed island, code, seconds)`` is
told of every diloco call once it ended (the coordinator's RPC latency metrics); the island is whatever the
caller's metadata claims, so whoever counts by it must bound it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from transport import diloco_pb2 as pb
from transport.admission import PRESENCE, STREAM, UNARY, Admission, Slot, lanes_of
from transport.auth import CERTIFIED_KEY, TlsConfig
from transport.config import TransportConfig
from transport.errors import Rejected
from transport.service import DilocoService, Metadata, claimed_island
from transport.watchdog import StreamExpired, Watch, Watchdog, message_size
from transport.wire import parse_push_chunk, serialize_chunk, tolerant

T = TypeVar("T")
Caller = Callable[[Metadata], str]
CallObserver = Callable[[str, str, grpc.StatusCode, float], None]
SERVICE_NAME = "diloco.v1.Diloco"
STARTING = "the coordinator is starting (restoring its checkpoint); retry"


class _CheckOnly(health.HealthServicer):
    """The standard health service without ``Watch``: a watch would hold a pool thread outside admission."""

    def Watch(self, request: Any, context: grpc.ServicerContext, send_response_callback: Any = None) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served; poll Check")


class _Servicer:
    """The RPCs: admission, watch, read, answer; every outcome a status."""

    def __init__(self, service: DilocoService | None, config: TransportConfig, on_call: CallObserver | None) -> None:
        self._service: DilocoService | None = service
        """None while the coordinator starts: every call is UNAVAILABLE until `RunningServer.attach`."""
        self._config = config
        self._on_call = on_call
        self.admission = Admission(lanes_of(config))
        self.watchdog = Watchdog()

    def _ready(self, context: grpc.ServicerContext) -> DilocoService:
        service = self._service
        if service is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, STARTING)
        return service

    @contextmanager
    def _observed(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Tell `on_call` how the call ended and how long it took (nothing when nobody listens)."""
        t0 = time.perf_counter()
        code: grpc.StatusCode | None = None
        try:
            yield
        except GeneratorExit:  # a pull whose client stopped reading
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if self._on_call is not None:
                code = code or context.code() or grpc.StatusCode.OK
                island = claimed_island(context.invocation_metadata())
                self._on_call(method, island, code, time.perf_counter() - t0)

    def _open(self, context: grpc.ServicerContext, lane: str, caller: Caller) -> tuple[Metadata, Slot, Watch]:
        """Identify the caller and take its slot (nothing read yet), then start watching the call.

        The slot goes back when the handler's ``with`` ends, never earlier: a cancelled call still holds its
        thread until its handler has unwound, so releasing on gRPC's end-of-call callback would admit more
        calls than there are threads. (A pull whose generator gRPC drops is closed by its last reference.)
        """
        md = call_metadata_of(context)
        with self._service.answering(md):
            slot = self.admission.take(lane, caller(md))
        expired = lambda reason: self._service.report(md, Rejected(grpc.StatusCode.DEADLINE_EXCEEDED, reason))
        return md, slot, self.watchdog.watch(context.cancel, expired)

    def _end(self, context: grpc.ServicerContext, exc: Exception) -> NoReturn:
        """End the call for ``exc``: a refusal with its code and reason; a client that is gone (it cancelled, or
        the watchdog cancelled it) quietly; anything else as the service answers it (INTERNAL, logged)."""
        if isinstance(exc, grpc.RpcError | StreamExpired):
            context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
        if not isinstance(exc, Rejected):
            try:
                with self._service.answering(context.invocation_metadata()):
                    raise exc
            except Rejected as answered:
                exc = answered
        context.abort(exc.code, exc.reason)
        raise AssertionError("unreachable: abort raises")

    def _unary(
        self,
        requests: Iterator[Any],
        context: grpc.ServicerContext,
        expected: type,
        method: str,
        answer: Callable[[DilocoService, Metadata, Any], T],
        identify: Callable[[DilocoService], Caller] = lambda s: s.authenticate,
    ) -> T:
        """One request, one reply; ``identify`` picks the service's check of who calls (an island by default)."""
        with self._observed(method, context):
            service = self._ready(context)
            try:
                md, slot, watch = self._open(context, UNARY, identify(service))
                with slot, watch:
                    request = service.first_message(md, watch.receive(requests, self._config), expected)
                    return answer(service, md, request)
            except Exception as e:
                self._end(context, e)

    def Join(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.JoinReply:  # noqa: N802
        return self._unary(requests, context, pb.JoinRequest, "Join", lambda s, md, r: s.join(md, r))

    def Heartbeat(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.HeartbeatReply:  # noqa: N802
        return self._unary(requests, context, pb.HeartbeatRequest, "Heartbeat", lambda s, md, r: s.heartbeat(md, r))

    def Leave(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.LeaveReply:  # noqa: N802
        return self._unary(requests, context, pb.LeaveRequest, "Leave", lambda s, md, r: s.leave(md, r))

    def Lease(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.LeaseReply:  # noqa: N802
        return self._unary(requests, context, pb.LeaseRequest, "Lease", lambda s, md, r: s.lease(md, r))

    def Admit(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.AdmitReply:  # noqa: N802
        return self._unary(
            requests, context, pb.AdmitRequest, "Admit", lambda s, md, r: s.admit(md, r), lambda s: s.operator_caller
        )

    def Retire(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.RetireReply:  # noqa: N802
        return self._unary(
            requests, context, pb.RetireRequest, "Retire", lambda s, md, r: s.retire(md, r), lambda s: s.retiring_caller
        )

    def Status(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.StatusReply:  # noqa: N802
        return self._unary(
            requests, context, pb.StatusRequest, "Status", lambda s, md, _: s.status(md), lambda s: s.status_caller
        )

    def PushPseudoGrad(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.PushReply:  # noqa: N802
        with self._observed("PushPseudoGrad", context):
            service = self._ready(context)
            try:
                md, slot, watch = self._open(context, STREAM, service.authenticate)
                with slot, watch:
                    return service.push(md, watch.receive(requests, self._config, message_size))
            except Exception as e:
                self._end(context, e)

    def PullGlobal(  # noqa: N802
        self, requests: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[pb.PullChunk | bytes]:
        with self._observed("PullGlobal", context):
            service = self._ready(context)
            try:
                md, slot, watch = self._open(context, STREAM, service.authenticate)
                with slot, watch:
                    request = service.first_message(md, watch.receive(requests, self._config), pb.PullRequest)
                    yield from watch.send(service.pull(md, request), self._config, message_size)
            except Exception as e:
                self._end(context, e)

    def Attend(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.AttendReply]:  # noqa: N802
        with self._observed("Attend", context):
            service = self._ready(context)
            try:
                md, slot, watch = self._open(context, PRESENCE, service.authenticate)
                with slot, watch:
                    request = service.first_message(md, watch.receive(requests, self._config), pb.AttendRequest)
                    ended = threading.Event()
                    if not context.add_callback(ended.set):  # False: the call has ended already
                        ended.set()
                    with service.attending(md, request, context.cancel) as reply:
                        yield reply  # one small message: it fits the stream's flow-control window, never blocks
                        if reply.member:
                            ended.wait()  # the call ends: the island went, a newer call replaced it, or we stop
            except Exception as e:
                self._end(context, e)


def call_metadata_of(context: grpc.ServicerContext) -> Metadata:
    """The call's metadata as the service reads it: what the client sent, less any entry claiming `CERTIFIED_KEY`,
    plus one `CERTIFIED_KEY` entry per name of the client certificate the TLS handshake verified (mutual TLS)."""
    sent = [(k, v) for k, v in context.invocation_metadata() or () if k != CERTIFIED_KEY]
    auth = context.auth_context() or {}
    names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return (*sent, *((CERTIFIED_KEY, n.decode(errors="replace")) for n in names))


def _handlers(servicer: _Servicer) -> grpc.GenericRpcHandler:
    """The diloco.v1 method table: every request streamed (see the module docstring), parsed tolerantly; the
    chunk streams use ``transport.wire``'s fast paths."""

    def unary(fn: Callable, request: Any) -> grpc.RpcMethodHandler:
        return grpc.stream_unary_rpc_method_handler(
            fn,
            request_deserializer=tolerant(request.FromString, request.__name__),
            response_serializer=_serialize_message,
        )

    return grpc.method_handlers_generic_handler(
        "diloco.v1.Diloco",
        {
            "Join": unary(servicer.Join, pb.JoinRequest),
            "Heartbeat": unary(servicer.Heartbeat, pb.HeartbeatRequest),
            "Leave": unary(servicer.Leave, pb.LeaveRequest),
            "Status": unary(servicer.Status, pb.StatusRequest),
            "Admit": unary(servicer.Admit, pb.AdmitRequest),
            "Retire": unary(servicer.Retire, pb.RetireRequest),
            "Lease": unary(servicer.Lease, pb.LeaseRequest),
            "PushPseudoGrad": grpc.stream_unary_rpc_method_handler(
                servicer.PushPseudoGrad,
                request_deserializer=tolerant(parse_push_chunk, "PushChunk"),
                response_serializer=_serialize_message,
            ),
            "PullGlobal": grpc.stream_stream_rpc_method_handler(
                servicer.PullGlobal,
                request_deserializer=tolerant(pb.PullRequest.FromString, "PullRequest"),
                response_serializer=serialize_chunk,
            ),
            "Attend": grpc.stream_stream_rpc_method_handler(
                servicer.Attend,
                request_deserializer=tolerant(pb.AttendRequest.FromString, "AttendRequest"),
                response_serializer=_serialize_message,
            ),
        },
    )


def _serialize_message(message: Any) -> bytes:
    return message.SerializeToString()


@dataclass
class RunningServer:
    """A started server, the port it listens on, and its limits (for tests and benchmarks to observe)."""

    server: grpc.Server
    port: int
    host: str
    servicer: _Servicer
    health: health.HealthServicer

    @property
    def address(self) -> str:
        """``host:port`` to dial."""
        return f"{self.host}:{self.port}"

    @property
    def admission(self) -> Admission:
        """The server's admission slots."""
        return self.servicer.admission

    def attach(self, service: DilocoService) -> None:
        """Start answering diloco calls with ``service`` (a server started without one) and report SERVING."""
        self.servicer._service = service
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        """What the health check answers, for the whole server and for the diloco service alike."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Report NOT_SERVING, stop accepting calls, and wait up to ``grace_s`` for calls in flight."""
        self.health.enter_graceful_shutdown()
        if self.servicer._service is not None:
            self.servicer._service.presences.stop()  # the presence calls that end now are not islands gone
        self.server.stop(grace_s).wait()
        self.servicer.watchdog.close()


def start_server(
    service: DilocoService | None,
    listen: str = "127.0.0.1:0",
    tls: TlsConfig | None = None,
    *,
    config: TransportConfig | None = None,
    on_call: CallObserver | None = None,
) -> RunningServer:
    """Serve ``service`` on ``listen`` (port 0 picks a free port) and return once it accepts calls.

    ``service`` None listens at once but answers NOT_SERVING (health) and UNAVAILABLE (diloco calls) until
    `RunningServer.attach`: a coordinator restoring its checkpoint is seen starting, not absent; ``config`` is then
    the transport config the service will have. The pool has ``config.server_threads`` threads (a thread for every
    admission slot, and spares that answer refusals and health checks), and gRPC itself refuses calls beyond
    ``max_pending_calls`` held at once.
    """
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"listen address must be HOST:PORT (got {listen!r})")
    if service is not None:
        config = service.config
    elif config is None:
        raise ValueError("start_server without a service needs its transport config")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.server_threads, thread_name_prefix="diloco-grpc"),
        options=config.server_options(),
        maximum_concurrent_rpcs=config.max_pending_calls,
    )
    servicer = _Servicer(service, config, on_call)
    server.add_generic_rpc_handlers((_handlers(servicer),))
    checks = _CheckOnly()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    if tls is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, tls.server_credentials())
    if port == 0:
        servicer.watchdog.close()
        raise OSError(f"cannot listen on {listen}")
    running = RunningServer(
        server=server, port=port, host=host.strip("[]") or "127.0.0.1", servicer=servicer, health=checks
    )
    running.set_serving(service is not None)  # before the first call can ask
    server.start()
    return running
