"""Chunked payload streams: cut encoded tensors into ~1 MiB chunks and put them back together safely.

Sender: the payloads of all tensors form one logical byte stream; `iter_chunk_views` walks it with
``memoryview`` slices, ``chunk_bytes`` at a time, copying nothing (``transport.wire`` then makes the one copy
that becomes the message).
`build_header` describes the stream (tensor metas, chunk count, total bytes, blake2b digest) and travels
on the first chunk.

Receiver: `Reassembler` checks the declared header against limits *before* allocating (oversize ->
RESOURCE_EXHAUSTED), preallocates exactly one buffer of the declared size, writes each chunk into it in
order (duplicate, reordered, overflowing or missing chunks -> INVALID_ARGUMENT), hashes as it goes, and on
`finish` checks count, size and digest; the returned tensors' payloads are zero-copy slices of that buffer.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence

import grpc

from transport import diloco_pb2 as pb
from transport.errors import Rejected
from transport.tensors import EncodedTensorLike, from_meta, to_meta

DIGEST_BYTES = 32


def new_hasher() -> hashlib.blake2b:
    """The payload digest: stdlib blake2b with a 32-byte digest."""
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


def payload_digest(tensors: Sequence[EncodedTensorLike]) -> bytes:
    """blake2b of the concatenated payloads, in order (what the header declares)."""
    h = new_hasher()
    for t in tensors:
        h.update(t.payload)
    return h.digest()


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    """Chunks needed for ``total_bytes``: at least one, which carries the header."""
    return max(1, -(-total_bytes // chunk_bytes))


def build_header(tensors: Sequence[EncodedTensorLike], chunk_bytes: int) -> pb.PayloadHeader:
    """The stream's header: tensor metas, chunk count, total bytes and digest."""
    metas = [to_meta(t) for t in tensors]
    total = sum(m.nbytes for m in metas)
    return pb.PayloadHeader(
        tensors=metas,
        chunk_count=chunk_count(total, chunk_bytes),
        total_bytes=total,
        digest=payload_digest(tensors),
    )


def iter_chunk_views(tensors: Sequence[EncodedTensorLike], chunk_bytes: int) -> Iterator[list[memoryview]]:
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


def iter_chunk_data(tensors: Sequence[EncodedTensorLike], chunk_bytes: int) -> Iterator[bytes]:
    """Like `iter_chunk_views`, each chunk as one ``bytes`` (what a protobuf message field needs)."""
    for pieces in iter_chunk_views(tensors, chunk_bytes):
        yield pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)


class Reassembler:
    """Receive one chunked payload into a single preallocated buffer, checking everything on the way."""

    def __init__(
        self, header: pb.PayloadHeader, max_payload_bytes: int, max_tensors: int, known_codecs: frozenset[str]
    ) -> None:
        check_header(header, max_payload_bytes, max_tensors, known_codecs)
        self.header = header
        # The one payload-sized allocation of the receive path; chunks are written straight into it.
        self._buf = bytearray(header.total_bytes)
        self._view = memoryview(self._buf)
        self._offset = 0
        self._next_index = 0
        self._hasher = new_hasher()
        ends = itertools.accumulate(m.nbytes for m in header.tensors)
        self._spans = [(m, end - m.nbytes, end) for m, end in zip(header.tensors, ends, strict=True)]
        self._next_tensor = 0

    @property
    def received_bytes(self) -> int:
        """Payload bytes written so far."""
        return self._offset

    def add(self, index: int, data: bytes | memoryview) -> None:
        """Write chunk ``index``; chunks must arrive exactly once and in order."""
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

    def finish(self) -> list[EncodedTensorLike]:
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
        if self._hasher.digest() != self.header.digest:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "payload digest mismatch")
        return [from_meta(m, self._view[a:b]) for m, a, b in self._spans]

    def take_completed(self) -> list[EncodedTensorLike]:
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
    if len(header.digest) != DIGEST_BYTES:
        raise Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"digest must be {DIGEST_BYTES} bytes of blake2b (got {len(header.digest)})",
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
