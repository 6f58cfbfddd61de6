"""The errors of the wire layer.

``Rejected`` is raised on the receiving side (by the transport's own checks or by the coordinator's handler)
and becomes a gRPC status with a reason; ``TransportError`` is what a client raises once an RPC has failed for
good (after retries), carrying the same status code and reason, so callers never see raw ``grpc.RpcError``.
"""

from __future__ import annotations

import grpc

from floor.errors import UserError

#: Status codes worth retrying: the peer may be back, or the link may recover (LinkDown maps to UNAVAILABLE).
#: CANCELLED too: a client only ever sees it when the server's watchdog cut a stream that stalled (a client's own
#: cancels come out as LinkDown), and the same call over a recovered link may well succeed.
RETRYABLE_CODES: frozenset[grpc.StatusCode] = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)


class Rejected(Exception):
    """A message refused with a gRPC status code and a human-readable reason."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(f"{code.name}: {reason}")
        self.code = code
        self.reason = reason


class TransportError(UserError, ConnectionError):
    """An RPC that failed for good: ``code`` is the final gRPC status, ``reason`` the peer's explanation."""

    def __init__(self, code: grpc.StatusCode, reason: str, attempts: int = 1) -> None:
        super().__init__(f"{code.name}: {reason}")
        self.code = code
        self.reason = reason
        self.attempts = attempts

    @property
    def retryable(self) -> bool:
        """True when the code says the same call may succeed later."""
        return self.code in RETRYABLE_CODES
