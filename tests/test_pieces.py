"""A leaf split over an island's devices travels as pieces that follow its shards (floor/codec.py "Pieces",
pytrees/pieces.py): each piece decodes to exactly the values the whole leaf's encoding gives, the receiver assembles
them, and a hostile tiling is refused with a reason before anything is allocated."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco.harness.procs import free_port
from floor.codec import CodecError, CodecSpec, check_tiling, decode, piece_decodes_as_whole
from islands.island import delta_of
from islands.mesh import build_mesh
from pytrees.encode import encode
from pytrees.feedback import compress_tree
from pytrees.pieces import Split
from tests.conftest import REPO, child_env
from tests.test_hostile_wire import DEADLINE_S, PUSH, code_of, meta, serving
from tests.wire_helpers import push_chunks
from transport import diloco_pb2 as pb
from transport.auth import call_metadata
from transport.config import TransportConfig

pytestmark = pytest.mark.timeout(120)

SPECS = [
    CodecSpec(kind="int8", block_size=8),
    CodecSpec(kind="int4", block_size=4),
    CodecSpec(kind="sparse", block_size=8, density=0.25),
    CodecSpec(kind="bf16"),
    CodecSpec(kind="fp32"),
]


def grid(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The regions of `shape` cut evenly into `parts` along each dimension (a sharded array's shards)."""
    steps = [n // k for n, k in zip(shape, parts, strict=True)]
    return [
        (tuple(i * s for i, s in zip(cell, steps, strict=True)), tuple(steps))
        for cell in itertools.product(*(range(k) for k in parts))
    ]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_a_piece_that_may_travel_alone_decodes_as_the_whole_does(spec: CodecSpec) -> None:
    """For every region of every grid of a few shapes that `piece_decodes_as_whole` admits, the region encoded alone
    decodes bit for bit to the whole encoding's values there; and the rule admits some regions and refuses others
    (blockwise codecs), so it is neither vacuous nor everything."""
    rng = np.random.default_rng(0)
    verdicts = set()
    for shape in [(16, 8), (8, 24), (4, 6, 8), (32,), (12, 16)]:
        x = rng.standard_normal(shape).astype(np.float32)
        whole = decode(encode("w", x, spec))
        for parts in itertools.product(*([1, 2, 4] if n % 4 == 0 else [1, 2] for n in shape)):
            if any(n % k for n, k in zip(shape, parts, strict=True)):
                continue
            for offset, piece in grid(shape, parts):
                ok = piece_decodes_as_whole(spec.kind, spec.block_size, shape, offset, piece)
                verdicts.add(ok)
                if ok:
                    where = tuple(slice(o, o + n) for o, n in zip(offset, piece, strict=True))
                    alone = decode(encode("w", np.ascontiguousarray(x[where]), spec))
                    assert alone.tobytes() == whole[where].tobytes(), (shape, offset, piece)
    assert verdicts == ({True} if spec.kind in ("fp32", "bf16") else {True, False})


def test_a_tiling_with_an_overlap_a_gap_or_a_piece_outside_is_refused() -> None:
    check_tiling("w", (8, 8), grid((8, 8), (2, 4)))
    bad = {
        "overlaps another": [((0, 0), (8, 8)), ((0, 0), (4, 4))],
        "leave part of it out": [((0, 0), (4, 8))],
        "is not inside": [((0, 0), (8, 8)), ((8, 0), (1, 8))],
        "offsets for": [((0,), (8, 8))],
    }
    negative = [((-4, 0), (4, 8)), ((0, 0), (4, 8)), ((4, 0), (4, 8))]
    for words, pieces in [*bad.items(), ("is not inside", negative)]:
        with pytest.raises(CodecError, match=words):
            check_tiling("w", (8, 8), pieces)
    # A brick layout tiles the square but is no grid: refused as the overlap its cut makes.
    bricks = [((0, 0), (4, 6)), ((0, 6), (4, 2)), ((4, 0), (4, 2)), ((4, 2), (4, 6))]
    with pytest.raises(CodecError, match="overlaps another"):
        check_tiling("w", (8, 8), bricks)


def check_split(axis: int) -> None:
    """In a process with 4 host devices (`test_an_islands_split_leaf_...`): Δ of a (16, 32) leaf split over them
    along `axis`, against the whole leaf's."""
    rng = np.random.default_rng(1)
    ref, local, residual = (rng.standard_normal((16, 32)).astype(np.float32) for _ in range(3))
    mesh = build_mesh(4, None, 1)
    x = jax.device_put(local, NamedSharding(mesh, P("data", None) if axis == 0 else P(None, "data")))
    spec = CodecSpec(kind="int8", block_size=8)
    split = delta_of(ref, x, spec)
    assert isinstance(split, Split)
    assert sorted(o for o, _ in split.pieces) == sorted((4 * i, 0) if axis == 0 else (0, 8 * i) for i in range(4))
    pieces = compress_tree({"w": split}, {"w": residual}, spec)
    whole = compress_tree({"w": ref - local}, {"w": residual}, spec)
    assert [t.offset for t in pieces.encoded] == [o for o, _ in split.pieces]
    assert pieces.decoded["w"].tobytes() == whole.decoded["w"].tobytes()
    assert pieces.residual["w"].tobytes() == whole.residual["w"].tobytes()
    # Blocks that cross the shards: read whole.
    assert not isinstance(delta_of(ref, x, CodecSpec(kind="int8", block_size=256 if axis == 0 else 16)), Split)
    print("ok")


@pytest.mark.multiprocess
@pytest.mark.parametrize("axis", [0, 1])
def test_an_islands_split_leaf_is_pushed_as_its_shards_and_decodes_as_the_whole(axis: int) -> None:
    """Δ of a leaf split over 4 devices (rows, then columns) is read shard by shard and error-fed and encoded piece by
    piece: the pieces' offsets are the shards', and the decoded Δ and the new residual equal the whole leaf's, bit
    for bit; a layout whose blocks cross its shards is read whole. (In a child process with 4 host devices.)"""
    code = f"from tests.test_pieces import check_split; check_split({axis})"
    done = subprocess.run(
        [sys.executable, "-c", code], env=child_env(4), cwd=REPO, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def check_split_across_processes(me: int, port: int, directory: str) -> None:
    """Process `me` of 2, each with 2 host devices, joined into one JAX program (`test_a_leaf_split_across_...`): Δ
    of a (16, 32) leaf split by rows over the 4 devices, formed, error-fed and encoded by each process for its own
    rows, the followers' pieces gathered to the leader over the island's channel."""
    from diloco.run.checkpoint import CheckpointStore, restore_state, save_state
    from diloco.worker.island_group import Channel, pieces_command, pieces_of
    from islands.island import IslandState, own_pieces, spread
    from transport.tensors import Wholes

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=me, initialization_timeout=60)
    rng = np.random.default_rng(2)  # the same values on both processes: each checks against the whole leaf's
    ref, local, residual = (rng.standard_normal((16, 32)).astype(np.float32) for _ in range(3))
    rows = NamedSharding(build_mesh(4, None, 1), P("data", None))

    def laid_out(host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(host.shape, rows, lambda index: host[index])

    x, r = laid_out(local), laid_out(residual)
    spec = CodecSpec(kind="int8", block_size=8)
    split = delta_of(ref, x, spec)
    assert isinstance(split, Split) and not split.complete
    assert sorted(o for o, _ in split.pieces) == [(8 * me, 0), (8 * me + 4, 0)], split.pieces
    sent = compress_tree({"w": split}, {"w": own_pieces(r)}, spec)
    whole = compress_tree({"w": ref - local}, {"w": residual}, spec)
    channel = Channel()
    if me == 0:
        every = [*sent.encoded, *(t for cmd in channel.gather(None) for t in pieces_of(cmd, frozenset({"w"})))]
        assert sorted(t.offset for t in every) == [(4 * i, 0) for i in range(4)]
        wholes = Wholes({"w": (16, 32)})
        assembled = [wholes.place(t, decode(t)) for t in every][-1]
        assert assembled.tobytes() == whole.decoded["w"].tobytes()
    else:
        channel.gather(pieces_command(sent.encoded))
    kept = spread(sent.residual["w"], r)
    assert np.asarray(multihost_utils.process_allgather(kept, tiled=True)).tobytes() == whole.residual["w"].tobytes()
    # Each process saves and restores its own rows of the residual with the island's checkpoints.
    store = CheckpointStore(Path(directory))
    save_state(store, 1, IslandState({"w": x}, {}, {"w": kept}), {})
    store.wait()
    restored, _ = restore_state(store, 1, IslandState({"w": x}, {}, {"w": laid_out(np.zeros((16, 32), np.float32))}))
    store.close()
    back = multihost_utils.process_allgather(restored.residual["w"], tiled=True)
    assert np.asarray(back).tobytes() == whole.residual["w"].tobytes()
    # The channel's slabs, made tiny: arrays across slab bounds, several to a slab, one of no bytes, bytes that are
    # no whole word, a -0.0; the receiver's `keep` sees each whole.
    small = Channel()
    small.SLAB_WORDS = 5
    sent_arrays = {
        "a": np.array([[-0.0, 1.5, np.nan], [2.0, -3.0, 4.0]], np.float32),
        "b": np.zeros((0, 3), np.int32),
        "c": np.arange(7, dtype=np.uint8),
        "d": np.arange(13, dtype=np.int32) - 6,
    }
    if me == 0:
        small.send("probe", sent_arrays, n=1)
    else:
        seen: list[str] = []
        cmd = small.receive({"probe": lambda name, a: seen.append(name) or a.copy()})
        assert (cmd.op, cmd.args, sorted(seen)) == ("probe", {"n": 1}, sorted(sent_arrays)), (cmd, seen)
        for name, a in sent_arrays.items():
            assert cmd.arrays[name].dtype == a.dtype and cmd.arrays[name].tobytes() == a.tobytes(), name
    # Blocks that cross the shards: the leaf is gathered whole from both processes.
    gathered = delta_of(ref, x, CodecSpec(kind="int8", block_size=256))
    assert isinstance(gathered, np.ndarray) and gathered.tobytes() == (ref - local).tobytes()
    print("ok")


@pytest.mark.multiprocess
def test_a_leaf_split_across_processes_is_pushed_as_every_processs_shards(tmp_path: Path) -> None:
    """Two processes of one island (jax.distributed, gloo), a leaf split by rows over their 4 devices: each process
    forms Δ of its own rows only (a partial Split) and error-feeds and encodes it; the leader gathers the follower's
    encoded pieces over the island's channel, and the 4 pieces decode bit for bit to the whole leaf's encoding; each
    process's new residual, laid out as the leaf, is the whole leaf's, and comes back so from the checkpoint both
    processes save; a leaf whose codec blocks cross the shards is gathered whole instead."""
    port = free_port()
    code = "import sys; from tests.test_pieces import check_split_across_processes as c; c(int(sys.argv[1]), {}, {!r})"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code.format(port, str(tmp_path / "checkpoints")), str(me)],
            env=child_env(2),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in range(2)
    ]
    try:
        done = [proc.communicate(timeout=100) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, done, strict=True):
        assert proc.returncode == 0 and out.splitlines()[-1:] == ["ok"], err[-3000:]  # gloo prints to stdout too


PIECES = [
    ("w", (0, 0), (2, 4)),
    ("w", (2, 0), (2, 4)),
]


def piece_tensors(layout: list[tuple[str, tuple[int, ...], tuple[int, ...]]], value: float = 0.25) -> list:
    """fp32 tensors of the reference handler's params ("b" whole), "w" cut as `layout` says."""
    out = [encode("b", np.full(8, value, np.float32), CodecSpec(kind="fp32"))]
    for name, offset, shape in layout:
        out.append(replace(encode(name, np.full(shape, value, np.float32), CodecSpec(kind="fp32")), offset=offset))
    return out


def test_a_push_in_pieces_is_assembled_and_a_hostile_tiling_is_refused_with_a_reason() -> None:
    """Over a real gRPC server: a push whose "w" comes in two pieces reaches the handler as the whole "w"; pieces
    that overlap, leave a gap, lie outside, mix with the whole tensor or have an offset of another rank are
    INVALID_ARGUMENT with the reason naming the tensor, before any buffer is booked."""
    with serving(TransportConfig(), uplink=CodecSpec(kind="fp32")) as s:
        received: dict[str, np.ndarray] = {}
        apply = s.handler.push
        s.handler.push = lambda m, tensors, arrays, digest: (received.update(arrays), apply(m, tensors, arrays, digest))[1]  # fmt: skip
        assert s.client().push(meta(), piece_tensors(PIECES)).accepted
        assert received["w"].shape == (4, 4) and (received["w"] == 0.25).all() and not received["w"].flags.writeable

        raw = s.raw(PUSH, pb.PushReply)
        cases = {
            "overlaps another": [("w", (0, 0), (2, 4)), ("w", (1, 0), (2, 4)), ("w", (2, 0), (2, 4))],
            "leave part of it out": [("w", (0, 0), (2, 4))],
            "is not inside": [("w", (0, 0), (2, 4)), ("w", (2, 0), (4, 4))],
            "sent whole and in pieces": [("w", (0, 0), (2, 4)), ("w", (2, 0), (2, 4)), ("w", (), (4, 4))],
        }
        for words, layout in cases.items():
            call = raw.future(iter(push_chunks(meta(), piece_tensors(layout), 1 << 20)), metadata=call_metadata("i0", "s0"), timeout=DEADLINE_S)  # fmt: skip
            assert code_of(call) == grpc.StatusCode.INVALID_ARGUMENT, words
            assert words in call.exception().details() and "'w'" in call.exception().details(), words
        first = next(push_chunks(meta(), piece_tensors(PIECES), 1 << 20))
        first.header.tensors[1].offset.append(0)  # three indices for two dimensions
        call = raw.future(iter([first]), metadata=call_metadata("i0", "s0"), timeout=DEADLINE_S)
        assert code_of(call) == grpc.StatusCode.INVALID_ARGUMENT and "3 indices" in call.exception().details()
        assert s.service.budget.used == 0
