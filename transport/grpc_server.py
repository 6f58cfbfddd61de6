"""gRPC server for the diloco.v1 protocol: a thin adapter from RPCs to `DilocoService`.

Sync gRPC with a thread pool; message size limits are set explicitly from `TransportConfig`; a `Rejected`
from the service becomes ``context.abort(code, reason)`` so the island sees why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from transport import diloco_pb2 as pb
from transport import diloco_pb2_grpc as pb_grpc
from transport.auth import TlsConfig
from transport.errors import Rejected
from transport.service import DilocoService
from transport.wire import parse_push_chunk, serialize_chunk

T = TypeVar("T")


class _Servicer(pb_grpc.DilocoServicer):
    def __init__(self, service: DilocoService) -> None:
        self._service = service

    @staticmethod
    def _call(context: grpc.ServicerContext, fn: Callable[[tuple], T]) -> T:
        try:
            return fn(context.invocation_metadata())
        except Rejected as e:
            context.abort(e.code, e.reason)
            raise  # unreachable: abort raises
        except grpc.RpcError:
            # The client cancelled mid-stream (e.g. its link went down): nothing was applied, nothing to log.
            context.abort(grpc.StatusCode.CANCELLED, "stream cancelled by the client")
            raise

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:  # noqa: N802
        return self._call(context, lambda md: self._service.join(md, request))

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:  # noqa: N802
        return self._call(context, lambda md: self._service.heartbeat(md, request))

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:  # noqa: N802
        return self._call(context, lambda md: self._service.leave(md, request))

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:  # noqa: N802
        return self._call(context, lambda md: self._service.status(md))

    def PushPseudoGrad(  # noqa: N802
        self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext
    ) -> pb.PushReply:
        return self._call(context, lambda md: self._service.push(md, request_iterator))

    def PullGlobal(  # noqa: N802
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PullChunk | bytes]:
        chunks = self._call(context, lambda md: self._service.pull(md, request))
        try:
            yield from chunks
        except Rejected as e:
            context.abort(e.code, e.reason)


def _handlers(servicer: _Servicer) -> grpc.GenericRpcHandler:
    """The diloco.v1 method table; like the generated one, but the chunk streams use ``transport.wire``."""

    def unary(fn: Callable, request: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=request.FromString, response_serializer=_serialize_message
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
                request_deserializer=parse_push_chunk,
                response_serializer=_serialize_message,
            ),
            "PullGlobal": grpc.unary_stream_rpc_method_handler(
                servicer.PullGlobal,
                request_deserializer=pb.PullRequest.FromString,
                response_serializer=serialize_chunk,
            ),
        },
    )


def _serialize_message(message: Any) -> bytes:
    return message.SerializeToString()


@dataclass
class RunningServer:
    """A started server and the port it listens on."""

    server: grpc.Server
    port: int
    host: str

    @property
    def address(self) -> str:
        """``host:port`` to dial."""
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop accepting calls; wait up to ``grace_s`` for calls in flight."""
        self.server.stop(grace_s).wait()


def start_server(
    service: DilocoService, listen: str = "127.0.0.1:0", tls: TlsConfig | None = None, max_workers: int = 16
) -> RunningServer:
    """Serve ``service`` on ``listen`` (port 0 picks a free port) and return once it accepts calls."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"listen address must be HOST:PORT (got {listen!r})")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="diloco-grpc"),
        options=service.config.grpc_options(),
    )
    server.add_generic_rpc_handlers((_handlers(_Servicer(service)),))
    if tls is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, tls.server_credentials())
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return RunningServer(server=server, port=port, host=host.strip("[]") or "127.0.0.1")
