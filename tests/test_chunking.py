"""Chunking and reassembly: byte-exact round trips, and every malformed stream refused with a reason."""

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.chunking import Reassembler, build_header, iter_chunk_data, payload_digest
from transport.errors import Rejected
from transport.tensors import WireTensor

CODECS = frozenset({"fp32"})


def tensors_of(sizes: list[int], seed: int = 0) -> list[WireTensor]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        a = rng.standard_normal(n).astype("<f4")
        out.append(WireTensor(f"t{i}", "fp32", "float32", (n,), 0, 0, a.tobytes()))
    return out


def reassemble(header, chunks, max_bytes: int = 1 << 30):
    r = Reassembler(header, max_bytes, 1000, CODECS)
    for i, data in chunks:
        r.add(i, data)
    return r.finish()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 700), min_size=0, max_size=6), chunk=st.integers(1, 900))
def test_round_trip_any_sizes_and_chunk_sizes(sizes, chunk):
    tensors = tensors_of(sizes)
    header = build_header(tensors, chunk)
    pieces = list(iter_chunk_data(tensors, chunk))
    assert len(pieces) == header.chunk_count
    assert all(len(p) == chunk for p in pieces[:-1])
    out = reassemble(header, enumerate(pieces))
    assert [bytes(t.payload) for t in out] == [t.payload for t in tensors]
    assert [t.name for t in out] == [t.name for t in tensors]


def test_received_payloads_are_views_of_one_buffer():
    tensors = tensors_of([1000, 3000, 17])
    header = build_header(tensors, 1024)
    out = reassemble(header, enumerate(iter_chunk_data(tensors, 1024)))
    bases = {id(memoryview(t.payload).obj) for t in out}
    assert len(bases) == 1, "payloads must be zero-copy slices of the single reassembly buffer"


def rejected(header, chunks, max_bytes: int = 1 << 30) -> Rejected:
    with pytest.raises(Rejected) as info:
        reassemble(header, chunks, max_bytes)
    return info.value


@pytest.fixture
def stream():
    tensors = tensors_of([600, 500])
    header = build_header(tensors, 1000)
    return header, list(enumerate(iter_chunk_data(tensors, 1000)))


def test_reordered_duplicated_truncated_overflowing(stream):
    header, chunks = stream
    assert len(chunks) == 5
    err = rejected(header, [chunks[0], chunks[2], chunks[1]] + chunks[3:])
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in err.reason
    assert "out of order" in rejected(header, [chunks[0], chunks[0]] + chunks[1:]).reason
    assert "ended after 4 of 5" in rejected(header, chunks[:-1]).reason
    extra = chunks + [(5, b"x")]
    assert "beyond the declared chunk_count" in rejected(header, extra).reason
    big_last = chunks[:-1] + [(4, chunks[-1][1] + b"xx")]
    assert "overflows" in rejected(header, big_last).reason


def test_digest_mismatch(stream):
    header, chunks = stream
    i, data = chunks[2]
    flipped = bytes([data[0] ^ 1]) + data[1:]
    err = rejected(header, chunks[:2] + [(i, flipped)] + chunks[3:])
    assert err.reason == "payload digest mismatch"


def test_oversized_declaration_is_resource_exhausted_before_allocation(stream):
    header, chunks = stream
    err = rejected(header, chunks, max_bytes=header.total_bytes - 1)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    header.total_bytes = 1 << 60  # absurd: must be refused without trying to allocate it
    assert rejected(header, chunks).code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda h: setattr(h, "digest", b"short"), "32 bytes"),
        (lambda h: setattr(h.tensors[0], "nbytes", h.tensors[0].nbytes + 4), "sum to"),
        (lambda h: setattr(h, "chunk_count", 0), "impossible"),
        (lambda h: setattr(h.tensors[1], "name", "t0"), "twice"),
        (lambda h: setattr(h.tensors[1], "codec", "rot13"), "unknown codec"),
        (lambda h: setattr(h.tensors[1], "name", ""), "empty name"),
    ],
)
def test_header_inconsistencies(stream, mutate, words):
    header, chunks = stream
    mutate(header)
    err = rejected(header, chunks)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and words in err.reason


def test_empty_payload_still_has_one_chunk():
    tensors = [WireTensor("e", "fp32", "float32", (0,), 0, 0, b"")]
    header = build_header(tensors, 1024)
    assert header.chunk_count == 1 and header.total_bytes == 0
    assert header.digest == payload_digest(tensors)
    out = reassemble(header, enumerate(iter_chunk_data(tensors, 1024)))
    assert bytes(out[0].payload) == b""


def test_tensors_complete_progressively():
    tensors = tensors_of([300, 10, 700])  # 1200, 40, 2800 bytes
    header = build_header(tensors, 1000)
    r = Reassembler(header, 1 << 20, 100, CODECS)
    seen = []
    for i, data in enumerate(iter_chunk_data(tensors, 1000)):
        r.add(i, data)
        seen.append([t.name for t in r.take_completed()])
    assert seen == [[], ["t0", "t1"], [], [], ["t2"]]
    assert [bytes(t.payload) for t in r.finish()] == [t.payload for t in tensors]


@settings(max_examples=40, deadline=None)
@given(index=st.integers(0, 2**32 - 1), data=st.binary(max_size=300), split=st.integers(0, 300))
def test_wire_fast_path_matches_protobuf(index, data, split):
    from transport import diloco_pb2 as pb
    from transport.wire import encode_data_chunk, parse_pull_chunk, parse_push_chunk

    pieces = (memoryview(data)[:split], memoryview(data)[split:])
    raw = encode_data_chunk(4, index, *pieces)
    assert raw == pb.PushChunk(index=index, data=data).SerializeToString()
    parsed = parse_push_chunk(raw)
    assert parsed.index == index and bytes(parsed.data) == data and not parsed.HasField("header")
    raw = encode_data_chunk(3, index, *pieces)
    assert raw == pb.PullChunk(index=index, data=data).SerializeToString()
    assert bytes(parse_pull_chunk(raw).data) == data


def test_wire_falls_back_to_protobuf_for_anything_else():
    from transport import diloco_pb2 as pb
    from transport.wire import parse_push_chunk

    header = pb.PayloadHeader(total_bytes=3)
    first = pb.PushChunk(index=0, meta=pb.PushMeta(island="i0"), header=header, data=b"abc")
    parsed = parse_push_chunk(first.SerializeToString())
    assert isinstance(parsed, pb.PushChunk) and parsed.meta.island == "i0" and parsed.data == b"abc"
    trailing = (
        pb.PushChunk(index=2, data=b"xy").SerializeToString()
        + pb.PushChunk(header=pb.PayloadHeader(total_bytes=9)).SerializeToString()
    )
    parsed = parse_push_chunk(trailing)  # data then a header: not a plain data chunk
    assert isinstance(parsed, pb.PushChunk) and parsed.header.total_bytes == 9


def test_wire_chunks_equal_message_chunks():
    from transport import diloco_pb2 as pb
    from transport.client_core import push_chunks, push_wire_chunks

    tensors = tensors_of([300, 10, 700])
    meta = pb.PushMeta(run_id="r", island="i0", tokens=1)
    wire = list(push_wire_chunks(meta, tensors, 1000))
    messages = list(push_chunks(meta, tensors, 1000))
    assert [w if isinstance(w, bytes) else w.SerializeToString() for w in wire] == [
        m.SerializeToString() for m in messages
    ]
