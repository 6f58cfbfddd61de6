"""Tests for the codecs (floor.codec, pytrees.encode, pytrees.naming, pytrees.feedback): round-trip error bounds,
determinism, refusal of bad input and bad bytes."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from floor.codec import KINDS, QMAX, CodecError, CodecSpec, EncodedTensor, decode, decode_named, raw_payload_nbytes
from pytrees.encode import encode, encode_named
from pytrees.feedback import compress_named, compress_with_feedback
from pytrees.naming import flatten_named, unflatten_named
from tests.test_codec_sparse import assert_sparse_bound

# A small fixed set of sizes and block sizes keeps the number of distinct jit compilations (one per flat
# size and block size) low, while covering empty, 1-element, odd, and not-a-multiple-of-the-block sizes.
SIZES = [0, 1, 2, 3, 5, 17, 255, 256, 257, 600]
BLOCKS = [2, 6, 256]
PROP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw: st.DrawFn, max_abs: float = 1e30) -> np.ndarray:
    n = draw(st.sampled_from(SIZES))
    shape: tuple[int, ...]
    if n == 1 and draw(st.booleans()):
        shape = ()
    elif n and n % 5 == 0 and draw(st.booleans()):
        shape = (5, n // 5)
    else:
        shape = (n,)
    style = draw(st.sampled_from(["any", "scaled", "zeros_and_scaled"]))
    if style == "any":  # arbitrary float32 incl. subnormals, 0, +-max_abs
        lim = float(np.float32(max_abs))
        return draw(hnp.arrays(np.float32, shape, elements=st.floats(-lim, lim, width=32)))
    seed = draw(st.integers(0, 2**32 - 1))
    mag = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e30]))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * mag).astype(np.float32)
    if style == "zeros_and_scaled" and n:
        x[: max(1, n // 2)] = 0.0  # whole blocks of zeros next to non-zero blocks
    return x.reshape(shape)


def _blocks(flat: np.ndarray, block: int) -> list[np.ndarray]:
    return [flat[i : i + block] for i in range(0, flat.size, block)]


def assert_within_bound(x: np.ndarray, xh: np.ndarray, spec: CodecSpec) -> None:
    """The per-element bound documented in the module docstring."""
    assert xh.shape == x.shape and xh.dtype == np.float32
    x64, xh64 = x.astype(np.float64).reshape(-1), xh.astype(np.float64).reshape(-1)
    if spec.kind == "fp32":
        assert np.array_equal(x.view(np.uint32), xh.view(np.uint32))
    elif spec.kind == "bf16":
        assert np.all(np.abs(x64 - xh64) <= 2.0**-8 * np.abs(x64) + 2.0**-126)
    elif spec.kind == "sparse":
        assert_sparse_bound(x, xh, spec)  # its own contract: top-k within a bound, the rest exactly 0
    else:
        qmax = QMAX[spec.kind]
        for xb, xhb in zip(_blocks(x64, spec.block_size), _blocks(xh64, spec.block_size), strict=True):
            a = np.abs(xb).max()
            bound = a / (2 * qmax) + 2.0**-20 * a + qmax * 2.0**-126
            assert np.abs(xb - xhb).max() <= bound, (a, np.abs(xb - xhb).max(), bound)


specs = st.builds(
    CodecSpec,
    kind=st.sampled_from(KINDS),
    block_size=st.sampled_from(BLOCKS),
    zstd_level=st.sampled_from([0, 0, 1, 3]),
)


# --------------------------------------------------------------------------------------------------------
# CodecSpec


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kind": "int3"}, "codec.kind"),
        ({"block_size": 3}, "codec.block_size must be a positive multiple of 2 (got 3)"),
        ({"block_size": 0}, "codec.block_size"),
        ({"block_size": -2}, "codec.block_size"),
        ({"block_size": True}, "codec.block_size"),
        ({"block_size": 1 << 17}, "codec.block_size must be at most"),
        ({"zstd_level": 23}, "codec.zstd_level"),
        ({"zstd_level": -1}, "codec.zstd_level"),
        ({"zstd_level": 1.5}, "codec.zstd_level"),
    ],
)
def test_spec_validation_names_the_key(kwargs, needle):
    with pytest.raises(CodecError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        CodecSpec(**kwargs)
    assert issubclass(CodecError, ValueError)


def test_spec_defaults_and_frozen():
    spec = CodecSpec()
    assert (spec.kind, spec.block_size, spec.zstd_level) == ("int8", 256, 0)
    assert spec.bits_per_value() == pytest.approx(8.125)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kind = "int4"  # type: ignore[misc]


@pytest.mark.slow
def test_ratio_targets_before_zstd():
    x = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
    ratios = {k: x.nbytes / encode("w", x, CodecSpec(kind=k)).nbytes for k in KINDS}
    assert ratios["fp32"] == 1.0 and ratios["bf16"] == 2.0
    assert ratios["int8"] >= 3.9 and ratios["int4"] >= 7.5
    assert ratios["int8"] == pytest.approx(4 / (1 + 4 / 256))


# --------------------------------------------------------------------------------------------------------
# Round trip, determinism


@pytest.mark.slow
@PROP
@given(x=tensors(), spec=specs)
def test_round_trip_within_documented_bound(x, spec):
    enc = encode("t", x, spec)
    assert enc.shape == x.shape and enc.dtype == "float32" and enc.codec == spec.kind
    if not spec.zstd_level:
        size = enc.raw_nbytes if spec.kind == "sparse" else raw_payload_nbytes(spec.kind, x.size, spec.block_size)
        assert enc.nbytes == enc.raw_nbytes == size
    assert_within_bound(x, decode(enc), spec)


@PROP
@given(x=tensors(), spec=specs)
@pytest.mark.slow
def test_deterministic_bytes_and_arrays(x, spec):
    a, b = encode("t", x, spec), encode("t", x.copy(), spec)
    assert a == b
    d1 = decode(a)
    d2 = decode(dataclasses.replace(a, payload=bytes(bytearray(a.payload))))
    assert np.array_equal(d1.view(np.uint32), d2.view(np.uint32))


def test_zero_blocks_decode_exactly_and_tiny_blocks_keep_precision():
    x = np.zeros(1024, np.float32)
    x[512:768] = np.linspace(-1e-30, 1e-30, 256, dtype=np.float32)
    x[768:] = np.linspace(-1e30, 1e30, 256, dtype=np.float32)
    for kind in ("int8", "int4"):
        xh = decode(encode("t", x, CodecSpec(kind=kind)))
        assert np.all(xh[:512] == 0.0)
        for sl in (slice(512, 768), slice(768, 1024)):
            a = np.abs(x[sl]).max()
            assert np.abs(xh[sl] - x[sl]).max() <= a / (2 * QMAX[kind]) * (1 + 1e-5)


def test_jax_and_bfloat16_inputs():
    x = jnp.linspace(-2.0, 2.0, 999, dtype=jnp.float32).reshape(27, 37)
    enc = encode("j", x, CodecSpec(kind="int8", block_size=64))
    assert_within_bound(np.asarray(x), decode(enc), CodecSpec(kind="int8", block_size=64))
    xb = x.astype(jnp.bfloat16)
    enc = encode("b", xb, CodecSpec(kind="fp32"))
    out = decode(enc)
    assert enc.dtype == "bfloat16" and out.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(xb).view(np.uint16), out.view(np.uint16))  # lossless


def test_unaligned_and_strided_numpy_input():
    base = np.arange(4097, dtype=np.float32)
    x = base[1:]  # 4-byte offset: not 64-byte aligned, so the encoder copies it
    y = np.arange(8192, dtype=np.float32)[::2]  # not contiguous
    for arr in (x, y):
        assert_within_bound(arr, decode(encode("u", arr, CodecSpec(kind="int8"))), CodecSpec(kind="int8"))


# --------------------------------------------------------------------------------------------------------
# Refusals on the sending side


@PROP
@given(
    x=tensors(max_abs=1e3).filter(lambda a: a.size > 0),
    spec=specs,
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    where=st.integers(0, 10_000),
)
@pytest.mark.slow
def test_non_finite_refused_naming_the_tensor(x, spec, bad, where):
    x = x.copy()
    x.reshape(-1)[where % x.size] = bad
    with pytest.raises(CodecError, match="'layer/3/w'.*non-finite"):
        encode("layer/3/w", x, spec)


def test_bf16_overflow_and_bad_dtypes_refused():
    with pytest.raises(CodecError, match="too large for bfloat16"):
        encode("big", np.full(3, 3.4e38, np.float32), CodecSpec(kind="bf16"))
    with pytest.raises(CodecError, match="float64"):
        encode("d", np.zeros(3), CodecSpec())
    with pytest.raises(CodecError, match="int32"):
        encode("i", np.zeros(3, np.int32), CodecSpec())


# --------------------------------------------------------------------------------------------------------
# Refusals on the receiving side (malformed messages)


@pytest.mark.slow
@PROP
@given(x=tensors(max_abs=1e3), spec=specs, delta=st.integers(-3, 3).filter(lambda d: d != 0))
def test_wrong_payload_length_refused(x, spec, delta):
    enc = encode("t", x, spec)
    raw = zstandard.ZstdDecompressor().decompress(enc.payload) if spec.zstd_level else bytes(enc.payload)
    if len(raw) + delta < 0:
        delta = -delta
    raw = raw + b"\1" * delta if delta > 0 else raw[:delta]
    # With zstd on: a well-formed frame of the wrong size.
    bad = zstandard.ZstdCompressor(level=1).compress(raw) if spec.zstd_level else raw
    with pytest.raises(CodecError, match="'t'"):
        decode(dataclasses.replace(enc, payload=bad))


def test_zstd_bomb_refused():
    spec = CodecSpec(kind="int8", block_size=256, zstd_level=3)
    enc = encode("small", np.ones(1000, np.float32), spec)
    zeros = bytes(100 * 2**20)
    with_size = zstandard.ZstdCompressor(level=1).compress(zeros)
    no_size = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(zeros)
    assert len(with_size) < 10_000 and len(no_size) < 10_000
    with pytest.raises(CodecError, match="claims 104857600 bytes, expected 1016"):
        decode(dataclasses.replace(enc, payload=with_size))
    with pytest.raises(CodecError, match="bad zstd payload"):
        decode(dataclasses.replace(enc, payload=no_size))
    # Exactly the right size but with trailing bytes, or a second frame: refused too.
    good = enc.payload
    for bad in (good + b"junk", good + good, b"not zstd at all", b""):
        with pytest.raises(CodecError):
            decode(dataclasses.replace(enc, payload=bad))
    # A right-sized frame without a content size in its header is accepted.
    raw = zstandard.ZstdDecompressor().decompress(good)
    ok = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(raw)
    assert np.array_equal(decode(dataclasses.replace(enc, payload=ok)), decode(enc))


def _int8_message(scales: list[float], codes: list[int]) -> EncodedTensor:
    payload = np.asarray(scales, "<f4").tobytes() + np.asarray(codes, np.int8).tobytes()
    return EncodedTensor("m", "int8", "float32", (len(codes),), 2, 0, payload)


def test_forged_scales_refused():
    assert np.array_equal(decode(_int8_message([0.5], [2, -4])), [1.0, -2.0])
    for scales in ([math.nan], [math.inf], [-1.0]):
        with pytest.raises(CodecError, match="scales"):
            decode(_int8_message(scales, [1, 1]))
    # Finite scale, but code * scale overflows float32.
    with pytest.raises(CodecError, match="not finite"):
        decode(_int8_message([3.0e38], [-128, 127]))


def test_forged_float_payloads_refused():
    nan_f32 = np.array([1.0, np.nan], "<f4").tobytes()
    with pytest.raises(CodecError, match="not finite"):
        decode(EncodedTensor("f", "fp32", "float32", (2,), 0, 0, nan_f32))
    inf_bf16 = np.array([0x7F80, 0x3F80], "<u2").tobytes()
    with pytest.raises(CodecError, match="not finite"):
        decode(EncodedTensor("h", "bf16", "float32", (2,), 0, 0, inf_bf16))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"codec": "int2"}, "unknown codec"),
        ({"dtype": "float64"}, "unsupported dtype"),
        ({"shape": (-1, 2)}, "invalid shape"),
        ({"shape": [2]}, "invalid shape"),
        ({"shape": (1 << 40,)}, "exceeds the size limit"),
        ({"block_size": 3}, "invalid block size"),
        ({"block_size": 0}, "invalid block size"),
        ({"zstd_level": 99}, "invalid zstd level"),
        ({"payload": "text"}, "payload must be bytes"),
    ],
)
def test_bad_metadata_refused(changes, needle):
    enc = encode("meta", np.ones(4, np.float32), CodecSpec(kind="int8", block_size=2))
    with pytest.raises(CodecError, match=needle):
        decode(dataclasses.replace(enc, **changes))


# --------------------------------------------------------------------------------------------------------
# Named trees


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Attn:
    wq: jax.Array
    wo: jax.Array


def _tree() -> dict:
    k = np.arange(12, dtype=np.float32)
    return {
        "embed": k.reshape(3, 4),
        "blocks": [{"attn": _Attn(wq=k[:6].reshape(2, 3), wo=k[:4]), "ln": (k[:2], k[:1])} for _ in range(2)],
        "scalar": np.float32(1.5),
    }


def test_flatten_named_paths_sorted_and_unflatten_round_trip():
    tree = _tree()
    named = flatten_named(tree)
    assert list(named) == sorted(named)
    assert set(named) == {
        "embed",
        "scalar",
        *(f"blocks/{i}/{leaf}" for i in range(2) for leaf in ("attn/wq", "attn/wo", "ln/0", "ln/1")),
    }
    assert all(isinstance(v, np.ndarray) for v in named.values())
    assert named["blocks/1/attn/wq"].shape == (2, 3)
    back = unflatten_named(named, tree)
    assert isinstance(back["blocks"][0]["attn"], _Attn)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b), back, tree))
    assert flatten_named(jnp.ones(3)).keys() == {"value"}
    assert isinstance(flatten_named({"a": jnp.ones(2)}, to_numpy=False)["a"], jax.Array)


def test_named_tree_mismatches_refused():
    tree = _tree()
    named = flatten_named(tree)
    with pytest.raises(CodecError, match="missing \\['embed'\\]"):
        unflatten_named({k: v for k, v in named.items() if k != "embed"}, tree)
    with pytest.raises(CodecError, match="unexpected \\['extra'\\]"):
        unflatten_named({**named, "extra": np.ones(1)}, tree)
    with pytest.raises(CodecError, match="'embed' has shape \\(4, 3\\)"):
        unflatten_named({**named, "embed": np.ones((4, 3))}, tree)
    with pytest.raises(CodecError, match="share the name 'a/b'"):
        flatten_named({"a/b": np.ones(1), "a": {"b": np.ones(1)}})


@pytest.mark.slow
def test_encode_named_decode_named():
    named = flatten_named(_tree())
    spec = CodecSpec(kind="int4", block_size=4, zstd_level=1)
    encoded = encode_named(named, spec)
    assert [e.name for e in encoded] == sorted(named)
    decoded = decode_named(encoded)
    assert list(decoded) == sorted(named)
    for name, x in named.items():
        assert_within_bound(x, decoded[name], spec)
    with pytest.raises(CodecError, match="appears twice"):
        decode_named(encoded + encoded[:1])


# --------------------------------------------------------------------------------------------------------
# Error feedback


def test_error_feedback_bounds_drift():
    """Small values next to a large one quantize to 0 every round: without feedback their sum is lost and
    the drift grows linearly; with feedback the drift is the current residual, bounded by one step."""
    rng = np.random.default_rng(0)
    spec = CodecSpec(kind="int4", block_size=256)
    rounds = 200
    sum_x = np.zeros(256, np.float64)
    sum_fb = np.zeros(256, np.float64)
    sum_plain = np.zeros(256, np.float64)
    residual = None
    for _ in range(rounds):
        x = (0.01 + 0.002 * rng.standard_normal(256)).astype(np.float32)
        x[0] = 1.0
        enc, dec, residual = compress_with_feedback(x, residual, spec, name="w")
        assert np.array_equal(dec, decode(enc))  # what is kept is exactly what the receiver gets
        sum_x += x
        sum_fb += dec
        sum_plain += decode(encode("w", x, spec))
    drift_fb = np.abs(sum_x - sum_fb).max()
    drift_plain = np.abs(sum_x - sum_plain).max()
    step_bound = 1.1 / (2 * QMAX["int4"])  # absmax of x + e stays below 1.1
    assert drift_fb <= step_bound
    assert np.allclose(sum_x - sum_fb, residual, atol=1e-4)  # drift == residual (up to float sums)
    assert drift_plain >= 0.5 * 0.01 * rounds  # grows with the number of rounds


def test_tree_feedback_and_residual_shape_check():
    named = {"a": np.full(10, 0.3, np.float32), "b": np.linspace(-1, 1, 7, dtype=np.float32)}
    spec = CodecSpec(kind="int4", block_size=2)
    enc, dec, res = compress_named(named, None, spec)
    assert [e.name for e in enc] == ["a", "b"]
    for k in named:
        assert np.array_equal(named[k] - dec[k], res[k])
    enc2, dec2, res2 = compress_named(named, res, spec)
    assert np.array_equal(res2["a"], named["a"] + res["a"] - dec2["a"])
    with pytest.raises(CodecError, match="residual shape"):
        compress_with_feedback(named["a"], np.zeros(3, np.float32), spec, name="a")
