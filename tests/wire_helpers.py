"""Test helpers for raw wire traffic: push chunks built by the protobuf runtime itself.

The product sends pushes through ``transport.client_core.push_wire_chunks``, whose data chunks are serialized
by hand (``transport.wire``). Tests that talk to a server through a raw stub, or that check the hand-rolled
encoding, need the same chunks as plain ``pb.PushChunk`` messages built the slow, obviously-right way: this is
that reference, kept out of the product because nothing there needs it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from floor.codec import EncodedTensor
from transport import diloco_pb2 as pb
from transport.chunking import build_header, iter_trailed_views


def push_chunks(meta: pb.PushMeta, tensors: Sequence[EncodedTensor], chunk_bytes: int) -> Iterator[pb.PushChunk]:
    """The chunks of one push as protobuf messages: meta + header on the first, the digest trailer on the last."""
    header = build_header(tensors, chunk_bytes)
    for i, (pieces, digest) in enumerate(iter_trailed_views(tensors, chunk_bytes)):
        data = b"".join(pieces)
        if i == 0:
            yield pb.PushChunk(index=0, meta=meta, header=header, data=data, digest=digest)
        else:
            yield pb.PushChunk(index=i, data=data, digest=digest)
