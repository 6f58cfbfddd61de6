"""The sparse codec (floor/codec.py's ``sparse`` layout, pytrees/encode.py's encoder): the byte layout as its
docstring states it, top-k and the error bound of kept values, error feedback (with SparseLoCo's decay), every
hostile payload refused naming the tensor, the wire's size check, the config keys, and real bytes over gRPC."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.config import CodecConfig, ConfigError, load_config
from floor.codec import CodecError, CodecSpec, EncodedTensor, decode, index_bits, raw_payload_range
from pytrees.encode import encode
from pytrees.feedback import compress_tree, compress_with_feedback
from tests.test_grpc_transport import PARAMS, Env, meta
from transport.chunking import check_declared_size
from transport.errors import Rejected, TransportError
from transport.tensors import to_meta

SPEC = CodecSpec(kind="sparse", block_size=8, density=0.25, sparse_bits=3)
"""Chunks of 8 keeping 2 values at 3 bits: small enough to write its bytes by hand."""


def pack(values: list[int], width: int) -> bytes:
    """The docstring's bit stream, written independently of the encoder: value i in bits i*w .. i*w + w - 1."""
    bits = "".join(format(v, f"0{width}b")[::-1] for v in values)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8][::-1], 2) for i in range(0, len(bits), 8))


def payload(
    bits: int, width: int, kept: int, kept_last: int, scales: list[float], index: list[int], codes: list[int]
) -> bytes:
    header = np.array([(bits, width, 0, kept, kept_last)], "<u1,<u1,<u2,<u4,<u4").tobytes()
    return header + np.array(scales, "<f4").tobytes() + pack(index, width) + pack(codes, bits)


def tensor(raw: bytes, n: int, chunk: int = 8, zstd_level: int = 0) -> EncodedTensor:
    """A received sparse tensor of ``n`` values in chunks of ``chunk`` whose payload is ``raw``."""
    return EncodedTensor("blocks/0/w", "sparse", "float32", (n,), chunk, zstd_level, raw)


# Chunk 0 keeps x[1] = -4 and x[6] = 2 (magnitudes 2..4, step (4 - 2) / 4 = 0.5); the short last chunk (3 values)
# keeps one value, 1.5 at position 2 (lo = hi: step 0, exact).
X = np.array([0.5, -4.0, 0.25, 1.0, 0.0, -1.5, 2.0, 0.1, 0.2, -0.3, 1.5], np.float32)
BYTES = payload(3, 3, 2, 1, [2.0, 0.5, 1.5, 0.0], [1, 6, 2], [0b111, 0b000, 0b000])


def test_the_bytes_are_the_documented_layout():
    enc = encode("blocks/0/w", X, SPEC)
    assert (enc.codec, enc.block_size, enc.shape) == ("sparse", 8, (11,))
    assert bytes(enc.payload) == BYTES
    xh = decode(tensor(BYTES, 11))
    # -4 is level 3 of 4 (2 + 3.5 * 0.5 = 3.75), 2 is level 0 (2.25), 1.5 alone is exact; everything else is 0.
    expected = np.zeros(11, np.float32)
    expected[[1, 6, 10]] = [-3.75, 2.25, 1.5]
    assert np.array_equal(xh, expected)
    assert enc.nbytes == enc.raw_nbytes == 12 + 16 + 2 + 2


def test_cost_model_and_defaults():
    spec = CodecSpec(kind="sparse", block_size=4096)
    assert spec.kept(4096) == 64 and index_bits(4096) == 12
    assert 32 / spec.bits_per_value() == pytest.approx(16384 / 120)  # 136.5x
    x = np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float32)
    enc = encode("w", x, spec)
    assert enc.nbytes == 12 + 64 * 120
    assert x.nbytes / enc.nbytes > 136
    assert CodecSpec(kind="sparse", block_size=4096, sparse_bits=4).bits_per_value() == pytest.approx(136 * 8 / 4096)


SIZES = [1, 2, 7, 8, 9, 64, 100, 257]
PROP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(
    n=st.sampled_from(SIZES),
    chunk=st.sampled_from([2, 8, 64]),
    density=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
    bits=st.sampled_from([2, 3, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
    mag=st.sampled_from([1e-30, 1e-3, 1.0, 1e30]),
    zeros=st.booleans(),
)
def test_top_k_kept_within_bound_rest_exactly_zero(n, chunk, density, bits, seed, mag, zeros):
    x = (np.random.default_rng(seed).standard_normal(n) * mag).astype(np.float32)
    if zeros:
        x[: n // 2] = 0.0
    spec = CodecSpec(kind="sparse", block_size=chunk, density=density, sparse_bits=bits)
    xh = decode(encode("t", x, spec))
    assert_sparse_bound(x, xh, spec)


def assert_sparse_bound(x: np.ndarray, xh: np.ndarray, spec: CodecSpec) -> None:
    """Per chunk: the `kept` values of largest magnitude (ties to the lower index) within the documented bound, the
    rest exactly 0 (the docstring's contract)."""
    flat, got = x.reshape(-1).astype(np.float64), xh.reshape(-1).astype(np.float64)
    for start in range(0, flat.size, spec.block_size):
        chunk, back = flat[start : start + spec.block_size], got[start : start + spec.block_size]
        keep = np.sort(np.argsort(-np.abs(chunk), kind="stable")[: spec.kept(chunk.size)])
        dropped = np.setdiff1d(np.arange(chunk.size), keep)
        assert np.all(back[dropped] == 0.0)
        lo, hi = np.abs(chunk[keep]).min(), np.abs(chunk[keep]).max()
        bound = (hi - lo) / 2**spec.sparse_bits + 2.0**-21 * hi + 2.0**-126
        assert np.abs(back[keep] - chunk[keep]).max() <= bound
        assert np.all(np.sign(back[keep]) * np.sign(chunk[keep]) >= 0)


def test_equal_magnitudes_and_single_values_are_exact():
    x = np.array([3.0, -3.0, 0.0, 3.0, 1.0, -1.0, 2.0, 7.5], np.float32)
    spec = CodecSpec(kind="sparse", block_size=2, density=0.5, sparse_bits=2)  # one value of each pair
    assert np.array_equal(decode(encode("t", x, spec)), np.array([3, 0, 0, 3, 1, 0, 0, 7.5], np.float32))


def test_deterministic_and_jax_input_alike():
    import jax.numpy as jnp

    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    spec = CodecSpec(kind="sparse", block_size=512, density=0.02)
    a, b, c = encode("t", x, spec), encode("t", x.copy(), spec), encode("t", jnp.asarray(x), spec)
    assert a == b and bytes(a.payload) == bytes(c.payload)


def test_empty_tensor_and_non_finite_input():
    enc = encode("e", np.zeros((0, 3), np.float32), SPEC)
    assert enc.nbytes == 12 and decode(enc).shape == (0, 3)
    x = X.copy()
    x[9] = np.nan
    with pytest.raises(CodecError, match="tensor 'w' has non-finite values"):
        encode("w", x, SPEC)


def test_zstd_round_trip():
    x = np.random.default_rng(2).standard_normal(20000).astype(np.float32)
    spec = dataclasses.replace(SPEC, block_size=4096, density=1 / 64, zstd_level=3)
    enc = encode("z", x, spec)
    assert np.array_equal(decode(enc), decode(encode("z", x, dataclasses.replace(spec, zstd_level=0))))
    assert enc.raw_nbytes == encode("z", x, dataclasses.replace(spec, zstd_level=0)).nbytes


# --------------------------------------------------------------------------------------------------------
# Error feedback


def test_feedback_conserves_what_is_not_sent():
    rng = np.random.default_rng(3)
    spec = CodecSpec(kind="sparse", block_size=64, density=0.05, sparse_bits=2)
    x, e = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    for decay in (1.0, 0.95):
        enc, dec, res = compress_with_feedback(x, e, spec, name="w", decay=decay)
        target = x + (e if decay == 1.0 else np.float32(decay) * e)
        assert np.array_equal(dec, decode(enc))
        unsent = dec == 0
        assert unsent.mean() > 0.9
        assert np.array_equal(res[unsent], target[unsent])  # what was not sent stays whole in the residual
        np.testing.assert_allclose(dec + res, target, rtol=0, atol=1e-6)  # sent + residual == input


def test_feedback_sends_everything_eventually():
    """With β = 1 the decoded messages sum to the inputs' sum minus the residual: nothing is lost, only delayed."""
    rng = np.random.default_rng(4)
    spec = CodecSpec(kind="sparse", block_size=64, density=0.05, sparse_bits=2)
    total_in, total_out, residual = np.zeros(640), np.zeros(640), None
    for _ in range(50):
        x = (0.01 * rng.standard_normal(640)).astype(np.float32)
        _, dec, residual = compress_with_feedback(x, residual, spec, name="w")
        total_in += x
        total_out += dec
    np.testing.assert_allclose(total_in - total_out, residual, atol=1e-5)


def test_tree_decay_is_the_island_accumulator():
    tree = {"a": np.full(16, 0.5, np.float32)}
    residual = {"a": np.full(16, 2.0, np.float32)}
    spec = CodecSpec(kind="sparse", block_size=16, density=1 / 16)
    sent = compress_tree(tree, residual, spec, decay=0.5)
    decoded, kept = sent.decoded["a"], sent.residual["a"]
    assert decoded[0] == 1.5 and np.count_nonzero(decoded) == 1  # 0.5 + 0.5 * 2.0, one value of 16
    assert np.array_equal(kept[1:], np.full(15, 1.5, np.float32)) and kept[0] == 0.0


# --------------------------------------------------------------------------------------------------------
# Hostile payloads: each one refused with a CodecError naming the tensor


def _hostile() -> list[tuple[str, bytes, int, int, str]]:
    ok = dict(bits=3, width=3, kept=2, kept_last=1, scales=[2.0, 0.5, 1.5, 0.0], index=[1, 6, 2], codes=[7, 0, 0])

    def forge(**changes: object) -> bytes:
        return payload(**{**ok, **changes})  # type: ignore[arg-type]

    nan = forge(scales=[float("nan"), 0.5, 1.5, 0.0])
    # Chunks of 6 take 3-bit indices, which can say 7: a full chunk's index past its end.
    past_end = payload(3, 3, 2, 2, [1.0, 1.0, 1.0, 1.0], [1, 7, 0, 1], [0] * 4)
    return [
        ("index outside the last chunk", forge(index=[1, 6, 3]), 11, 8, "outside its chunk"),
        ("index past a full chunk's end", past_end, 12, 6, "outside its chunk"),
        ("duplicate index", forge(index=[6, 6, 2]), 11, 8, "duplicate or out of order"),
        ("indices out of order", forge(index=[6, 1, 2]), 11, 8, "duplicate or out of order"),
        ("more kept than the chunk", forge(kept=9), 11, 8, "counts must be"),
        ("more kept than the last chunk", forge(kept_last=4), 11, 8, "counts must be"),
        ("nothing kept", forge(kept=0), 11, 8, "counts must be"),
        ("counts for an empty tensor", forge(scales=[], index=[], codes=[]), 0, 8, "of an empty tensor"),
        ("value bits not 2..8", forge(bits=9), 11, 8, "9 value bits"),
        ("index width not the chunk's", forge(width=4), 11, 8, "4-bit indices; chunks of 8 take 3"),
        ("payload one byte short", forge()[:-1], 11, 8, "payload is 31 bytes"),
        ("payload one byte long", forge() + b"\0", 11, 8, "payload is 33 bytes"),
        ("no header", b"\x03\x03", 11, 8, "no 12-byte header"),
        ("non-finite scale", nan, 11, 8, "finite and non-negative"),
        ("negative scale", forge(scales=[-2.0, 0.5, 1.5, 0.0]), 11, 8, "finite and non-negative"),
        ("overflowing values", forge(scales=[3e38, 3e38, 1.5, 0.0]), 11, 8, "not finite"),
        ("reserved field", forge()[:2] + b"\x01\x00" + forge()[4:], 11, 8, "reserved"),
    ]


@pytest.mark.parametrize(("case", "raw", "n", "chunk", "words"), _hostile(), ids=[c[0] for c in _hostile()])
def test_hostile_payload_refused_naming_the_tensor(case, raw, n, chunk, words):
    with pytest.raises(CodecError) as info:
        decode(tensor(raw, n, chunk))
    assert "tensor 'blocks/0/w'" in str(info.value) and words in str(info.value), str(info.value)


def test_zstd_frames_beyond_the_range_are_refused():
    most = raw_payload_range("sparse", 11, 8)[1]
    bomb = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(b"\0" * (most + 1))
    with pytest.raises(CodecError, match="at most"):
        decode(tensor(bomb, 11, zstd_level=1))
    hidden = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(BYTES)
    with pytest.raises(CodecError, match="tensor 'blocks/0/w'"):
        decode(tensor(hidden, 11, zstd_level=1))


def test_wire_checks_the_declared_size_against_the_range():
    enc = encode("w", np.random.default_rng(5).standard_normal(4096 * 3).astype(np.float32), CodecSpec("sparse", 4096))
    check_declared_size(to_meta(enc))
    least, most = raw_payload_range("sparse", 4096 * 3, 4096)
    assert least <= enc.nbytes <= most
    for nbytes in (least - 1, most + 1):
        forged = to_meta(enc)
        forged.nbytes = nbytes
        with pytest.raises(Rejected, match=f"declares {nbytes} bytes; sparse of shape .* is {least} to {most}"):
            check_declared_size(forged)


# --------------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["codec.uplink=sparse", "codec.density=0"], "codec.density must be a fraction in (0, 1]"),
        (["codec.uplink=sparse", "codec.density=1.5"], "codec.density"),
        (["codec.uplink=sparse", "codec.sparse_bits=1"], "codec.sparse_bits must be an integer in 2..8"),
        (["codec.downlink=sparse", "codec.chunk=3"], "codec.chunk must be a positive multiple of 2"),
        (["codec.uplink=sparse"], "outer.aggregate to 'mean' or 'norm_clip'"),
        (["outer.kind=sparseloco"], "codec.uplink = 'fp32' does not have"),
        (["outer.kind=sparseloco", "outer.error_decay=0"], "outer.error_decay must be in (0, 1]"),
        (["codec.downlink=sparse", "codec.downlink_density=1.5"], "codec.downlink_density must be a fraction"),
        (["codec.downlink=sparse", "codec.downlink_bits=9"], "codec.downlink_bits must be an integer in 2..8"),
        (["codec.downlink_density=0.1"], "apply to codec.downlink = 'sparse' only (codec.downlink is 'fp32')"),
    ],
)
def test_config_keys_name_themselves(overrides, words):
    from pathlib import Path

    with pytest.raises(ConfigError) as info:
        load_config(Path(__file__).parent.parent / "configs" / "tiny.toml", overrides)
    assert words in str(info.value)


def test_config_spec_uses_chunk_for_sparse_only():
    cfg = CodecConfig(uplink="sparse", downlink="int4", chunk=1024, density=0.02, sparse_bits=3)
    assert cfg.spec("uplink") == CodecSpec("sparse", 1024, 0, 0.02, 3)
    assert cfg.spec("downlink") == CodecSpec("int4", 256, 0)
    both = CodecConfig(uplink="sparse", downlink="sparse", density=0.02, downlink_density=0.08, downlink_bits=8)
    assert both.spec("uplink") == CodecSpec("sparse", 4096, 0, 0.02, 2)
    assert both.spec("downlink") == CodecSpec("sparse", 4096, 0, 0.08, 8)


def test_a_union_downlink_sends_every_islands_kept_values():
    """SparseLoCo's downlink: with no outer momentum the update holds at most islands x k values a chunk, and a
    downlink of that density keeps every one (to 8-bit rounding), where one of the uplink's density drops most."""
    import jax.numpy as jnp

    from diloco.run.rounds import OuterLoop
    from outer_optimizer.config import OuterConfig
    from outer_optimizer.optimizers import build_optimizer

    up = CodecSpec("sparse", 1024, density=1 / 64, sparse_bits=2)
    rng = np.random.default_rng(3)
    sent = [decode(encode("w", rng.standard_normal(8192).astype(np.float32), up)) for _ in range(4)]
    union = np.mean(sent, axis=0)
    tx = build_optimizer(OuterConfig(kind="sparseloco", lr=1.0))

    def downlink(density: float, bits: int) -> np.ndarray:
        loop = OuterLoop.fresh({"w": jnp.zeros(8192)}, tx, CodecSpec("sparse", 1024, density=density, sparse_bits=bits))
        for i, delta in enumerate(sent):
            loop.submit(f"i{i}", 0, {"w": jnp.asarray(delta)}, tokens=1)
        loop.commit()
        return -np.asarray(loop.params["w"])  # θ_1 = 0 + û, and the outer step is -lr * mean

    assert np.count_nonzero(downlink(1 / 64, 2)) == 8 * 16  # k of each chunk: most of the union stays behind
    got, nz = downlink(4 / 64, 8), union != 0
    assert np.count_nonzero(nz) > 8 * 16 * 3  # four islands' indices, few shared
    assert np.all(got[nz] != 0)  # every island's every kept value arrives ...
    for c in range(0, 8192, 1024):  # ... within its chunk's 8-bit bound (hi - lo) / 2^8, the rest near zero too
        assert np.max(np.abs(got[c : c + 1024] - union[c : c + 1024])) <= np.max(np.abs(union[c : c + 1024])) / 256 * (
            1 + 1e-5
        )


# --------------------------------------------------------------------------------------------------------
# Real bytes over gRPC


@pytest.mark.timeout(60)
def test_sparse_push_over_grpc_applies_exactly_what_was_sent_and_refuses_forgeries():
    env = Env("grpc")
    try:
        client = env.client()
        spec = CodecSpec("sparse", 4096, density=1 / 64)
        rng = np.random.default_rng(6)
        sent = [encode(k, rng.standard_normal(v.shape).astype(np.float32), spec) for k, v in sorted(PARAMS.items())]
        before = {k: v.copy() for k, v in env.handler.params.items()}
        assert client.push(meta(), sent).accepted
        for t in sent:
            assert np.array_equal(env.handler.params[t.name], before[t.name] - decode(t))
        forged = [dataclasses.replace(sent[0], payload=_duplicate_first_index(sent[0]))] + sent[1:]
        with pytest.raises(TransportError) as info:
            client.push(meta(island="i0", round_=0, tokens=7), forged)
        assert info.value.code.name == "INVALID_ARGUMENT" and "duplicate" in info.value.reason
        assert len(env.handler.applied) == 1
    finally:
        env.close()


def _duplicate_first_index(enc: EncodedTensor) -> bytes:
    """The payload with its second index set equal to the first (a duplicate inside chunk 0)."""
    raw = bytearray(bytes(enc.payload))
    chunks = -(-enc.numel // enc.block_size)
    offset = 12 + 8 * chunks
    width = index_bits(enc.block_size)
    first = int.from_bytes(raw[offset : offset + 4], "little") & ((1 << width) - 1)
    word = int.from_bytes(raw[offset : offset + 4], "little")
    word = (word & ~(((1 << width) - 1) << width)) | (first << width)
    raw[offset : offset + 4] = word.to_bytes(4, "little")
    return bytes(raw)


# --------------------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_simulate_with_sparse_codec_and_sparseloco_learns_on_few_bytes(tiny_config, tmp_path):
    from diloco.run.rundir import read_events
    from diloco.simulator.simulate import run_simulation

    # A tenth of each chunk at 4 bits (22x fewer bytes than fp32): enough to learn visibly in 4 short rounds.
    sparse = ["codec.uplink=sparse", "codec.downlink=sparse", "codec.chunk=1024", "codec.density=0.1"]
    sparse += ["codec.sparse_bits=4", "outer.aggregate=mean"]
    cfg = load_config(tiny_config, [*sparse, "outer.kind=sparseloco", "outer.lr=1.0", "train.rounds=4"])
    summary = run_simulation(cfg, tmp_path / "run", show_progress=False)
    dense = 4 * summary["param_count"] * 2 * 4  # fp32 bytes: 2 islands, 4 rounds
    # the downlink is the union of both islands' updates (codec.downlink_density unset): twice the density at most
    assert summary["bytes_up"] * 15 < dense and summary["bytes_down"] <= 2 * summary["bytes_up"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3
    rounds = [e for e in read_events(tmp_path / "run" / "metrics.jsonl") if e["event"] == "round"]
    assert len(rounds) == 4 and all(np.isfinite(e["eval_loss"]) for e in rounds)


def test_sparseloco_is_plain_descent_with_decayed_island_feedback():
    import jax.numpy as jnp

    from outer_optimizer.config import OuterConfig
    from outer_optimizer.optimizers import build_optimizer, make_outer_step

    cfg = OuterConfig(kind="sparseloco", lr=0.5, error_decay=0.9)
    assert cfg.feedback_decay == 0.9 and OuterConfig(kind="nesterov", error_decay=0.9).feedback_decay == 1.0
    tx = build_optimizer(cfg)
    params, delta = {"w": jnp.ones(3)}, {"w": jnp.array([1.0, -2.0, 0.0])}
    step = make_outer_step(tx)
    state = tx.init(params)
    for _ in range(2):  # no state carries from one step to the next: the same Δ moves θ the same each time
        update, state = step(params, state, delta)
        assert np.array_equal(np.asarray(update["w"]), np.array([-0.5, 1.0, 0.0], np.float32))


def test_a_payload_of_another_density_or_width_is_refused_where_the_run_says_what_it_sends():
    """A self-consistent sparse payload whose header keeps more per chunk (or sends wider values) than the run's
    codec says decodes by itself, but not where the receiver knows the run's spec (the coordinator's pushes)."""
    run = CodecSpec("sparse", 4096, density=1 / 64, sparse_bits=2)
    x = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    assert np.array_equal(decode(encode("w", x, run), sent_with=(run,)), decode(encode("w", x, run)))
    for other in (CodecSpec("sparse", 4096, density=1 / 8, sparse_bits=2), CodecSpec("sparse", 4096, sparse_bits=8)):
        enc = encode("w", x, other)
        decode(enc)  # well formed in itself
        with pytest.raises(CodecError, match=r"tensor 'w': sparse header says .*codec.sparse_bits, codec.density"):
            decode(enc, sent_with=(run,))


# --------------------------------------------------------------------------------------------------------
# The union downlink, sized by each commit's islands


def _kept_per_chunk(enc: EncodedTensor) -> int:
    """The count of values a sparse tensor keeps in each chunk but the last, from its header."""
    return int.from_bytes(bytes(enc.payload)[4:8], "little")


def _union_config(tiny_config, *more: str):
    union = ["codec.uplink=sparse", "codec.downlink=sparse", "codec.chunk=256", "outer.kind=sparseloco"]
    union += ["outer.aggregate=mean", "islands.count=3", "islands.names=[a,b,c]", "islands.max=3"]
    return load_config(tiny_config, [*union, "quorum.min_islands=1", "train.checkpoint_every=0", *more])


def test_islands_accept_every_density_of_the_union_downlink_and_no_other(tiny_config):
    """The union downlink's commits come at n x density for n = 1 to islands.max: an island accepts those (a wire
    field, checked against the run) and refuses any other; a density set by hand is the one the run sends."""
    cfg = _union_config(tiny_config)
    up = cfg.codec.spec("uplink")
    assert cfg.union_downlink and [s.density for s in cfg.downlink_specs()] == [up.density * n for n in (1, 2, 3)]
    by_hand = _union_config(tiny_config, "codec.downlink_density=0.5")
    assert not by_hand.union_downlink and by_hand.downlink_specs() == (by_hand.codec.spec("downlink"),)
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    for n in (1, 2, 3):
        decode(encode("w", x, cfg.codec.spec("downlink").union(n, up.density)), sent_with=cfg.downlink_specs())
    for other in (cfg.codec.spec("downlink").union(4, up.density), by_hand.codec.spec("downlink")):
        with pytest.raises(CodecError, match="tensor 'w': sparse header says"):
            decode(encode("w", x, other), sent_with=cfg.downlink_specs())
    assert cfg.codec.spec("downlink").union(10**6, up.density).density == 1.0  # never more than whole chunks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_union_downlink_follows_the_islands_of_each_commit(tiny_config, tmp_path, monkeypatch):
    """outer.kind = "sparseloco", sparse both ways, codec.downlink_density unset: a real coordinator sends a commit
    of n islands' Δ at n x density (their union), so retiring islands shrinks it round by round, and islands decode
    each commit at the density it came with."""
    import diloco.coordinator.settler as settler_module
    from diloco import RELEASE
    from diloco.coordinator.coordinator import Coordinator
    from diloco.run.rundir import RunDir
    from diloco.run.setup import build_setup
    from pytrees.encode import encode_named
    from pytrees.naming import flatten_named
    from transport import diloco_pb2 as pb
    from transport.chunking import payload_digest

    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)  # no island pulls: each commit is evaluated at once
    cfg = _union_config(tiny_config)
    up = cfg.codec.spec("uplink")
    rd = RunDir(tmp_path / "run", cfg)
    coord = Coordinator(cfg, rd, build_setup(cfg, islands=()))
    rng = np.random.default_rng(0)
    kept, commits = [], []
    try:
        for island in coord.enrollment.names:  # members: each round waits for every live one
            coord.join(pb.JoinRequest(run_id=coord.run_id, island=island, last_round=-1, config_digest=coord.digest,
                                      release=RELEASE))  # fmt: skip
        for retire in ("c", "b", None):
            for island in coord.enrollment.names:
                shapes = {k: np.shape(v) for k, v in flatten_named(coord.loop.params).items()}
                named = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()}
                tensors = encode_named(named, up)
                fields = {"run_id": coord.run_id, "island": island, "round": coord.loop.round, "tokens": 128}
                fields |= {"loss": 1.0, "base_digest": bytes.fromhex(coord.world.params_digest)}
                assert coord.push(pb.PushMeta(**fields), tensors, named, payload_digest(tensors)).accepted
            commit = coord.window.last
            assert commit is not None and commit.round == len(commits), "the round did not close"
            commits.append(commit)
            kept.append(_kept_per_chunk(max(commit.encoded, key=lambda t: t.numel)))
            if retire:
                coord.retire(pb.RetireRequest(run_id=coord.run_id, island=retire, reason="test"), by="operator")
    finally:
        coord.close()
        rd.close()
    assert [c.islands for c in commits] == [("a", "b", "c"), ("a", "b"), ("a",)]
    assert kept == [up.kept(256) * n for n in (3, 2, 1)], kept
    for commit in commits:  # what an island decodes: every density the run sends
        for t in commit.encoded:
            decode(t, sent_with=cfg.downlink_specs())
