"""Chunking and reassembly: byte-exact round trips, the digest trailer, buffer reuse, and every malformed stream
refused with a reason."""

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.harness.procs import wait_until
from floor.codec import EncodedTensor
from transport.chunking import (
    BufferPool,
    Reassembler,
    build_header,
    iter_chunk_data,
    iter_trailed_views,
    payload_digest,
)
from transport.errors import Rejected

CODECS = frozenset({"fp32"})


def tensors_of(sizes: list[int], seed: int = 0) -> list[EncodedTensor]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        a = rng.standard_normal(n).astype("<f4")
        out.append(EncodedTensor(f"t{i}", "fp32", "float32", (n,), 0, 0, a.tobytes()))
    return out


def trailed(tensors, chunk: int) -> list[tuple[int, bytes, bytes]]:
    """(index, data, digest trailer) of each chunk, as the wire carries them."""
    return [(i, b"".join(p), d) for i, (p, d) in enumerate(iter_trailed_views(tensors, chunk))]


def reassemble(header, chunks, max_bytes: int = 1 << 30):
    r = Reassembler(header, max_bytes, 1000, CODECS)
    for i, data, digest in chunks:
        r.add(i, data, digest)
    return r.finish()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 700), min_size=0, max_size=6), chunk=st.integers(1, 900))
def test_round_trip_any_sizes_and_chunk_sizes(sizes, chunk):
    tensors = tensors_of(sizes)
    header = build_header(tensors, chunk)
    pieces = list(iter_chunk_data(tensors, chunk))
    assert len(pieces) == header.chunk_count
    assert all(len(p) == chunk for p in pieces[:-1])
    chunks = trailed(tensors, chunk)
    assert [c[1] for c in chunks] == pieces
    assert [c[2] for c in chunks] == [b""] * (len(pieces) - 1) + [payload_digest(tensors)]
    out = reassemble(header, chunks)
    assert [bytes(t.payload) for t in out] == [t.payload for t in tensors]
    assert [t.name for t in out] == [t.name for t in tensors]


def test_received_payloads_are_views_of_one_buffer():
    tensors = tensors_of([1000, 3000, 17])
    header = build_header(tensors, 1024)
    out = reassemble(header, trailed(tensors, 1024))
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
    return header, trailed(tensors, 1000)


def test_reordered_duplicated_truncated_overflowing(stream):
    header, chunks = stream
    assert len(chunks) == 5
    err = rejected(header, [chunks[0], chunks[2], chunks[1]] + chunks[3:])
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in err.reason
    assert "out of order" in rejected(header, [chunks[0], chunks[0]] + chunks[1:]).reason
    assert "ended after 4 of 5" in rejected(header, chunks[:-1]).reason
    extra = chunks + [(5, b"x", b"")]
    assert "beyond the declared chunk_count" in rejected(header, extra).reason
    i, data, digest = chunks[-1]
    big_last = chunks[:-1] + [(i, data + b"xx", digest)]
    assert "overflows" in rejected(header, big_last).reason


def test_digest_trailer_only_on_the_last_chunk(stream):
    header, chunks = stream
    i, data, digest = chunks[-1]
    err = rejected(header, chunks[:-1] + [(i, data, b"")])
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "last chunk must carry the payload digest" in err.reason
    assert "32 bytes" in rejected(header, chunks[:-1] + [(i, data, b"short")]).reason
    early = [chunks[0], (1, chunks[1][1], digest), *chunks[2:]]
    assert "only the last chunk" in rejected(header, early).reason


def test_digest_mismatch(stream):
    header, chunks = stream
    i, data, digest = chunks[2]
    flipped = bytes([data[0] ^ 1]) + data[1:]
    err = rejected(header, chunks[:2] + [(i, flipped, digest)] + chunks[3:])
    assert err.reason == "payload digest mismatch"
    i, data, digest = chunks[-1]
    forged = bytes([digest[0] ^ 1]) + digest[1:]
    assert rejected(header, chunks[:-1] + [(i, data, forged)]).reason == "payload digest mismatch"


def test_oversized_declaration_is_resource_exhausted_before_allocation(stream):
    header, chunks = stream
    err = rejected(header, chunks, max_bytes=header.total_bytes - 1)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    header.total_bytes = 1 << 60  # absurd: must be refused without trying to allocate it
    assert rejected(header, chunks).code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "mutate, words",
    [
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
    tensors = [EncodedTensor("e", "fp32", "float32", (0,), 0, 0, b"")]
    header = build_header(tensors, 1024)
    assert header.chunk_count == 1 and header.total_bytes == 0
    chunks = trailed(tensors, 1024)
    assert chunks == [(0, b"", payload_digest(tensors))]
    out = reassemble(header, chunks)
    assert bytes(out[0].payload) == b""


def test_tensors_complete_progressively():
    tensors = tensors_of([300, 10, 700])  # 1200, 40, 2800 bytes
    header = build_header(tensors, 1000)
    r = Reassembler(header, 1 << 20, 100, CODECS)
    seen = []
    for i, data, digest in trailed(tensors, 1000):
        r.add(i, data, digest)
        seen.append([t.name for t in r.take_completed()])
    assert seen == [[], ["t0", "t1"], [], [], ["t2"]]
    assert [bytes(t.payload) for t in r.finish()] == [t.payload for t in tensors]


@settings(max_examples=40, deadline=None)
@given(
    index=st.integers(0, 2**32 - 1),
    data=st.binary(max_size=300),
    split=st.integers(0, 300),
    digest=st.sampled_from([b"", bytes(range(32))]),
)
def test_wire_fast_path_matches_protobuf(index, data, split, digest):
    from transport import diloco_pb2 as pb
    from transport.wire import encode_data_chunk, parse_pull_chunk, parse_push_chunk

    pieces = (memoryview(data)[:split], memoryview(data)[split:])
    raw = encode_data_chunk(4, index, *pieces, digest=digest)
    assert raw == pb.PushChunk(index=index, data=data, digest=digest).SerializeToString()
    parsed = parse_push_chunk(raw)
    assert parsed.index == index and bytes(parsed.data) == data and not parsed.HasField("header")
    assert parsed.digest == digest
    raw = encode_data_chunk(3, index, *pieces, digest=digest)
    assert raw == pb.PullChunk(index=index, data=data, digest=digest).SerializeToString()
    parsed = parse_pull_chunk(raw)
    assert bytes(parsed.data) == data and parsed.digest == digest


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
    from tests.wire_helpers import push_chunks
    from transport import diloco_pb2 as pb
    from transport.client_core import push_wire_chunks

    tensors = tensors_of([300, 10, 700])
    meta = pb.PushMeta(run_id="r", island="i0", tokens=1)
    wire = list(push_wire_chunks(meta, tensors, 1000))
    messages = list(push_chunks(meta, tensors, 1000))
    assert [w if isinstance(w, bytes) else w.SerializeToString() for w in wire] == [
        m.SerializeToString() for m in messages
    ]


def test_large_payload_digest_is_hashed_in_the_background_and_matches():
    from transport.chunking import BACKGROUND_MIN_BYTES

    tensors = tensors_of([BACKGROUND_MIN_BYTES // 4 + 3, 5])  # above the threshold: the helper-thread path
    chunks = list(iter_trailed_views(tensors, 1 << 20))
    assert [d for _, d in chunks[:-1]] == [b""] * (len(chunks) - 1)
    assert chunks[-1][1] == payload_digest(tensors)
    abandoned = iter_trailed_views(tensors, 1 << 20)
    next(abandoned)
    abandoned.close()  # a stream given up half-way stops its hashing thread (no hang, no error)


def test_a_large_payload_is_hashed_on_a_helper_thread_as_it_lands():
    """From BACKGROUND_MIN_BYTES up the receiver hashes on a helper thread (`_HashingThread`): the same bytes come out,
    a wrong trailer is still refused, a stream given up half-way stops its helper at `close`, and a buffer that
    cannot be had is refused with its own reason before any helper starts."""
    import threading

    from transport.chunking import BACKGROUND_MIN_BYTES

    def helpers() -> int:
        return sum(t.name == "diloco-digest" and t.is_alive() for t in threading.enumerate())

    tensors = tensors_of([BACKGROUND_MIN_BYTES // 4 + 3, 5])
    header, chunks = build_header(tensors, 1 << 20), trailed(tensors, 1 << 20)
    assert [bytes(t.payload) for t in reassemble(header, chunks)] == [t.payload for t in tensors]
    index, data, digest = chunks[-1]
    forged = bytes([digest[0] ^ 1]) + digest[1:]
    assert "digest mismatch" in rejected(header, [*chunks[:-1], (index, data, forged)]).reason
    before = helpers()
    half = Reassembler(header, 1 << 30, 1000, CODECS)
    for i, data, digest in chunks[:3]:
        half.add(i, data, digest)
    assert helpers() == before + 1
    half.close()
    wait_until(lambda: helpers() == before, "the hashing thread to end", 60)

    class NoRoom(BufferPool):
        def acquire(self, nbytes: int) -> bytearray:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot allocate a {nbytes}-byte buffer now")

    with pytest.raises(Rejected) as info:
        Reassembler(header, 1 << 30, 1000, CODECS, pool=NoRoom())
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and helpers() == before


def test_the_pulls_of_one_payload_share_its_serialized_chunks():
    """`SharedPull`: every stream with the payload's header gets the bytes a stream of its own would send, made once
    (the same objects); one given up half-way leaves them to the others; another header makes its own."""
    from transport import diloco_pb2 as pb
    from transport.service import SharedPull, _pull_chunks
    from transport.wire import parse_pull_chunk, serialize_chunk

    tensors = tensors_of([5000, 17, 3000])
    header = pb.PullHeader(run_id="r", round=3, payload=build_header(tensors, 1024))
    alone = [serialize_chunk(c) for c in _pull_chunks(header, tensors, 1024)]
    shared = SharedPull()

    def stream(h: pb.PullHeader = header) -> list:
        return list(shared.stream(h.SerializeToString(), lambda: _pull_chunks(h, tensors, 1024)))

    abandoned = shared.stream(header.SerializeToString(), lambda: _pull_chunks(header, tensors, 1024))
    next(abandoned)
    abandoned.close()
    first, second = stream(), stream()
    assert first == second == alone and all(a is b for a, b in zip(first, second, strict=True))
    assert parse_pull_chunk(first[-1]).digest == payload_digest(tensors)
    other = pb.PullHeader(run_id="r", round=4, payload=header.payload)
    assert [serialize_chunk(c) for c in stream(other)][1:] == alone[1:]

    def failing():
        yield from list(_pull_chunks(header, tensors, 1024))[:2]
        raise MemoryError("no room for the next chunk")

    broken = SharedPull()
    with pytest.raises(MemoryError):
        list(broken.stream(header.SerializeToString(), failing))
    after = list(broken.stream(header.SerializeToString(), lambda: _pull_chunks(header, tensors, 1024)))
    assert [serialize_chunk(c) for c in after] == alone  # made on its own, whole


def test_buffer_pool_reuses_only_unreferenced_buffers():
    import numpy as np

    pool = BufferPool(keep=3, min_bytes=64)
    first = pool.acquire(1000)
    first_id = id(first)
    del first
    again = pool.acquire(900)
    assert id(again) == first_id, "a buffer nobody refers to is reused"
    array = np.frombuffer(memoryview(again)[:8], np.uint8)  # a tensor still alive in the coordinator
    del again
    other = pool.acquire(1000)
    assert id(other) != first_id, "a buffer under a live array must never be reused"
    assert len(pool.acquire(400)) == 400, "a buffer more than twice the request is not handed out"
    del array
    assert id(pool.acquire(1000)) == first_id
    assert len(pool.acquire(10)) == 10  # small requests bypass the pool


def test_reassembly_into_a_reused_larger_buffer_exposes_only_this_stream():
    pool = BufferPool(keep=1, min_bytes=64)
    stale = pool.acquire(5000)
    stale[:] = b"\xff" * 5000
    del stale
    tensors = tensors_of([600, 500])
    header = build_header(tensors, 1000)
    r = Reassembler(header, 1 << 20, 100, CODECS, pool=pool)
    for i, data, digest in trailed(tensors, 1000):
        r.add(i, data, digest)
    out = r.finish()
    assert [bytes(t.payload) for t in out] == [t.payload for t in tensors]
    assert len(memoryview(out[0].payload).obj) == 5000  # the pooled buffer, sliced to this payload


@pytest.mark.parametrize(
    "codec, shape, block, zstd, nbytes, ok",
    [
        ("fp32", (3, 5), 0, 0, 60, True),
        ("fp32", (3, 5), 0, 0, 64, False),  # not what the shape makes
        ("bf16", (7,), 0, 0, 14, True),
        ("int8", (300,), 256, 0, 2 * 4 + 300, True),
        ("int4", (301,), 256, 0, 2 * 4 + 151, True),
        ("int4", (301,), 0, 0, 2 * 4 + 151, False),  # a block size of 0 would divide by zero
        ("int8", (300,), 3, 0, 400, False),  # odd block size
        ("fp32", (1000,), 0, 3, 4000 + 15 + 62, True),  # zstd's worst case for 4000 bytes (zstd.h)
        ("fp32", (1000,), 0, 3, 4000 + 15 + 63, False),
        ("fp32", (1000,), 0, 3, 0, False),
        ("fp32", (1000,), 0, 23, 100, False),  # no such zstd level
        ("fp32", (1,) * 33, 0, 0, 4, False),  # more dimensions than any tensor has
    ],
)
def test_declared_size_must_be_what_shape_and_codec_make(codec, shape, block, zstd, nbytes, ok):
    import zstandard

    from transport import diloco_pb2 as pb
    from transport.chunking import check_declared_size, zstd_bound

    assert zstd_bound(4000) == 4000 + 15 + 62 and zstd_bound(1 << 20) == (1 << 20) + (1 << 12)
    noise = np.random.default_rng(0).bytes(4000)  # incompressible: close to the worst case, never above it
    assert 4000 < len(zstandard.ZstdCompressor(level=3, write_content_size=True).compress(noise)) <= zstd_bound(4000)
    meta = pb.TensorMeta(
        name="t", codec=codec, dtype="float32", shape=shape, block_size=block, zstd_level=zstd, nbytes=nbytes
    )
    if ok:
        check_declared_size(meta)
    else:
        with pytest.raises(Rejected) as info:
            check_declared_size(meta)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'t'" in info.value.reason


def test_budget_is_reserved_before_the_buffer_and_returned_by_close():
    from transport.chunking import ByteBudget

    tensors = tensors_of([600, 500])
    header = build_header(tensors, 1000)
    budget = ByteBudget(2 * header.total_bytes + 10)
    first = Reassembler(header, 1 << 20, 100, CODECS, budget=budget)
    second = Reassembler(header, 1 << 20, 100, CODECS, budget=budget)
    assert budget.used == 2 * header.total_bytes
    with pytest.raises(Rejected) as info:
        Reassembler(header, 1 << 20, 100, CODECS, budget=budget)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and budget.used == 2 * header.total_bytes
    first.close()
    first.close()  # idempotent: returned once
    assert budget.used == header.total_bytes
    for i, data, digest in trailed(tensors, 1000):
        second.add(i, data, digest)
    second.finish()
    second.close()
    assert budget.used == 0


def test_a_failed_stream_gives_its_pooled_buffer_up_and_a_finished_one_keeps_it():
    pool = BufferPool(keep=2, min_bytes=64)
    tensors = tensors_of([600, 500])
    header = build_header(tensors, 1000)
    failed = Reassembler(header, 1 << 20, 100, CODECS, pool=pool)
    failed.close()
    assert pool._buffers == [], "a rejected stream's buffer must not wait in the pool"
    done = Reassembler(header, 1 << 20, 100, CODECS, pool=pool)
    for i, data, digest in trailed(tensors, 1000):
        done.add(i, data, digest)
    done.finish()
    done.close()
    assert len(pool._buffers) == 1


def test_large_buffers_are_maps_whose_unwritten_pages_cost_nothing():
    import mmap

    from transport.chunking import LAZY_MIN_BYTES, _fresh

    assert isinstance(_fresh(LAZY_MIN_BYTES), mmap.mmap)
    assert isinstance(_fresh(LAZY_MIN_BYTES - 1), bytearray)
    assert len(_fresh(0)) == 0


@pytest.mark.parametrize(("kind", "pooled"), [("update", True), ("full", False)])
def test_a_full_pull_leaves_no_buffer_in_the_pool(kind: str, pooled: bool) -> None:
    """An update's buffer is kept for the next round's update; a full θ (pulled once, at a join or a resync) is not:
    kept, it would stay idle beside the island's state for the process's life."""
    from transport import diloco_pb2 as pb
    from transport.chunking import BACKGROUND_MIN_BYTES, RECEIVE_BUFFERS
    from transport.client_core import receive_pull
    from transport.config import TransportConfig
    from transport.handler import KIND_TO_PB
    from transport.service import _pull_chunks

    tensors = tensors_of([BACKGROUND_MIN_BYTES // 4 + 1])
    header = pb.PullHeader(payload=build_header(tensors, 1 << 20), kind=KIND_TO_PB[kind], param_digest=b"\0" * 16)
    payload = receive_pull(_pull_chunks(header, tensors, 1 << 20), TransportConfig())
    assert bytes(payload.tensors[0].payload) == tensors[0].payload
    buffer = memoryview(payload.tensors[0].payload).obj
    assert any(b is buffer for b in RECEIVE_BUFFERS._buffers) == pooled
