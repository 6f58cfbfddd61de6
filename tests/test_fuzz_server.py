"""Fuzz a LIVE gRPC server with >= 10,000 random and mutated messages; none may reach state.

Every message is built to be invalid (random bytes, or a valid push with one deliberate defect: wrong
shapes/dtypes/codecs, NaN values, wrong digests, truncated/reordered/duplicated chunks, oversized
declarations, wrong secrets, impersonation, stale/future/replayed rounds). The server must answer each with
a non-OK status, never crash, and the handler's state digest must be unchanged.
"""

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reference_handler import ReferenceHandler, fp32_tensor
from tests.wire_helpers import push_chunks
from transport import diloco_pb2 as pb
from transport import diloco_pb2_grpc as pb_grpc
from transport.auth import Authenticator, call_metadata
from transport.config import TransportConfig
from transport.grpc_server import start_server
from transport.service import DilocoService

RUN = "fuzz-run"
SECRETS = {"i0": "s0", "i1": "s1"}
PARAMS = {"w": np.ones((4, 4), np.float32), "b": np.ones(8, np.float32)}
ROUND = 3
CHUNK = 32  # 96 payload bytes -> 3 chunks, so reordering and truncation are meaningful
PER_EXAMPLE = 50
EXAMPLES = 205
# Room for a whole batch in flight at once: this test is about validation, not admission (test_hostile_wire.py).
CONFIG = TransportConfig(
    max_payload_mb=1.0,
    max_streams=PER_EXAMPLE,
    max_streams_per_island=PER_EXAMPLE,
    max_unary_calls=PER_EXAMPLE,
    max_unary_calls_per_island=PER_EXAMPLE,
)

MUTATIONS = [
    "random_chunks",
    "random_bytes",
    "shape",
    "dtype",
    "codec",
    "nan",
    "digest",
    "truncate",
    "reorder",
    "duplicate",
    "oversize",
    "total_mismatch",
    "no_header",
    "bad_secret",
    "no_secret",
    "impersonate",
    "stale_round",
    "future_round",
    "replay_other_payload",
    "wrong_run",
    "zero_tokens",
    "extra_tensor",
    "join_bad_secret",
    "pull_impersonate",
]


@pytest.fixture(scope="module")
def live():
    handler = ReferenceHandler(RUN, PARAMS)
    service = DilocoService(handler, RUN, handler.model_spec(), authenticator=Authenticator(SECRETS), config=CONFIG)
    server = start_server(service)
    channel = grpc.insecure_channel(server.address, options=CONFIG.grpc_options())
    stub = pb_grpc.DilocoStub(channel)
    raw_push = channel.stream_unary(
        "/diloco.v1.Diloco/PushPseudoGrad", request_serializer=None, response_deserializer=None
    )
    # One accepted push at round 0, so replays of that key with another payload can be tried.
    md0 = call_metadata("i0", "s0")
    accepted = stub.PushPseudoGrad(push_chunks(valid_meta(0), valid_tensors(0.5), CHUNK), metadata=md0)
    assert accepted.accepted
    handler.round = ROUND
    state = {"before": handler.state_digest(), "sent": 0}
    yield handler, stub, raw_push, state
    channel.close()
    server.stop(0)


def valid_meta(round_=ROUND, island="i0"):
    return pb.PushMeta(run_id=RUN, island=island, round=round_, fragment=0, tokens=100)


def valid_tensors(value=0.1):
    return [fp32_tensor(k, np.full(v.shape, value, np.float32)) for k, v in sorted(PARAMS.items())]


def chunks_of(meta, tensors):
    return list(push_chunks(meta, tensors, CHUNK))


def mutated(kind: str, draw_bytes: bytes, value: float):
    """(rpc, request(s), metadata) for one message that must be refused."""
    md = call_metadata("i0", "s0")
    tensors = valid_tensors(value)
    meta = valid_meta()
    if kind == "random_chunks":
        n = 1 + draw_bytes[0] % 4 if draw_bytes else 1
        return "push", [pb.PushChunk(index=i, data=draw_bytes) for i in range(n)], md
    if kind == "random_bytes":
        return "raw", [draw_bytes, draw_bytes[::-1]], md
    if kind in ("shape", "dtype", "codec", "extra_tensor"):
        chunks = chunks_of(meta, tensors)
        t = chunks[0].header.tensors[0]
        if kind == "shape":
            t.shape[:] = [2, 8]
        elif kind == "dtype":
            t.dtype = "float16"
        elif kind == "codec":
            t.codec = "int8"  # right bytes, wrong layout: length check in decode refuses it
        else:
            chunks[0].header.tensors.add(name="extra", codec="fp32", dtype="float32", shape=[0], nbytes=0)
        return "push", chunks, md
    if kind == "nan":
        a = np.full(8, value, np.float32)
        a[int(abs(value) * 7) % 8] = np.nan
        return "push", chunks_of(meta, [fp32_tensor("b", a), tensors[1]]), md
    if kind == "digest":
        chunks = chunks_of(meta, tensors)
        d = bytearray(chunks[-1].digest)  # the trailer on the last chunk
        d[len(draw_bytes) % 32] ^= 1 + (draw_bytes[0] if draw_bytes else 0) % 255
        chunks[-1].digest = bytes(d)
        return "push", chunks, md
    if kind == "truncate":
        return "push", chunks_of(meta, tensors)[:-1], md
    if kind == "reorder":
        c = chunks_of(meta, tensors)
        return "push", [c[0], c[2], c[1]], md
    if kind == "duplicate":
        c = chunks_of(meta, tensors)
        return "push", [c[0], c[1], c[1], c[2]], md
    if kind == "oversize":
        c = chunks_of(meta, tensors)
        c[0].header.total_bytes = CONFIG.max_payload_bytes + 1 + len(draw_bytes)
        c[0].header.tensors[0].nbytes = c[0].header.total_bytes - c[0].header.tensors[1].nbytes
        return "push", c, md
    if kind == "total_mismatch":
        c = chunks_of(meta, tensors)
        c[0].header.total_bytes += 1 + len(draw_bytes)
        return "push", c, md
    if kind == "no_header":
        c = chunks_of(meta, tensors)
        c[0].ClearField("header")
        return "push", c, md
    if kind == "bad_secret":
        return "push", chunks_of(meta, tensors), call_metadata("i0", "s0" + draw_bytes.hex() + "x")
    if kind == "no_secret":
        return "push", chunks_of(meta, tensors), call_metadata("i0", None)
    if kind == "impersonate":
        return "push", chunks_of(valid_meta(island="i0"), tensors), call_metadata("i1", "s1")
    if kind == "stale_round":
        return "push", chunks_of(valid_meta(round_=1 + len(draw_bytes) % (ROUND - 1)), tensors), md
    if kind == "future_round":
        return "push", chunks_of(valid_meta(round_=ROUND + 1 + len(draw_bytes)), tensors), md
    if kind == "replay_other_payload":
        return "push", chunks_of(valid_meta(round_=0), valid_tensors(0.5 + 1 + abs(value))), md
    if kind == "wrong_run":
        m = valid_meta()
        m.run_id = RUN + draw_bytes.hex() + "-x"
        return "push", chunks_of(m, tensors), md
    if kind == "zero_tokens":
        m = valid_meta()
        m.tokens = 0
        return "push", chunks_of(m, tensors), md
    if kind == "join_bad_secret":
        return "join", pb.JoinRequest(run_id=RUN, island="i0"), call_metadata("i0", "nope")
    if kind == "pull_impersonate":
        return "pull", pb.PullRequest(run_id=RUN, island="i1", have_round=-1), md
    raise AssertionError(kind)


message = st.tuples(
    st.sampled_from(MUTATIONS),
    st.binary(min_size=0, max_size=64),
    st.floats(min_value=-4, max_value=4, allow_nan=False, width=32),
)


@pytest.mark.slow
def test_fuzz_live_server(live):
    handler, stub, raw_push, state = live

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(batch=st.lists(message, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    def fuzz(batch):
        futures = []
        for kind, data, value in batch:
            rpc, request, md = mutated(kind, data, value)
            if rpc == "push":
                futures.append((kind, stub.PushPseudoGrad.future(iter(request), metadata=md, timeout=10)))
            elif rpc == "raw":
                futures.append((kind, raw_push.future(iter(request), metadata=md, timeout=10)))
            elif rpc == "join":
                futures.append((kind, stub.Join.future(request, metadata=md, timeout=10)))
            else:
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.PullGlobal(request, metadata=md, timeout=10))
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                state["sent"] += 1
        for kind, fut in futures:
            err = fut.exception()
            assert err is not None, f"{kind}: a defective message was accepted"
            # UNKNOWN would mean the server raised something other than a clean rejection.
            assert err.code() not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN), f"{kind}: {err}"
            state["sent"] += 1
        assert handler.state_digest() == state["before"]

    fuzz()
    assert state["sent"] >= EXAMPLES * PER_EXAMPLE >= 10_000
    assert handler.state_digest() == state["before"]
    assert handler.applied == [("i0", 0, 0, 100)]  # only the setup push ever reached the handler
