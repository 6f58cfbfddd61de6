"""gRPC server for the diloco.v1 protocol: a thin adapter from RPCs to `DilocoService`, hardened for hostile clients.

Sync gRPC with a thread pool; message size limits are set explicitly from `TransportConfig`. Every call, in
this order, before any of its messages is read:

1. is identified from its metadata (``DilocoService.authenticate``; Status per ``status_requires_auth``);
2. takes an admission slot in its lane (transport/admission.py), or is refused with UNAVAILABLE (retry later) at
   once; the pool has a thread for every slot, so idle streams never hold the threads heartbeats need;
3. gets a `Watch` (transport/watchdog.py) that cancels it when its client stays quiet too long.

All six methods are registered with a *streamed* request, the unary ones too: on the wire a unary call is a
stream of one message, so clients see no difference, but a unary handler of gRPC's would only run once the
request message has fully arrived, leaving a client that opens a call and never sends it in control of a
thread. Here the handler runs first, and reads the one message under the first-message deadline. Request
bytes are parsed by tolerant parsers (``transport.wire.tolerant``): bytes that do not parse become
INVALID_ARGUMENT from the handler, counted like any other refusal, instead of gRPC's INTERNAL.

A `Rejected` from the service becomes ``context.abort(code, reason)`` so the island sees why; a call whose
client went away (or that the watchdog cancelled) ends quietly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc

from transport import diloco_pb2 as pb
from transport.admission import STREAM, UNARY, Admission, Slot, lanes_of
from transport.auth import TlsConfig
from transport.errors import Rejected
from transport.service import DilocoService, Metadata
from transport.watchdog import StreamExpired, Watch, Watchdog, message_size
from transport.wire import parse_push_chunk, serialize_chunk, tolerant

T = TypeVar("T")
Caller = Callable[[Metadata], str]


class _Servicer:
    """The six RPCs: admission, watch, read, answer; every outcome a status."""

    def __init__(self, service: DilocoService) -> None:
        self._service = service
        self._config = service.config
        self.admission = Admission(lanes_of(service.config))
        self.watchdog = Watchdog()

    def _open(self, context: grpc.ServicerContext, lane: str, caller: Caller) -> tuple[Metadata, Slot, Watch]:
        """Identify the caller and take its slot (nothing read yet), then start watching the call.

        The slot goes back when the handler's ``with`` ends, never earlier: a cancelled call still holds its
        thread until its handler has unwound, so releasing on gRPC's end-of-call callback would admit more
        calls than there are threads. (A pull whose generator gRPC drops is closed by its last reference.)
        """
        md = context.invocation_metadata()
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

    def _unary(self, requests: Iterator[Any], context: grpc.ServicerContext, expected: type, caller: Caller,
               answer: Callable[[Metadata, Any], T]) -> T:  # fmt: skip
        try:
            md, slot, watch = self._open(context, UNARY, caller)
            with slot, watch:
                request = self._service.first_message(md, watch.receive(requests, self._config), expected)
                return answer(md, request)
        except Exception as e:
            self._end(context, e)

    def Join(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.JoinReply:  # noqa: N802
        return self._unary(requests, context, pb.JoinRequest, self._service.authenticate, self._service.join)

    def Heartbeat(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.HeartbeatReply:  # noqa: N802
        return self._unary(
            requests, context, pb.HeartbeatRequest, self._service.authenticate, self._service.heartbeat
        )

    def Leave(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.LeaveReply:  # noqa: N802
        return self._unary(requests, context, pb.LeaveRequest, self._service.authenticate, self._service.leave)

    def Status(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.StatusReply:  # noqa: N802
        return self._unary(
            requests, context, pb.StatusRequest, self._service.status_caller, lambda md, _: self._service.status(md)
        )

    def PushPseudoGrad(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.PushReply:  # noqa: N802
        try:
            md, slot, watch = self._open(context, STREAM, self._service.authenticate)
            with slot, watch:
                return self._service.push(md, watch.receive(requests, self._config, message_size))
        except Exception as e:
            self._end(context, e)

    def PullGlobal(  # noqa: N802
        self, requests: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[pb.PullChunk | bytes]:
        try:
            md, slot, watch = self._open(context, STREAM, self._service.authenticate)
            with slot, watch:
                request = self._service.first_message(md, watch.receive(requests, self._config), pb.PullRequest)
                yield from watch.send(self._service.pull(md, request), self._config, message_size)
        except Exception as e:
            self._end(context, e)


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

    @property
    def address(self) -> str:
        """``host:port`` to dial."""
        return f"{self.host}:{self.port}"

    @property
    def admission(self) -> Admission:
        """The server's admission slots."""
        return self.servicer.admission

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop accepting calls; wait up to ``grace_s`` for calls in flight."""
        self.server.stop(grace_s).wait()
        self.servicer.watchdog.close()


def start_server(service: DilocoService, listen: str = "127.0.0.1:0", tls: TlsConfig | None = None) -> RunningServer:
    """Serve ``service`` on ``listen`` (port 0 picks a free port) and return once it accepts calls.

    The pool has ``service.config.server_threads`` threads (a thread for every admission slot, and spares that
    answer refusals), and gRPC itself refuses calls beyond ``max_pending_calls`` held at once.
    """
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"listen address must be HOST:PORT (got {listen!r})")
    config = service.config
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.server_threads, thread_name_prefix="diloco-grpc"),
        options=config.grpc_options(),
        maximum_concurrent_rpcs=config.max_pending_calls,
    )
    servicer = _Servicer(service)
    server.add_generic_rpc_handlers((_handlers(servicer),))
    if tls is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, tls.server_credentials())
    if port == 0:
        servicer.watchdog.close()
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return RunningServer(server=server, port=port, host=host.strip("[]") or "127.0.0.1", servicer=servicer)
