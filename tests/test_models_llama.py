"""The Llama family (islands/models/llama.py) and GPT-2's attention biases: the params layout, causality, grouped-query
attention against multi-head attention with repeated key/value heads, rotary embeddings and Llama 3's frequency
scaling against direct formulas, tied against untied embeddings, remat and bfloat16, the routed SwiGLU experts against
a per-token loop, config errors, and the parts every model meets (Muon's split, fragments by layer, the memory plan,
`diloco simulate` with codecs, streaming and the post-training workloads)."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from islands.models import llama, moe, transformer
from islands.models.base import Model, param_count
from islands.models.config import ModelConfig, ModelError
from islands.models.registry import ARCHITECTURES, build_model
from outer_optimizer.fragments import Fragments
from pytrees.naming import flatten_named

REPO = Path(__file__).resolve().parents[1]

# Grouped-query (2 query heads per key/value head), Qwen3's head width apart from d_model / n_heads and its q/k norms,
# Qwen2's biases, an own lm_head, Llama 3's rope scaling (its original context shorter than seq_len, so it bites).
# A larger init scale than training's makes the logits far apart, so a wrong head or position shows.
DENSE = ModelConfig(kind="llama", vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=12, d_ff=48, qk_norm=True, qkv_bias=True, tie_embeddings=False, rope_theta=500.0,
                    rope_scaling="llama3", rope_scaling_original_max_position=8, norm_eps=1e-6, init_scale=0.2)  # fmt: skip
EXPERTS = ModelConfig(kind="llama_moe", vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                      d_ff=24, n_experts=4, top_k=2, shared_expert_d_ff=20, init_scale=0.2)  # fmt: skip


@functools.cache
def built(cfg: ModelConfig) -> tuple[Model, dict]:
    model = build_model(cfg)
    return model, jax.jit(model.init)(jax.random.key(0))


@functools.partial(jax.jit, static_argnums=0)
def logits_of(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    return transformer.forward(params, tokens, cfg, ARCHITECTURES[cfg.kind])[0]


def tokens_of(cfg: ModelConfig, batch: int = 3, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)


def with_biases(params: dict, seed: int = 5) -> dict:
    """params with every zero-initialised bias and every norm scale of ones drawn at random, so a test sees them."""
    keys = iter(jax.random.split(jax.random.key(seed), 4 * len(jax.tree.leaves(params))))

    def draw(path: tuple, leaf: jax.Array) -> jax.Array:
        name = jax.tree_util.keystr(path)
        if "'b" in name or "scale" in name:
            return leaf + 0.3 * jax.random.normal(next(keys), leaf.shape)
        return leaf

    return jax.tree_util.tree_map_with_path(draw, params)


@pytest.mark.slow
def test_the_params_follow_the_documented_layout():
    _, params = built(DENSE)
    d, v, hq, hkv, dh, f = 32, 64, 4, 2, 12, 48
    attn = params["blocks"][0]["attn"]
    shapes = {name: leaf.shape for name, leaf in flatten_named(attn).items()}
    assert shapes == {"wq": (d, hq * dh), "wk": (d, hkv * dh), "wv": (d, hkv * dh), "wo": (hq * dh, d),
                      "bq": (hq * dh,), "bk": (hkv * dh,), "bv": (hkv * dh,),
                      "q_norm/scale": (dh,), "k_norm/scale": (dh,)}  # fmt: skip
    ff = params["blocks"][1]["ff"]
    assert {k: w.shape for k, w in ff.items()} == {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    assert params["embed"]["tok"].shape == (v, d) and params["lm_head"].shape == (d, v)
    assert set(params) == {"embed", "blocks", "final_norm", "lm_head"} and params["final_norm"]["scale"].shape == (d,)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    per_block = 2 * d + (d * hq * dh * 2 + 2 * d * hkv * dh) + (hq * dh + 2 * hkv * dh) + 2 * dh + 3 * d * f
    assert param_count(params) == v * d + 2 * per_block + d + d * v
    _, moe_params = built(EXPERTS)
    e, fe, fs = 4, 24, 20
    shapes = {name: leaf.shape for name, leaf in flatten_named(moe_params["blocks"][0]["ff"]).items()}
    assert shapes == {"router": (d, e), "w_gate": (e, d, fe), "w_up": (e, d, fe), "w_down": (e, fe, d),
                      "shared/w_gate": (d, fs), "shared/w_up": (d, fs), "shared/w_down": (fs, d),
                      "shared/gate": (d, 1)}  # fmt: skip
    assert "lm_head" not in moe_params and "bq" not in moe_params["blocks"][0]["attn"]


@pytest.mark.slow
def test_gpt2_attention_biases_are_optional_and_used():
    plain = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    assert "bqkv" not in built(plain)[1]["blocks"][0]["attn"]  # the default layout (and its digests) as they were
    cfg = replace(plain, attn_bias=True)
    _, params = built(cfg)
    assert {k: w.shape for k, w in params["blocks"][0]["attn"].items()} == {
        "wqkv": (32, 96), "wo": (32, 32), "bqkv": (96,), "bo": (32,)}  # fmt: skip
    tokens = tokens_of(cfg)[:, :-1]
    zero = logits_of(cfg, params, tokens)
    np.testing.assert_array_equal(zero, logits_of(plain, built(plain)[1], tokens))  # zero biases: GPT-2 as it was
    assert float(jnp.abs(logits_of(cfg, with_biases(params), tokens) - zero).max()) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [DENSE, EXPERTS], ids=["llama", "llama_moe"])
def test_causal_future_tokens_do_not_change_the_past(cfg):
    _, params = built(cfg)
    params = with_biases(params)
    tokens = tokens_of(cfg)[:, :-1]
    j = 9
    changed = tokens.at[:, j].set((tokens[:, j] + 1) % cfg.vocab_size)
    before, after = logits_of(cfg, params, tokens), logits_of(cfg, params, changed)
    np.testing.assert_allclose(before[:, :j], after[:, :j], atol=1e-5)
    assert float(jnp.abs(before[:, j:] - after[:, j:]).max()) > 1e-3


@pytest.mark.slow
def test_grouped_query_attention_is_multi_head_attention_with_repeated_key_value_heads():
    """Query head h reads key/value head h // (n_heads / n_kv_heads): the same model with every key/value head's
    weights repeated for each of its query heads, as multi-head attention, gives the same logits."""
    _, params = built(DENSE)
    params = with_biases(params)
    mha_cfg = replace(DENSE, n_kv_heads=DENSE.n_heads)
    group, dh = DENSE.n_heads // DENSE.kv_heads, DENSE.head_size

    def repeat_heads(w: jax.Array) -> jax.Array:  # [..., Hkv * Dh] -> [..., Hq * Dh]
        heads = w.reshape(*w.shape[:-1], DENSE.kv_heads, dh)
        return jnp.repeat(heads, group, axis=-2).reshape(*w.shape[:-1], DENSE.n_heads * dh)

    mha = jax.tree.map(lambda x: x, params)
    for block in mha["blocks"]:
        for name in ("wk", "wv", "bk", "bv"):
            block["attn"][name] = repeat_heads(block["attn"][name])
    tokens = tokens_of(DENSE)[:, :-1]
    np.testing.assert_allclose(logits_of(DENSE, params, tokens), logits_of(mha_cfg, mha, tokens), atol=1e-5)


@pytest.mark.slow
def test_rotary_embedding_against_the_pairwise_rotation():
    """Dimension i and i + Dh/2 of a head rotate together by position * θ^(-2i/Dh) (the rotate_half convention)."""
    cfg = replace(DENSE, rope_scaling="none", rope_theta=10000.0, head_dim=8)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [7, 3, 11, 0, 15]], np.int32)
    got = np.asarray(llama.rotate(jnp.asarray(x), jnp.asarray(positions), llama.inverse_frequencies(cfg)))
    want = np.empty_like(x, dtype=np.float64)
    for i in range(4):
        angle = positions[:, :, None] * 10000.0 ** (-2 * i / 8)
        a, b = x[..., i].astype(np.float64), x[..., i + 4].astype(np.float64)
        want[..., i] = a * np.cos(angle) - b * np.sin(angle)
        want[..., i + 4] = b * np.cos(angle) + a * np.sin(angle)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # What attention sees depends on the distance only: <rot(q, p), rot(k, s)> = <rot(q, p + 3), rot(k, s + 3)>.
    inv = llama.inverse_frequencies(cfg)
    q, k = jnp.asarray(x[:1, :1]), jnp.asarray(x[1:, :1])

    def dot(p: int, s: int) -> float:
        rq = llama.rotate(q, jnp.full((1, 1), p), inv)
        rk = llama.rotate(k, jnp.full((1, 1), s), inv)
        return np.asarray(jnp.sum(rq * rk, -1))

    np.testing.assert_allclose(dot(2, 5), dot(5, 8), atol=1e-5)


def test_llama3_rope_scaling_against_the_reference_loop():
    """Llama 3.1's frequencies: Meta's `apply_scaling` (llama-models, reference/model.py), one frequency at a time."""
    cfg = ModelConfig(kind="llama", d_model=4096, n_heads=32, rope_theta=500000.0, rope_scaling="llama3",
                      rope_scaling_factor=8.0, rope_scaling_low_freq_factor=1.0, rope_scaling_high_freq_factor=4.0,
                      rope_scaling_original_max_position=8192, seq_len=64)  # fmt: skip
    plain = [500000.0 ** (-i / 128) for i in range(0, 128, 2)]
    want = []
    for freq in plain:
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            want.append(freq)
        elif wavelen > 8192 / 1.0:
            want.append(freq / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * freq / 8.0 + smooth * freq)
    got = llama.inverse_frequencies(cfg)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert (got < np.asarray(plain, np.float32)).sum() > 20  # the low frequencies did change
    np.testing.assert_allclose(llama.inverse_frequencies(replace(cfg, rope_scaling="none")), plain, rtol=1e-5)


@pytest.mark.slow
def test_tied_embeddings_are_an_lm_head_equal_to_the_transposed_table():
    _, untied = built(DENSE)
    tied_cfg = replace(DENSE, tie_embeddings=True)
    _, tied = built(tied_cfg)
    assert "lm_head" not in tied and param_count(untied) - param_count(tied) == DENSE.d_model * DENSE.vocab_size
    as_untied = {**tied, "lm_head": tied["embed"]["tok"].T}
    tokens = tokens_of(DENSE)[:, :-1]
    np.testing.assert_allclose(logits_of(DENSE, as_untied, tokens), logits_of(tied_cfg, tied, tokens), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [DENSE, EXPERTS], ids=["llama", "llama_moe"])
def test_remat_gives_the_same_loss_and_gradients(cfg):
    model, params = built(cfg)
    batch = tokens_of(cfg)
    grad = jax.jit(jax.value_and_grad(model.loss, has_aux=True))
    (loss, _), grads = grad(params, batch)
    (remat_loss, _), remat_grads = jax.jit(
        jax.value_and_grad(build_model(replace(cfg, remat=True)).loss, has_aux=True)
    )(params, batch)
    assert float(remat_loss) == pytest.approx(float(loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_bfloat16_compute_keeps_the_loss_and_float32_master_weights():
    model, params = built(DENSE)
    batch = tokens_of(DENSE, batch=8)
    loss32 = float(jax.jit(model.loss)(params, batch)[0])
    half = build_model(replace(DENSE, compute_dtype="bfloat16"))
    loss16, grads = jax.jit(jax.value_and_grad(lambda p: half.loss(p, batch)[0]))(params)
    assert abs(float(loss16) - loss32) < 0.02 * loss32
    assert all(g.dtype == jnp.float32 and bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_routed_swiglu_experts_against_a_per_token_loop():
    """Each token: softmax over the router's logits, its top_k experts' SwiGLU outputs weighted by their (with
    norm_topk_prob renormalised) probabilities, plus the shared expert times sigmoid(x @ gate) (Qwen2-MoE)."""
    p = jax.tree.map(np.asarray, moe.init_swiglu_experts(jax.random.key(0), EXPERTS))
    x = np.random.default_rng(0).standard_normal((2, 3, 32)).astype(np.float32)
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    for normalize in (True, False):
        cfg = replace(EXPERTS, norm_topk_prob=normalize)
        got, aux = jax.jit(moe.swiglu_experts, static_argnums=2)(p, jnp.asarray(x), cfg)
        want = np.zeros_like(x, dtype=np.float64)
        for b, t in np.ndindex(2, 3):
            token = x[b, t].astype(np.float64)
            logits = token @ p["router"]
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            top = np.argsort(-probs)[:2]
            gates = probs[top] / probs[top].sum() if normalize else probs[top]
            for e, g in zip(top, gates, strict=True):
                want[b, t] += g * (silu(token @ p["w_gate"][e]) * (token @ p["w_up"][e])) @ p["w_down"][e]
            s = p["shared"]
            shared = (silu(token @ s["w_gate"]) * (token @ s["w_up"])) @ s["w_down"]
            want[b, t] += shared / (1 + np.exp(-(token @ s["gate"])))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
        assert 1.0 <= float(aux) <= EXPERTS.n_experts


def test_a_gqa_cache_holds_only_the_key_value_heads():
    cache = transformer.init_cache(DENSE, batch=2, length=5)
    assert cache.k.shape == (DENSE.n_layers, 2, DENSE.n_kv_heads, 5, DENSE.head_dim)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kind": "llama", "n_kv_heads": 3}, "model.n_kv_heads (3) must divide model.n_heads (4)"),
        ({"kind": "llama", "n_kv_heads": -1}, "model.n_kv_heads must be >= 0 (got -1)"),
        ({"kind": "llama", "head_dim": 7}, "model.head_dim (7) must be even"),
        ({"kind": "llama", "d_model": 130}, "or model.head_dim set"),
        ({"kind": "llama", "sliding_window": 32}, "model.sliding_window (32) below model.seq_len (64)"),
        ({"kind": "llama", "rope_theta": 0}, "model.rope_theta must be a finite number > 0 (got 0)"),
        ({"kind": "llama", "rope_scaling": "yarn"}, "model.rope_scaling must be one of none, llama3 (got 'yarn')"),
        (
            {"kind": "llama", "rope_scaling": "llama3", "rope_scaling_high_freq_factor": 1.0},
            "model.rope_scaling_high_freq_factor (1.0) must be > model.rope_scaling_low_freq_factor (1.0)",
        ),
        ({"kind": "llama", "qk_norm": 1}, "model.qk_norm must be true or false (got 1)"),
        ({"kind": "llama", "shared_expert_d_ff": 8}, 'model.shared_expert_d_ff needs model.kind = "llama_moe"'),
        ({"kind": "llama", "norm_eps": -1e-6}, "model.norm_eps must be a finite number > 0"),
        ({"n_kv_heads": 2}, "model.n_kv_heads (grouped-query attention) needs model.kind llama or llama_moe"),
        ({"head_dim": 8}, "model.head_dim other than d_model / n_heads needs model.kind llama or llama_moe"),
        ({"kind": "moe", "qk_norm": True}, "model.qk_norm needs model.kind llama or llama_moe"),
        ({"tie_embeddings": False}, "model.tie_embeddings needs model.kind llama or llama_moe"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ModelError) as err:
        ModelConfig(**overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_window_as_wide_as_the_context_is_no_window():
    cfg = ModelConfig(kind="llama", seq_len=64, sliding_window=4096)  # Mistral 7B's window on a shorter context
    assert cfg.sliding_window == 4096 and ModelConfig(kind="transformer", n_kv_heads=4, head_dim=32).kv_heads == 4


@pytest.mark.slow
def test_muon_takes_the_family_s_matrices_and_adamw_the_rest():
    from tests.test_muon import split

    muon = {name.split("/", 2)[2] for name, axes in split(built(EXPERTS)[1]).items() if axes and "/0/" in name}
    assert muon == {"attn/wq", "attn/wk", "attn/wv", "attn/wo", "ff/router", "ff/w_gate", "ff/w_up", "ff/w_down",
                    "ff/shared/w_gate", "ff/shared/w_up", "ff/shared/w_down"}  # fmt: skip
    taken = {name for name, axes in split(built(DENSE)[1]).items() if axes}
    assert not any(name.startswith(("embed", "lm_head", "final_norm")) or "norm" in name for name in taken)
    assert {name.rsplit("/", 1)[1] for name in taken} == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


def test_fragments_cut_the_family_by_layer():
    params = jax.eval_shape(build_model(replace(DENSE, n_layers=4)).init, jax.random.key(0))
    sizes = {name: math.prod(leaf.shape) for name, leaf in flatten_named(params, to_numpy=False).items()}
    fragments = Fragments.split(sizes, 2, "contiguous")
    for p in range(2):
        held = fragments.select(p, sizes)
        layers = {name.split("/")[1] for name in held if name.startswith("blocks/")}
        assert layers == {str(2 * p), str(2 * p + 1)}
    assert sum(len(fragments.select(p, sizes)) for p in range(2)) == len(sizes)  # lm_head included, once


@pytest.mark.slow
def test_the_memory_plan_counts_the_family_s_shapes(tiny_config: Path) -> None:
    from diloco.run.memory_plan import plan
    from tests.test_memory_plan import _islands

    overrides = ["model.kind=llama", "model.n_kv_heads=1", "model.tie_embeddings=false", "codec.uplink=int8"]
    cfg, setup, islands, evaluate = _islands(tiny_config, overrides)
    process = plan(cfg, setup, islands, evaluate)
    d, v, f, kv = 32, 256, 64, 16  # tiny_config's sizes; one key/value head of 16
    per_block = 2 * d + (2 * d * d + 2 * d * kv) + 3 * d * f
    assert process.params == 4 * (2 * v * d + per_block + d)
    assert process.step is not None and process.step.temp > 0


@pytest.mark.slow
def test_llama_tiny_simulates_with_codecs_and_streaming(tmp_path: Path) -> None:
    from diloco.config import load_config
    from diloco.simulator.simulate import run_simulation
    from tests.conftest import write_corpus

    fast = [
        "train.rounds=2",
        "train.inner_steps=4",
        "train.eval_batches=1",
        f"data.path={write_corpus(tmp_path / 'c')}",
    ]
    config = REPO / "configs" / "llama-tiny.toml"
    streamed = ["codec.uplink=int8", "codec.downlink=int8", "stream.fragments=2", "model.remat=true"]
    summary = run_simulation(load_config(config, [*fast, *streamed]), tmp_path / "run", show_progress=False)
    assert summary["rounds"] == 2 and summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.slow
def test_sft_and_rl_islands_train_a_llama(tiny_config: Path, tmp_path: Path) -> None:
    """The post-training workloads on the family: an sft island and an rl island (the sampler's cached forward, the
    token log-probabilities of policy and reference) in one simulate."""
    from diloco.config import load_config
    from diloco.simulator.simulate import run_simulation

    overrides = ["model.kind=llama", "model.n_kv_heads=1", "workload.kind=sft", "workload.task=addition",
                 "workload.task_examples=200", "workload.heldout_examples=8", "workload.max_new_tokens=4",
                 "workload.reward=builtin:addition", 'workload.islands=["island-1=rl"]', "train.rounds=1"]  # fmt: skip
    summary = run_simulation(load_config(tiny_config, overrides), tmp_path / "run", show_progress=False)
    assert set(summary["final_scores"]) == {"sft_ce", "sft_exact_match", "rl_reward", "rl_exact_match"}
    assert all(math.isfinite(x) for x in summary["final_scores"].values())


def test_the_models_bench_compares_blocks_of_equal_parameters():
    from diloco.bench.models import block_params, family_configs

    rows = family_configs(d_model=256, heads=8, kv_heads=2, layers=1, seq_len=32, dtype="float32")
    counts = {name: block_params(cfg, arch) for name, (cfg, arch) in rows.items()}
    # 8 D / 3 with multi-head attention (and GPT-2's biases, 3 columns' worth); grouped-query pays back in width
    assert abs(rows["llama"][0].d_ff - 8 * 256 / 3) < 4 and rows["llama_gqa"][0].d_ff > rows["llama"][0].d_ff
    assert all(abs(n - counts["gpt2"]) <= 3 * 256 for n in counts.values())  # within one SwiGLU column of the target
