"""Chunked payload streams: cut encoded tensors into ~1 MiB chunks and put them back together safely.

Sender: the payloads of all tensors form one logical byte stream; `iter_chunk_views` walks it with
``memoryview`` slices, ``chunk_bytes`` at a time, copying nothing (``transport.wire`` then makes the one copy
that becomes the message).
`build_header` describes the stream (tensor metas, chunk count, total bytes) and travels on the first chunk.
The SHA-256 digest of the whole payload is the stream's *trailer*: `iter_trailed_views` hashes each chunk as
it is handed to the wire and attaches the digest to the last one, so sending starts at once instead of after
a full hashing pass over the payload (hashlib releases the GIL on large buffers, so the hash overlaps with
gRPC's own work).

Receiver: `Reassembler` checks the declared header against limits *before* allocating (oversize ->
RESOURCE_EXHAUSTED), preallocates exactly one buffer of the declared size, writes each chunk into it in
order (duplicate, reordered, overflowing or missing chunks -> INVALID_ARGUMENT), hashes each chunk as it
lands, takes the digest from the last chunk's trailer (refused on any other chunk), and on `finish` checks
count, size and digest; the returned tensors' payloads are zero-copy slices of that buffer.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from transport import diloco_pb2 as pb
from transport.errors import Rejected
from transport.tensors import from_meta, to_meta

if TYPE_CHECKING:  # transport.codecs imports JAX; the wire only needs its type
    from transport.codecs import EncodedTensor

DIGEST_BYTES = 32
BACKGROUND_MIN_BYTES = 8 << 20
"""Payloads at least this big are hashed by a helper thread (sender) / into pooled buffers (receiver)."""
_HASH_STEP = 1 << 20


def new_hasher() -> hashlib._Hash:
    """The payload digest: stdlib SHA-256 (32 bytes).

    Integrity, not identity, is what this digest is for, and SHA-256 runs on the CPU's SHA extensions: measured
    2.6x faster than blake2b here (0.44 vs 0.17 GB/s on a loaded core), which is most of a stream's CPU cost.
    Parameter digests (transport.digest) stay blake2b (docs/architecture.md, "Digests").
    """
    return hashlib.sha256()


def payload_digest(tensors: Sequence[EncodedTensor]) -> bytes:
    """SHA-256 of the concatenated payloads, in order (what the stream's trailer declares)."""
    h = new_hasher()
    for t in tensors:
        h.update(t.payload)
    return h.digest()


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    """Chunks needed for ``total_bytes``: at least one, which carries the header."""
    return max(1, -(-total_bytes // chunk_bytes))


def build_header(tensors: Sequence[EncodedTensor], chunk_bytes: int) -> pb.PayloadHeader:
    """The stream's header: tensor metas, chunk count and total bytes (reads no payload byte)."""
    metas = [to_meta(t) for t in tensors]
    total = sum(m.nbytes for m in metas)
    return pb.PayloadHeader(tensors=metas, chunk_count=chunk_count(total, chunk_bytes), total_bytes=total)


def iter_chunk_views(tensors: Sequence[EncodedTensor], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """Walk the concatenated payloads in pieces of ``chunk_bytes`` (the last may be shorter), copying nothing.

    Each item is the list of ``memoryview`` slices (of one or more tensors) that make up one chunk. Always
    yields at least one (possibly empty) item so the header has a chunk to ride on.
    """
    pending: list[memoryview] = []
    pending_bytes = 0
    yielded = False
    for t in tensors:
        view = memoryview(t.payload).cast("B")
        pos = 0
        while pos < view.nbytes:
            take = min(chunk_bytes - pending_bytes, view.nbytes - pos)
            pending.append(view[pos : pos + take])
            pending_bytes += take
            pos += take
            if pending_bytes == chunk_bytes:
                yield pending
                yielded = True
                pending, pending_bytes = [], 0
    if pending_bytes or not yielded:
        yield pending


class _BackgroundDigest:
    """`payload_digest` computed by a helper thread while the chunks stream (hashlib releases the GIL)."""

    def __init__(self, tensors: Sequence[EncodedTensor]) -> None:
        self._views = [memoryview(t.payload).cast("B") for t in tensors]
        self._cancelled = threading.Event()
        self._digest = b""
        self._thread = threading.Thread(target=self._run, name="diloco-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        hasher = new_hasher()
        for view in self._views:
            for pos in range(0, view.nbytes, _HASH_STEP):
                if self._cancelled.is_set():
                    return
                hasher.update(view[pos : pos + _HASH_STEP])
        self._digest = hasher.digest()

    def result(self) -> bytes:
        """Wait for the digest."""
        self._thread.join()
        return self._digest

    def cancel(self) -> None:
        """Stop hashing early (the stream was abandoned)."""
        self._cancelled.set()


def iter_trailed_views(
    tensors: Sequence[EncodedTensor], chunk_bytes: int
) -> Iterator[tuple[list[memoryview], bytes]]:
    """`iter_chunk_views` with each chunk's trailer: ``b""``, except the digest of the payload on the last.

    The digest is computed while the chunks stream: for payloads of `BACKGROUND_MIN_BYTES` or more by a
    helper thread that starts with the first chunk (so hashing overlaps gRPC's sending, which pulls the next
    chunk only once the previous write is done), for small ones inline, chunk by chunk.
    """
    if sum(memoryview(t.payload).nbytes for t in tensors) >= BACKGROUND_MIN_BYTES:
        background = _BackgroundDigest(tensors)
        try:
            views = iter_chunk_views(tensors, chunk_bytes)
            pending = next(views)
            for pieces in views:  # one chunk of lookahead tells which chunk is the last
                yield pending, b""
                pending = pieces
            yield pending, background.result()
        finally:
            background.cancel()
        return
    hasher = new_hasher()
    views = iter_chunk_views(tensors, chunk_bytes)
    pending = next(views)  # always at least one chunk
    for pieces in views:  # one chunk of lookahead tells which chunk is the last
        for piece in pending:
            hasher.update(piece)
        yield pending, b""
        pending = pieces
    for piece in pending:
        hasher.update(piece)
    yield pending, hasher.digest()


def iter_chunk_data(tensors: Sequence[EncodedTensor], chunk_bytes: int) -> Iterator[bytes]:
    """Like `iter_chunk_views`, each chunk as one ``bytes`` (what a protobuf message field needs)."""
    for pieces in iter_chunk_views(tensors, chunk_bytes):
        yield pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)


class Reassembler:
    """Receive one chunked payload into a single preallocated buffer, checking everything on the way."""

    def __init__(
        self,
        header: pb.PayloadHeader,
        max_payload_bytes: int,
        max_tensors: int,
        known_codecs: frozenset[str],
        pool: BufferPool | None = None,
    ) -> None:
        check_header(header, max_payload_bytes, max_tensors, known_codecs)
        self.header = header
        # The one payload-sized allocation of the receive path (reused across streams when the pool has a
        # free buffer); chunks are written straight into it. Bytes past `_offset` are never exposed.
        self._buf = (pool or RECEIVE_BUFFERS).acquire(header.total_bytes)
        self._view = memoryview(self._buf)[: header.total_bytes]
        self._offset = 0
        self._next_index = 0
        self._hasher = new_hasher()
        self._digest = b""
        ends = itertools.accumulate(m.nbytes for m in header.tensors)
        self._spans = [(m, end - m.nbytes, end) for m, end in zip(header.tensors, ends, strict=True)]
        self._next_tensor = 0

    @property
    def received_bytes(self) -> int:
        """Payload bytes written so far."""
        return self._offset

    def add(self, index: int, data: bytes | memoryview, digest: bytes = b"") -> None:
        """Write chunk ``index``; chunks must arrive exactly once and in order; the last carries ``digest``."""
        if index != self._next_index:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunk {index} out of order or duplicated (expected chunk {self._next_index})",
            )
        if index >= self.header.chunk_count:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunk {index} beyond the declared chunk_count {self.header.chunk_count}",
            )
        last = index == self.header.chunk_count - 1
        if last and len(digest) != DIGEST_BYTES:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the last chunk must carry the payload digest: {DIGEST_BYTES} bytes of SHA-256 (got {len(digest)})",
            )
        if digest and not last:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunk {index} carries the payload digest; only the last chunk "
                f"(index {self.header.chunk_count - 1}) may",
            )
        n = len(data)
        if index > 0 and n == 0:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {index} is empty")
        end = self._offset + n
        if end > self.header.total_bytes:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunk {index} overflows the declared total_bytes {self.header.total_bytes}",
            )
        self._view[self._offset : end] = data
        self._hasher.update(data)
        self._offset = end
        self._next_index += 1
        if last:
            self._digest = bytes(digest)

    @property
    def digest(self) -> bytes:
        """The payload digest the sender declared (its trailer); empty until the last chunk has arrived."""
        return self._digest

    def finish(self) -> list[EncodedTensor]:
        """Check count, size and digest; return the tensors (payloads are slices of the buffer)."""
        if self._next_index != self.header.chunk_count:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stream ended after {self._next_index} of {self.header.chunk_count} chunks",
            )
        if self._offset != self.header.total_bytes:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"received {self._offset} bytes, header declared {self.header.total_bytes}",
            )
        if self._hasher.digest() != self._digest:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "payload digest mismatch")
        return [from_meta(m, self._view[a:b]) for m, a, b in self._spans]

    def take_completed(self) -> list[EncodedTensor]:
        """Tensors whose bytes have all arrived since the last call (not yet digest-checked).

        Lets the receiver decode tensor by tensor while the rest of the stream is still arriving; nothing
        decoded this way may be used before `finish` has verified the digest.
        """
        done = []
        while self._next_tensor < len(self._spans) and self._spans[self._next_tensor][2] <= self._offset:
            meta, a, b = self._spans[self._next_tensor]
            done.append(from_meta(meta, self._view[a:b]))
            self._next_tensor += 1
        return done


class BufferPool:
    """Reuse of large reassembly buffers from one stream to the next.

    A fresh payload-sized buffer costs a page fault per 4 KiB page on first touch, which on a VM costs as
    much as hashing the payload (0.15-0.7 s per 256 MiB measured here), and glibc serves such sizes with a
    fresh ``mmap`` every time. A coordinator receives same-sized pushes round after round, so the pool keeps
    the last ``keep`` buffers of `BACKGROUND_MIN_BYTES` or more and hands one out again once nothing refers
    to it any more: no payload view, no array and no tensor of an earlier stream can see it being reused.
    The cost is up to ``keep`` idle buffers of memory.
    """

    def __init__(self, keep: int = 2, min_bytes: int = BACKGROUND_MIN_BYTES) -> None:
        self.keep = keep
        self.min_bytes = min_bytes
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> bytearray:
        """A buffer of at least ``nbytes`` (at most twice that when reused); contents are unspecified."""
        if nbytes < self.min_bytes or self.keep <= 0:
            return bytearray(nbytes)
        with self._lock:
            for i in range(len(self._buffers)):
                # Free when only the pool's list (and getrefcount's argument) refers to it: every memoryview,
                # and so every tensor payload and numpy array built on one, holds a reference to its buffer.
                if nbytes <= len(self._buffers[i]) <= 2 * nbytes and sys.getrefcount(self._buffers[i]) <= 2:
                    self._buffers.append(self._buffers.pop(i))  # most recently used last
                    return self._buffers[-1]
            fresh = bytearray(nbytes)
            self._buffers.append(fresh)
            del self._buffers[: -self.keep]  # forget the oldest; whoever still uses it keeps it alive
            return fresh


RECEIVE_BUFFERS = BufferPool()
"""The process's default pool of reassembly buffers."""


def check_header(
    header: pb.PayloadHeader, max_payload_bytes: int, max_tensors: int, known_codecs: frozenset[str]
) -> None:
    """Check a declared header against limits and itself, before any allocation."""
    if header.total_bytes > max_payload_bytes:
        raise Rejected(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"declared payload {header.total_bytes} bytes exceeds the maximum {max_payload_bytes}",
        )
    if len(header.tensors) > max_tensors:
        raise Rejected(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"declared {len(header.tensors)} tensors, the maximum is {max_tensors}",
        )
    declared = sum(m.nbytes for m in header.tensors)
    if declared != header.total_bytes:
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor sizes sum to {declared} bytes but total_bytes is {header.total_bytes}",
        )
    # Every chunk after the first carries at least one byte, so a sane count is bounded by the size.
    if not 1 <= header.chunk_count <= max(1, header.total_bytes):
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"chunk_count {header.chunk_count} is impossible for {header.total_bytes} bytes",
        )
    seen: set[str] = set()
    for meta in header.tensors:
        if not meta.name:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "tensor with an empty name")
        if meta.name in seen:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {meta.name!r} appears twice")
        seen.add(meta.name)
        if meta.codec not in known_codecs:
            known = ", ".join(sorted(known_codecs))
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {meta.name!r}: unknown codec {meta.codec!r} (known: {known})",
            )
        if any(d < 0 for d in meta.shape):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {meta.name!r}: negative dimension")
