"""Generation with a KV cache (islands/sampling.py): exact against the full forward, greedy against argmax
re-forwarding, the nucleus of a hand-made distribution, stop tokens and padding, token log-probabilities, errors."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from islands import sampling
from islands.models import transformer
from islands.models.config import ModelConfig
from islands.models.registry import ARCHITECTURES, build_model
from islands.sampling import PAD, SamplingError, generate, nucleus, rollout, token_logprobs
from tests.conftest import REPO, child_env

# A larger init scale than training's makes the logits of an untrained model far apart, so that a wrong position,
# a padding token attended or a stale cache entry changes them well beyond the tolerances below.
TINY = ModelConfig(vocab_size=48, seq_len=20, d_model=32, n_layers=2, n_heads=4, d_ff=64, init_scale=0.3)
PROMPTS = np.array([[5, 9, 3, 41, 41, 41], [7, 1, 2, 3, 4, 5], [30, 41, 41, 41, 41, 41]], np.int32)
"""Three prompts of lengths 3, 6 and 1, padded with token 41 (which the model would notice if it attended it)."""
LENS = np.array([3, 6, 1], np.int32)
NEW = 8
FAMILY_KEYS = {
    "llama": {"n_kv_heads": 2, "qk_norm": True, "tie_embeddings": False, "rope_theta": 100.0},
    "llama_moe": {"n_kv_heads": 1, "shared_expert_d_ff": 16},
}
"""The Llama family's tiny models: grouped-query (a cache of 2 and of 1 key/value heads), Qwen3's q/k norms, an lm_head."""


@functools.cache
def model(kind: str = "transformer", dtype: str = "float32") -> tuple[ModelConfig, dict]:
    cfg = replace(TINY, kind=kind, compute_dtype=dtype, **FAMILY_KEYS.get(kind, {}))
    return cfg, jax.jit(build_model(cfg).init)(jax.random.key(0))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(cfg: ModelConfig, params: dict, rows: jax.Array) -> jax.Array:
    return transformer.forward(params, rows, cfg, ARCHITECTURES[cfg.kind])[0]


def full_logits(cfg: ModelConfig, params: dict, row: np.ndarray) -> np.ndarray:
    """The full forward's logits [T, V] of one unpadded sequence (no cache; jitted, one compile per length)."""
    return np.asarray(_forward(cfg, params, jnp.asarray(row)[None])[0])


def continue_rows(cfg: ModelConfig, params: dict, **kw: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    kw = {"temperature": 1.0, "top_p": 1.0, "stop_token": None, "key": jax.random.key(3), **kw}
    tokens, lengths, logits = rollout(
        params,
        cfg,
        jnp.asarray(PROMPTS),
        jnp.asarray(LENS),
        kw["key"],
        jnp.float32(kw["temperature"]),
        jnp.float32(kw["top_p"]),
        max_new_tokens=NEW,
        stop_token=kw["stop_token"],
        keep_logits=True,
    )
    return np.asarray(tokens), np.asarray(lengths), np.asarray(logits)


# bfloat16: the cache and the full forward round their matmuls of different shapes differently, by a few bfloat16 ulps
# (2^-6 at |logit| in [2, 4)): 0.05 + 2 % of the logit, far below the gap a wrong position or an attended pad makes.
@pytest.mark.slow
@pytest.mark.parametrize(("kind", "dtype", "atol", "rtol"), [("transformer", "float32", 1e-5, 0),
                                                              ("moe", "float32", 1e-5, 0),
                                                              ("transformer", "bfloat16", 0.05, 0.02),
                                                              ("llama", "float32", 1e-5, 0),
                                                              ("llama_moe", "float32", 1e-5, 0),
                                                              ("llama", "bfloat16", 0.05, 0.02)])  # fmt: skip
def test_cached_logits_equal_the_full_forward_at_every_generated_position(kind, dtype, atol, rtol):
    cfg, params = model(kind, dtype)
    tokens, lengths, logits = continue_rows(cfg, params)  # sampled at temperature 1: varied tokens
    assert (lengths == NEW).all()
    for b, n in enumerate(LENS):
        sequence = np.concatenate([PROMPTS[b, :n], tokens[b]])
        # The token at position n + i was drawn from the logits at position n + i - 1.
        reference = full_logits(cfg, params, sequence)[n - 1 : n - 1 + NEW]
        np.testing.assert_allclose(logits[b], reference, atol=atol, rtol=rtol)
    assert len({tuple(row) for row in tokens}) == len(tokens)  # the rows did not collapse onto one another


@pytest.mark.slow
def test_greedy_equals_argmax_reforwarding():
    cfg, params = model()
    tokens, lengths = generate(
        params, cfg, jnp.asarray(PROMPTS), jnp.asarray(LENS), key=jax.random.key(0), max_new_tokens=NEW, temperature=0
    )
    assert (np.asarray(lengths) == NEW).all()
    width = PROMPTS.shape[1] + NEW  # one padded shape for every re-forward: causal, so the padding is never seen
    forward = jax.jit(lambda p, row: transformer.forward(p, row[None], cfg, ARCHITECTURES[cfg.kind])[0][0])
    for b, n in enumerate(LENS):
        sequence = list(PROMPTS[b, :n])
        for _ in range(NEW):  # re-forward the whole sequence for every token, no cache
            row = np.zeros(width, np.int32)
            row[: len(sequence)] = sequence
            sequence.append(int(np.argmax(np.asarray(forward(params, jnp.asarray(row)))[len(sequence) - 1])))
        assert list(np.asarray(tokens[b])) == sequence[n:]


@pytest.mark.slow
def test_a_batched_row_continues_as_it_does_alone():
    cfg, params = model()
    batched, _ = generate(
        params, cfg, jnp.asarray(PROMPTS), jnp.asarray(LENS), key=jax.random.key(0), max_new_tokens=NEW, temperature=0
    )
    for b, n in enumerate(LENS):
        alone, _ = generate(
            params,
            cfg,
            jnp.asarray(PROMPTS[b : b + 1, :n]),
            jnp.asarray([n]),
            key=jax.random.key(0),
            max_new_tokens=NEW,
            temperature=0,
        )
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(batched[b]))


HAND_MADE = np.array([0.05, 0.5, 0.15, 0.3], np.float32)
"""Ranked: token 1 (0.5), token 3 (0.3), token 2 (0.15), token 0 (0.05); the masses before each are 0, 0.5, 0.8,
0.95 (exact in float32 for the first two)."""


@pytest.mark.parametrize(
    ("top_p", "nucleus_tokens"),
    [(0.2, {1}), (0.5, {1}), (0.500001, {1, 3}), (0.7, {1, 3}), (0.9, {1, 2, 3}), (0.96, {0, 1, 2, 3}),
     (1.0, {0, 1, 2, 3})],
)  # fmt: skip
@pytest.mark.slow
def test_top_p_keeps_exactly_the_nucleus(top_p, nucleus_tokens):
    keep = np.asarray(nucleus(jnp.asarray(HAND_MADE)[None], top_p))[0]
    assert set(np.flatnonzero(keep)) == nucleus_tokens


@pytest.mark.slow
def test_tokens_tied_at_the_nucleus_edge_are_all_kept():
    probs = jnp.asarray([[0.3, 0.4, 0.3], [0.25, 0.25, 0.5]], jnp.float32)
    assert np.asarray(nucleus(probs, 0.5)).tolist() == [[True, True, True], [False, False, True]]
    assert np.asarray(nucleus(probs, 0.6)).tolist() == [[True, True, True], [True, True, True]]


@pytest.mark.slow
def test_top_p_draws_from_the_renormalised_nucleus():
    logits = jnp.log(jnp.tile(jnp.asarray(HAND_MADE), (20_000, 1)))
    drawn = np.asarray(sampling.next_token(logits, jax.random.key(0), jnp.float32(1.0), jnp.float32(0.7)))
    counts = np.bincount(drawn, minlength=4) / len(drawn)
    assert counts[0] == counts[2] == 0  # outside the nucleus: never
    np.testing.assert_allclose(counts[[1, 3]], [0.5 / 0.8, 0.3 / 0.8], atol=0.015)


@pytest.mark.slow
def test_temperature_sharpens_and_zero_is_the_argmax():
    logits = jnp.log(jnp.tile(jnp.asarray(HAND_MADE), (20_000, 1)))
    cold = np.asarray(sampling.next_token(logits, jax.random.key(0), jnp.float32(0.5), jnp.float32(1.0)))
    # At temperature 0.5 the probabilities are p^2 renormalised: 0.25 / 0.3875 for token 1.
    assert np.mean(cold == 1) == pytest.approx(0.25 / (0.05**2 + 0.5**2 + 0.15**2 + 0.3**2), abs=0.015)
    greedy = sampling.next_token(logits[:3], jax.random.key(0), jnp.float32(0.0), jnp.float32(0.1))
    assert list(np.asarray(greedy)) == [1, 1, 1]


@pytest.mark.slow
def test_temperature_zero_is_deterministic_and_sampling_follows_its_key():
    cfg, params = model()
    prompts, lens = jnp.asarray(PROMPTS), jnp.asarray(LENS)

    def run(key: int, temperature: float, top_p: float = 1.0) -> np.ndarray:
        tokens, _ = generate(
            params,
            cfg,
            prompts,
            lens,
            key=jax.random.key(key),
            max_new_tokens=NEW,
            temperature=temperature,
            top_p=top_p,
        )
        return np.asarray(tokens)

    np.testing.assert_array_equal(run(0, 0.0), run(1, 0.0))
    np.testing.assert_array_equal(run(0, 0.0), run(2, 0.0, top_p=0.3))
    np.testing.assert_array_equal(run(5, 1.0), run(5, 1.0))
    assert not np.array_equal(run(5, 1.0), run(6, 1.0))


@pytest.mark.slow
def test_a_row_that_emits_the_stop_token_emits_padding_after_it():
    cfg, params = model()
    free, _, free_logits = continue_rows(cfg, params)
    stop = int(free[0, 2])  # row 0's third token; the same key draws the same tokens until a row stops
    tokens, lengths, logits = continue_rows(cfg, params, stop_token=stop)
    for b in range(len(PROMPTS)):
        hits = np.flatnonzero(free[b] == stop)
        n = hits[0] + 1 if len(hits) else NEW
        assert lengths[b] == n
        np.testing.assert_array_equal(tokens[b, :n], free[b, :n])
        assert (tokens[b, n:] == PAD).all()
        np.testing.assert_array_equal(logits[b, :n], free_logits[b, :n])
    assert lengths[0] == 3


@pytest.mark.slow
def test_every_row_stopped_ends_the_loop_with_padding():
    cfg, params = model()
    prompts, lens = jnp.asarray(PROMPTS[[1, 1]]), jnp.asarray(LENS[[1, 1]])  # two rows that stop together
    free, _ = generate(params, cfg, prompts, lens, key=jax.random.key(0), max_new_tokens=NEW, temperature=0)
    first = int(free[0, 0])
    tokens, lengths = generate(
        params, cfg, prompts, lens, key=jax.random.key(0), max_new_tokens=NEW, temperature=0, stop_token=first
    )
    assert list(np.asarray(lengths)) == [1, 1]
    assert np.asarray(tokens).tolist() == [[first] + [PAD] * (NEW - 1)] * 2


@pytest.mark.slow
def test_token_logprobs_against_prefix_forwards():
    cfg, params = model("moe")
    tokens = np.array([[3, 17, 4, 4, 40, 2, 9], [1, 1, 1, 1, 1, 1, 1]], np.int32)
    got = np.asarray(token_logprobs(params, cfg, jnp.asarray(tokens)))
    assert got.shape == (2, 6) and got.dtype == np.float32
    for t in range(6):  # each prefix forwarded on its own (both rows at once): the log-softmax of its last position
        prefix = _forward(cfg, params, jnp.asarray(tokens[:, : t + 1]))
        for b in range(2):
            last = np.asarray(prefix[b, -1], np.float64)
            logp = last - np.log(np.exp(last - last.max()).sum()) - last.max()
            assert got[b, t] == pytest.approx(logp[tokens[b, t + 1]], abs=1e-5)


@pytest.mark.slow
def test_token_logprobs_differentiate():
    cfg, params = model()
    tokens = jnp.asarray(PROMPTS)
    grads = jax.grad(lambda p: token_logprobs(p, cfg, tokens).sum())(params)
    assert float(jnp.abs(grads["blocks"][0]["attn"]["wqkv"]).max()) > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_new_tokens": 15}, "beyond model.seq_len (20)"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"prompt_lens": np.array([3, 0, 1])}, "prompt_lens must be in 1 .. 6"),
        ({"prompt_lens": np.array([3, 7, 1])}, "prompt_lens must be in 1 .. 6"),
        ({"kind": "custom"}, "a custom model has no forward this project can cache"),
    ],
)
def test_bad_requests_are_one_line(change, message):
    cfg, params = model()
    if "kind" in change:
        cfg = replace(cfg, kind="custom", entry="tests.custom_model:build")
    kw = {"max_new_tokens": NEW, "prompt_lens": LENS, **change}
    kw.pop("kind", None)
    with pytest.raises(SamplingError) as err:
        generate(params, cfg, jnp.asarray(PROMPTS), jnp.asarray(kw.pop("prompt_lens")), key=jax.random.key(0), **kw)
    assert message in str(err.value) and "\n" not in str(err.value)


MESH_CHILD = """
import json, jax, jax.numpy as jnp, numpy as np
from islands.mesh import Layout, build_mesh
from islands.models.axes import axis_units
from islands.models.registry import ARCHITECTURES, build_model
from islands.sampling import generate, place_rows
from tests.test_sampling import LENS, NEW, PROMPTS, TINY
params = jax.jit(build_model(TINY).init)(jax.random.key(0))
out = {}
for n, tensor in ((1, 1), (2, 1), (4, 2)):
    layout = Layout(build_mesh(n, tensor=tensor), False, axis_units(TINY))
    # 3 rows on 2 devices of the data axis: padded to 4, the extra row dropped after.
    placed, (prompts, lens) = place_rows(layout, params, PROMPTS, LENS)
    tokens, lengths = generate(placed, TINY, prompts, lens, key=jax.random.key(0), max_new_tokens=NEW, temperature=0)
    out[n] = {"tokens": np.asarray(tokens)[: len(PROMPTS)].tolist(), "devices": len(tokens.sharding.device_set),
              "rows": len(tokens), "tensor_split": sum("tensor" in x.sharding.spec for x in jax.tree.leaves(placed))}
print(json.dumps(out))
"""


@pytest.mark.multiprocess
def test_generation_runs_on_an_islands_mesh():
    done = subprocess.run(
        [sys.executable, "-c", MESH_CHILD],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(devices=4, jax_cache=True),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["1"]["devices"] == 1 and out["2"]["devices"] == 2 and out["2"]["rows"] == 4
    # A 2 x 2 mesh: rows over the data axis, heads, MLP and vocabulary over the tensor axis.
    assert out["4"]["devices"] == 4 and out["4"]["rows"] == 4 and out["4"]["tensor_split"] >= 8, out["4"]
    assert out["1"]["tokens"] == out["2"]["tokens"] == out["4"]["tokens"]
