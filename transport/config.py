"""Configuration of the wire: chunking, message limits, deadlines and retry policy.

A frozen dataclass with a docstring under each field and validation in ``__post_init__`` (a ``ValueError``
naming the key), like every config in the project; the run config nests it under ``[transport]``.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


class TransportConfigError(ValueError):
    """A transport config value out of range."""


@dataclass(frozen=True)
class TransportConfig:
    """Wire-level settings shared by server and client."""

    chunk_bytes: int = MIB
    """Payload bytes per streamed chunk (about 1 MiB keeps memory bounded and messages small)."""

    max_message_bytes: int = 4 * MIB
    """gRPC max send/receive message length, set explicitly on both ends: one chunk plus its header."""

    max_payload_mb: float = 2048.0
    """Largest payload (MiB) a push or pull may declare; beyond it the call fails with RESOURCE_EXHAUSTED."""

    max_tensors: int = 100_000
    """Largest number of tensors one payload may declare."""

    rpc_timeout_s: float = 30.0
    """Deadline of a unary RPC, and the fixed part of a streaming RPC's deadline."""

    min_bandwidth_mbps: float = 1.0
    """Slowest link we plan for: a stream's deadline grows by payload_bits / this rate."""

    max_attempts: int = 5
    """Attempts per RPC (1 = no retry); only UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED are retried."""

    backoff_initial_s: float = 0.2
    """First retry backoff; doubles each attempt, with full jitter."""

    backoff_max_s: float = 10.0
    """Ceiling of one backoff sleep."""

    idempotency_cache: int = 4096
    """Accepted pushes remembered per server (key, digest, reply) to answer retried duplicates."""

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("chunk_bytes", self.chunk_bytes >= 1024, "must be >= 1024"),
            (
                "max_message_bytes",
                self.max_message_bytes >= self.chunk_bytes + 64 * 1024,
                f"must be >= chunk_bytes + 64 KiB ({self.chunk_bytes + 64 * 1024})",
            ),
            ("max_payload_mb", self.max_payload_mb > 0, "must be > 0"),
            ("max_tensors", self.max_tensors >= 1, "must be >= 1"),
            ("rpc_timeout_s", self.rpc_timeout_s > 0, "must be > 0"),
            ("min_bandwidth_mbps", self.min_bandwidth_mbps > 0, "must be > 0"),
            ("max_attempts", self.max_attempts >= 1, "must be >= 1"),
            ("backoff_initial_s", self.backoff_initial_s >= 0, "must be >= 0"),
            ("backoff_max_s", self.backoff_max_s >= self.backoff_initial_s, "must be >= backoff_initial_s"),
            ("idempotency_cache", self.idempotency_cache >= 1, "must be >= 1"),
        ]
        for key, ok, why in checks:
            if not ok:
                raise TransportConfigError(f"transport.{key} = {getattr(self, key)!r} {why}")

    @property
    def max_payload_bytes(self) -> int:
        """``max_payload_mb`` in bytes."""
        return int(self.max_payload_mb * MIB)

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel/server options: explicit message limits on both ends (never -1)."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]

    def stream_deadline_s(self, payload_bytes: int) -> float:
        """Deadline of a streaming RPC carrying ``payload_bytes``."""
        return self.rpc_timeout_s + payload_bytes * 8 / (self.min_bandwidth_mbps * 1e6)
