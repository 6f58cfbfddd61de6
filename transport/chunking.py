"""Chunked payload streams: cut encoded tensors into ~1 MiB chunks and put them back together safely.

Sender: the payloads of all tensors form one logical byte stream; `iter_chunk_views` walks it with
``memoryview`` slices, ``chunk_bytes`` at a time, copying nothing (``transport.wire`` then makes the one copy
that becomes the message).
`build_header` describes the stream (tensor metas, chunk count, total bytes) and travels on the first chunk.
The SHA-256 digest of the whole payload is the stream's *trailer*: `iter_trailed_views` hashes each chunk as
it is handed to the wire and attaches the digest to the last one, so sending starts at once instead of after
a full hashing pass over the payload (hashlib releases the GIL on large buffers, so the hash overlaps with
gRPC's own work).

Receiver: `Reassembler` checks the declared header against limits and against itself *before* allocating:
oversize -> RESOURCE_EXHAUSTED; each tensor's declared size must be what its shape and codec make
(``floor.codec.raw_payload_range``: one size, or for sparse the range its header may choose; with zstd, at most
zstd's worst case for that size), so a header
cannot claim a large buffer for a small tensor. The declared total is reserved from the server's `ByteBudget`
(all streams in flight together; UNAVAILABLE, "retry later", beyond it). Then it maps exactly one buffer of that
size, writes each chunk into it in order (duplicate, reordered, overflowing or missing chunks ->
INVALID_ARGUMENT), hashes each chunk as it lands, takes the digest from the last chunk's trailer (refused on
any other chunk), and on `finish` checks count, size and digest; the returned tensors' payloads are zero-copy
slices of that buffer. Buffers are anonymous memory maps: the pages a stalled stream never wrote cost nothing,
and `Reassembler.close` returns the reservation and, for a stream that did not finish, the whole mapping to
the operating system (a rejected stream leaves no memory behind).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import mmap
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc

from floor import codec
from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.errors import Rejected
from transport.tensors import from_meta, to_meta

DIGEST_BYTES = 32
BACKGROUND_MIN_BYTES = 8 << 20
"""Payloads at least this big are hashed by a helper thread (`_HashingThread`, both ends) and received into pooled
buffers."""
_HASH_STEP = 1 << 20
LAZY_MIN_BYTES = 64 << 10
"""Receive buffers at least this big are anonymous memory maps: zero pages until written, unmapped when freed."""


def new_hasher() -> hashlib._Hash:
    """The payload digest: stdlib SHA-256 (32 bytes).

    Integrity, not identity, is what this digest is for, and SHA-256 runs on the CPU's SHA extensions, which makes
    it faster than blake2b; hashing is most of a stream's CPU cost. Parameter digests (pytrees.digest) are
    XXH3-128 instead: they prove bit-identity, not what a sender streamed (docs/architecture.md, "Digests").
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


class _HashingThread:
    """SHA-256 of the byte ranges handed to it, in order, computed by a helper thread: hashlib releases the GIL on
    large buffers, so hashing overlaps gRPC moving the chunks.

    A sender hands it the whole payload at once (`iter_trailed_views`; the digest travels on the last chunk). A
    receiver hands it each range of its buffer once written (`Reassembler`), so hashing is off its receiving thread,
    which is on the path of a push through the coordinator and of a pull through an island. A range handed
    over is never written again. `cancel` stops it without hashing what is left (the stream was given up).
    """

    def __init__(self) -> None:
        self._ranges: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._hasher = new_hasher()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="diloco-digest", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (view := self._ranges.get()) is not None:
            if not self._cancelled:
                self._hasher.update(view)

    def feed(self, view: memoryview) -> None:
        """Hash ``view`` after everything handed over before it, in steps of `_HASH_STEP` (where `cancel` acts)."""
        for pos in range(0, view.nbytes, _HASH_STEP):
            self._ranges.put(view[pos : pos + _HASH_STEP])

    def digest(self) -> bytes:
        """The digest of everything handed over (waits for the helper to get there)."""
        self._ranges.put(None)
        self._thread.join()
        return self._hasher.digest()

    def cancel(self) -> None:
        """Stop, hashing nothing more."""
        self._cancelled = True
        self._ranges.put(None)


def iter_trailed_views(tensors: Sequence[EncodedTensor], chunk_bytes: int) -> Iterator[tuple[list[memoryview], bytes]]:
    """`iter_chunk_views` with each chunk's trailer: ``b""``, except the digest of the payload on the last.

    The digest is computed while the chunks stream: for payloads of `BACKGROUND_MIN_BYTES` or more by a
    helper thread that starts with the first chunk (so hashing overlaps gRPC's sending, which pulls the next
    chunk only once the previous write is done), for small ones inline, chunk by chunk.
    """
    if sum(memoryview(t.payload).nbytes for t in tensors) >= BACKGROUND_MIN_BYTES:
        hashing = _HashingThread()
        try:
            for t in tensors:
                hashing.feed(memoryview(t.payload).cast("B"))
            yield from _trailed(iter_chunk_views(tensors, chunk_bytes), hashing.digest)
        finally:
            hashing.cancel()
        return
    hasher = new_hasher()

    def hashed(views: Iterator[list[memoryview]]) -> Iterator[list[memoryview]]:
        for pieces in views:
            for piece in pieces:
                hasher.update(piece)
            yield pieces

    yield from _trailed(hashed(iter_chunk_views(tensors, chunk_bytes)), hasher.digest)


def _trailed(
    views: Iterator[list[memoryview]], digest: Callable[[], bytes]
) -> Iterator[tuple[list[memoryview], bytes]]:
    """Each chunk with ``b""``, the last with ``digest()`` (asked for only then)."""
    pending = next(views)  # always at least one chunk
    for pieces in views:  # one chunk of lookahead tells which chunk is the last
        yield pending, b""
        pending = pieces
    yield pending, digest()


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
        budget: ByteBudget | None = None,
    ) -> None:
        check_header(header, max_payload_bytes, max_tensors, known_codecs)
        self.header = header
        self._budget = budget
        if budget is not None:
            budget.reserve(header.total_bytes)
        self._pool = pool or RECEIVE_BUFFERS
        self._finished = False
        # The one payload-sized allocation of the receive path (reused across streams when the pool has a
        # free buffer); chunks are written straight into it. Bytes past `_offset` are never exposed.
        self._buf: bytearray | mmap.mmap | None = None
        self._hashing: _HashingThread | None = None
        """Large payloads are hashed by a helper thread as they land (started last, below); `close` stops it."""
        try:
            self._buf = self._pool.acquire(header.total_bytes)
        except BaseException:
            self.close()
            raise
        self._view = memoryview(self._buf)[: header.total_bytes]
        self._offset = 0
        self._next_index = 0
        self._hasher = new_hasher()
        self._digest = b""
        ends = itertools.accumulate(m.nbytes for m in header.tensors)
        self._spans = [(m, end - m.nbytes, end) for m, end in zip(header.tensors, ends, strict=True)]
        self._next_tensor = 0
        if header.total_bytes >= BACKGROUND_MIN_BYTES:
            self._hashing = _HashingThread()

    @property
    def received_chunks(self) -> int:
        """Chunks written so far."""
        return self._next_index

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
        if self._hashing is not None:
            self._hashing.feed(self._view[self._offset : end])
        else:
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
        computed = self._hashing.digest() if self._hashing is not None else self._hasher.digest()
        self._hashing = None
        if computed != self._digest:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "payload digest mismatch")
        self._finished = True
        return [from_meta(m, self._view[a:b]) for m, a, b in self._spans]

    def close(self) -> None:
        """Return the budget reservation; a stream that did not finish also gives its buffer up (the pool forgets
        it, so the memory goes back to the system once the last view of it is gone). Idempotent."""
        if self._budget is not None:
            self._budget.release(self.header.total_bytes)
            self._budget = None
        if self._hashing is not None:
            self._hashing.cancel()
            self._hashing = None
        if self._buf is not None and not self._finished:
            self._pool.forget(self._buf)
        self._buf = None
        self._view = memoryview(b"")

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

    A fresh payload-sized buffer (an anonymous map, `_fresh`) costs a page fault per 4 KiB page on first
    touch, which on a VM costs as much as hashing the payload. A
    coordinator receives same-sized pushes round after round, so the pool keeps the last ``keep`` buffers of
    `BACKGROUND_MIN_BYTES` or more and hands one out again once nothing refers to it any more: no payload
    view, no array and no tensor of an earlier stream can see it being reused. The cost is up to ``keep``
    idle buffers of memory; a stream that fails makes the pool `forget` its buffer, so hostile streams
    cannot park memory here.
    """

    def __init__(self, keep: int = 2, min_bytes: int = BACKGROUND_MIN_BYTES) -> None:
        self.keep = keep
        self.min_bytes = min_bytes
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> bytearray | mmap.mmap:
        """A buffer of at least ``nbytes`` (at most twice that when reused); contents are unspecified."""
        if nbytes < self.min_bytes or self.keep <= 0:
            return _fresh(nbytes)
        with self._lock:
            for i in range(len(self._buffers)):
                # Free when only the pool's list (and getrefcount's argument) refers to it: every memoryview,
                # and so every tensor payload and numpy array built on one, holds a reference to its buffer.
                if nbytes <= len(self._buffers[i]) <= 2 * nbytes and sys.getrefcount(self._buffers[i]) <= 2:
                    self._buffers.append(self._buffers.pop(i))  # most recently used last
                    return self._buffers[-1]
            fresh = _fresh(nbytes)
            self._buffers.append(fresh)
            del self._buffers[: -self.keep]  # forget the oldest; whoever still uses it keeps it alive
            return fresh

    def forget(self, buffer: bytearray | mmap.mmap) -> None:
        """Drop ``buffer`` from the pool (a rejected stream's: its memory should go, not wait for reuse)."""
        with self._lock:
            self._buffers = [b for b in self._buffers if b is not buffer]


def _fresh(nbytes: int) -> bytearray | mmap.mmap:
    """A new receive buffer: an anonymous map from `LAZY_MIN_BYTES` up (memory only for the pages written), else a
    small bytearray."""
    try:
        return mmap.mmap(-1, nbytes) if nbytes >= LAZY_MIN_BYTES else bytearray(nbytes)
    except (OSError, MemoryError, OverflowError):
        raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot allocate a {nbytes}-byte buffer now") from None


class ByteBudget:
    """Payload bytes that all streams in flight may declare together (``transport.max_buffered_mb``).

    Each stream reserves its declared total before its buffer exists and returns it when it ends, accepted or
    not; a stream whose reservation does not fit is refused with UNAVAILABLE (retry later). Thread-safe.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Bytes reserved now."""
        return self._used

    def reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes`` or refuse with UNAVAILABLE (retry later)."""
        with self._lock:
            if self._used + nbytes > self.limit:
                raise Rejected(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{nbytes} more payload bytes would exceed the {self.limit} bytes all streams in flight may "
                    f"hold ({self._used} held now); retry later",
                )
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        """Return a reservation."""
        with self._lock:
            self._used -= nbytes


RECEIVE_BUFFERS = BufferPool()
"""The process's default pool of reassembly buffers."""

ONE_OFF_BUFFERS = BufferPool(keep=0)
"""Reassembly buffers of payloads that come once, not round after round (a full θ pulled at a join or a resync):
each goes with the last array over it. Kept in `RECEIVE_BUFFERS`, an island's full θ would stay there idle for the
process's life once its global copy moved on: the updates that follow are too small to reuse it."""


def check_header(
    header: pb.PayloadHeader, max_payload_bytes: int, max_tensors: int, known_codecs: frozenset[str]
) -> None:
    """Check a declared header against limits and itself, before any allocation (the codec names first, then
    each tensor's size against its shape and codec: `check_declared_size`)."""
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
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for meta in header.tensors:
        if not meta.name:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "tensor with an empty name")
        if meta.offset and len(meta.offset) != len(meta.shape):
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {meta.name!r}: a piece's offset has {len(meta.offset)} indices, its shape "
                f"{len(meta.shape)} dimensions",
            )
        place = (meta.name, tuple(meta.offset))
        if place in seen:
            where = f" piece at {place[1]}" if meta.offset else ""
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {meta.name!r}{where} appears twice")
        seen.add(place)
        if meta.codec not in known_codecs:
            known = ", ".join(sorted(known_codecs))
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {meta.name!r}: unknown codec {meta.codec!r} (known: {known})",
            )
        if any(d < 0 for d in meta.shape):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {meta.name!r}: negative dimension")
        check_declared_size(meta)


def zstd_bound(nbytes: int) -> int:
    """The most bytes zstd can turn ``nbytes`` into (``ZSTD_COMPRESSBOUND`` of zstd.h)."""
    small = (128 << 10) - nbytes >> 11 if nbytes < 128 << 10 else 0
    return nbytes + (nbytes >> 8) + small


def check_declared_size(meta: pb.TensorMeta) -> None:
    """A tensor's declared ``nbytes`` is what its shape and codec make: exactly, or without zstd's worst case.

    Checked from the header alone, before any buffer exists, so that a tiny tensor cannot book a huge buffer.
    """
    name = meta.name
    if len(meta.shape) > codec.MAX_NDIM:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {name!r}: more than {codec.MAX_NDIM} dimensions")
    blocks = meta.codec in codec.QMAX or meta.codec == "sparse"
    if blocks and not (0 < meta.block_size <= codec.MAX_BLOCK_SIZE and meta.block_size % 2 == 0):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {name!r}: invalid block size {meta.block_size}")
    if not 0 <= meta.zstd_level <= codec.MAX_ZSTD_LEVEL:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {name!r}: invalid zstd level {meta.zstd_level}")
    least, raw = codec.raw_payload_range(meta.codec, math.prod(meta.shape), meta.block_size)
    if meta.zstd_level == 0 and not least <= meta.nbytes <= raw:
        size = f"{raw}" if least == raw else f"{least} to {raw}"
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor {name!r} declares {meta.nbytes} bytes; {meta.codec} of shape {tuple(meta.shape)} is {size}",
        )
    if meta.zstd_level and not 0 < meta.nbytes <= zstd_bound(raw):
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tensor {name!r} declares {meta.nbytes} zstd bytes; {meta.codec} of shape {tuple(meta.shape)} "
            f"compresses to at most {zstd_bound(raw)}",
        )
