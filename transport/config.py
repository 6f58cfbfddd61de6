"""Configuration of the wire: chunking, message limits, deadlines, retry policy and the server's limits.

A frozen dataclass with a docstring under each field and validation in ``__post_init__`` (a ``ValueError``
naming the key), like every config in the project; the run config nests it under ``[transport]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MIB = 1024 * 1024
SPARE_THREADS = 2
"""Server threads beyond the slots: a call refused because every slot is taken is still answered at once."""


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

    max_streams: int = 16
    """Push and pull streams the server serves at once, all islands together (at least 2 per island of the run:
    `for_islands`); one more is refused at once with UNAVAILABLE (retry later), never queued. A stream holds a
    server thread for its whole life, so the server's pool has a thread for each of these plus one for each of
    `max_unary_calls`: streams can never take the threads that heartbeats, joins and Status need
    (transport/admission.py)."""

    max_streams_per_island: int = 4
    """Streams one island may hold at once: its push and its pull, plus room for a retry that starts before the
    server has noticed (by `idle_timeout_s`) that the attempt it replaces is dead."""

    max_unary_calls: int = 16
    """Join, Heartbeat, Leave and Status calls served at once (at least 2 per island: `for_islands`; their own
    threads, see `max_streams`). Every call
    holds its thread until its one message has arrived, so a client that never sends it could otherwise hold
    them all for `first_message_timeout_s`."""

    max_unary_calls_per_island: int = 4
    """Unary calls one island (or, for unauthenticated Status, all anonymous callers together) may hold at once:
    its heartbeat and its main thread's call, with room to spare."""

    max_presence_streams: int = 16
    """Presence streams (Attend) the server holds at once, all islands together: one per island, and room for the
    one that replaces it (`for_islands` makes it 2 per island). Each holds a server thread for the island's whole
    membership, in a lane of its own (transport/admission.py, `PRESENCE_PER_ISLAND`)."""

    keepalive_s: float = 0.0
    """0: off. Otherwise the server pings (HTTP/2 PING, answered by the peer's gRPC core, not by Python) every
    connection it has heard nothing from for this long, and closes one whose ping goes unanswered for
    `keepalive_timeout_s`: an island whose host froze or lost power, or whose link went silent, then breaks its
    presence call in about the sum of the two, instead of waiting out its lease. Off by default because the ping
    waits behind everything queued toward the island (the server's socket buffer of a pull in flight, the
    bottleneck's buffer): on a slow link that is seconds (1 MiB is 8.4 s at 1 Mbit/s), and a live island's
    connection would be closed mid-transfer (BENCHMARKS.md, "Failover and presence"). Safe where every island's
    link is fast enough that nothing queues toward it for longer than `keepalive_timeout_s`."""

    keepalive_timeout_s: float = 3.0
    """How long a keepalive ping may go unanswered before the connection is closed (`keepalive_s`); it must exceed
    the longest queueing delay toward any island."""

    max_pending_calls: int = 256
    """Calls the server holds at once, running or waiting for a thread; beyond it gRPC itself refuses them with
    RESOURCE_EXHAUSTED, so a flood of calls cannot grow the server's memory without bound."""

    first_message_timeout_s: float = 30.0
    """How long any call may take to deliver its first message once it is open; then the server cancels it. The
    slowest planned link (`min_bandwidth_mbps`) brings a full first chunk (about `chunk_bytes` plus the header) in
    a fraction of this."""

    idle_timeout_s: float = 30.0
    """How long a stream may go without a chunk (a push waiting for the client's next one, a pull waiting for the
    client to take one); then the server cancels it and frees its buffer. A stream must also keep an average of
    `min_bandwidth_mbps` after its first `rpc_timeout_s`, so trickling a byte at a time does not hold it open."""

    max_buffered_mb: float = 4096.0
    """Payload MiB that all pushes in flight may declare together; a push whose header would exceed it is refused
    with UNAVAILABLE (retry later) before anything is allocated. At least `max_payload_mb`."""

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
            ("max_streams", self.max_streams >= 1, "must be >= 1"),
            (
                "max_streams_per_island",
                1 <= self.max_streams_per_island <= self.max_streams,
                f"must be in 1..max_streams ({self.max_streams})",
            ),
            ("max_unary_calls", self.max_unary_calls >= 1, "must be >= 1"),
            (
                "max_unary_calls_per_island",
                1 <= self.max_unary_calls_per_island <= self.max_unary_calls,
                f"must be in 1..max_unary_calls ({self.max_unary_calls})",
            ),
            ("max_presence_streams", self.max_presence_streams >= 1, "must be >= 1"),
            ("keepalive_s", self.keepalive_s >= 0, "must be >= 0 (0: off)"),
            ("keepalive_timeout_s", self.keepalive_timeout_s > 0, "must be > 0"),
            (
                "max_pending_calls",
                self.max_pending_calls >= self.server_threads,
                f"must be >= the server's threads (max_streams + max_unary_calls + max_presence_streams + "
                f"{SPARE_THREADS})",
            ),
            ("first_message_timeout_s", self.first_message_timeout_s > 0, "must be > 0"),
            ("idle_timeout_s", self.idle_timeout_s > 0, "must be > 0"),
            (
                "max_buffered_mb",
                self.max_buffered_mb >= self.max_payload_mb,
                f"must be >= max_payload_mb ({self.max_payload_mb})",
            ),
        ]
        for key, ok, why in checks:
            if not ok:
                raise TransportConfigError(f"transport.{key} = {getattr(self, key)!r} {why}")

    @property
    def server_threads(self) -> int:
        """Threads of the server's pool: one per stream, unary and presence slot, and spares that answer refusals
        at once."""
        return self.max_streams + self.max_unary_calls + self.max_presence_streams + SPARE_THREADS

    @property
    def max_buffered_bytes(self) -> int:
        """``max_buffered_mb`` in bytes."""
        return int(self.max_buffered_mb * MIB)

    def for_islands(self, n_islands: int, fragments: int = 1) -> TransportConfig:
        """These limits, raised where needed so that `n_islands` honest islands never meet them: each may hold a
        push and a pull stream per fragment (Streaming DiLoCo's P lanes of each, `IslandSync.lanes` and
        `pulls`, all on the wire at once when the coordinator waits for a slow island) and a retry beside them,
        and a heartbeat beside its main thread's join at once. With P = 5 a cap of 4 streams an island refused the
        fifth of an island's pulls (UNAVAILABLE, retried after a backoff): seconds lost per round."""
        per_island = max(self.max_streams_per_island, 2 * fragments + 2)
        streams = max(self.max_streams, 2 * fragments * n_islands, per_island)
        unary = max(self.max_unary_calls, 2 * n_islands)
        presence = max(self.max_presence_streams, 2 * n_islands)
        # gRPC's own queue must hold every thread's call and as many waiting: it only guards memory.
        pending = max(self.max_pending_calls, 2 * (streams + unary + presence + SPARE_THREADS))
        return replace(
            self,
            max_streams=streams,
            max_streams_per_island=per_island,
            max_unary_calls=unary,
            max_presence_streams=presence,
            max_pending_calls=pending,
        )

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

    def server_options(self) -> list[tuple[str, int]]:
        """The server's options: `grpc_options`, and keepalive when it is on. gRPC needs four keys for it: the ping
        interval, how long a ping may go unanswered (both the keepalive and the ping timeout: without the latter a
        silent peer was only noticed at the 1-minute default), and no cap on pings between data frames (an idle
        presence stream sends none)."""
        if not self.keepalive_s:
            return self.grpc_options()
        timeout_ms = round(self.keepalive_timeout_s * 1000)
        return [
            *self.grpc_options(),
            ("grpc.keepalive_time_ms", round(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def stream_deadline_s(self, payload_bytes: int) -> float:
        """Deadline of a streaming RPC carrying ``payload_bytes``."""
        return self.rpc_timeout_s + payload_bytes * 8 / (self.min_bandwidth_mbps * 1e6)
