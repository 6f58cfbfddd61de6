"""The Llama family of decoders (Llama 3.x, Qwen2 / 2.5 / 3, Mistral-style dense models, SmolLM2; with routed
experts, Qwen3-MoE, Mixtral and Qwen2-MoE) as a config plus a few pure functions over the shared blocks of
`transformer.py`.

What differs from the GPT-2 shape there: RMSNorm in place of LayerNorm (no bias; eps from model.norm_eps), rotary
position embeddings in place of learned ones (Su et al. 2021, arXiv 2104.09864, in Hugging Face's convention: each
head's two halves rotate together, `rotate_half`; base θ model.rope_theta; Llama 3.1's frequency scaling with
model.rope_scaling = "llama3"), a SwiGLU MLP without biases (Shazeer 2020, arXiv 2002.05202), grouped-query attention
(Ainslie et al. 2023, arXiv 2305.13245: model.n_kv_heads key/value heads, each shared by n_heads / n_kv_heads
query heads), heads of model.head_dim, optional q/k/v biases (Qwen2), optional RMSNorm of each head's queries and
keys before the rotation (Qwen3), and an output projection tied to the embedding or its own (model.tie_embeddings).
The numerics are those of transformers' modeling_llama.py / modeling_qwen3.py / modeling_qwen2_moe.py; the mixed
precision rules are transformer.py's (norm statistics, softmax, router and cross-entropy in float32).

Params layout (float32 leaves; weights are [in, out], applied as x @ w; the blocks are a list so Streaming DiLoCo
cuts fragments by layer). D = d_model, V = vocab_size, Hq = n_heads, Hkv = n_kv_heads (or n_heads), Dh = head_dim
(or D / Hq), F = d_ff, E = n_experts, Fs = shared_expert_d_ff:
    {"embed": {"tok": [V, D]},
     "blocks": [{"ln1": {"scale": [D]},
                 "attn": {"wq": [D, Hq*Dh], "wk": [D, Hkv*Dh], "wv": [D, Hkv*Dh], "wo": [Hq*Dh, D],
                          "bq": [Hq*Dh], "bk": [Hkv*Dh], "bv": [Hkv*Dh]     (iff qkv_bias or attn_bias)
                          "bo": [D]                                          (iff attn_bias)
                          "q_norm": {"scale": [Dh]}, "k_norm": {"scale": [Dh]}},  (iff qk_norm)
                 "ln2": {"scale": [D]},
                 "ff": {"w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]}                        (kind llama)
                    or {"router": [D, E], "w_gate": [E, D, F], "w_up": [E, D, F], "w_down": [E, F, D],  (llama_moe)
                        "shared": {"w_gate": [D, Fs], "w_up": [D, Fs], "w_down": [Fs, D], "gate": [D, 1]}}},
                                                                               (iff shared_expert_d_ff > 0)
                ...],
     "final_norm": {"scale": [D]},
     "lm_head": [D, V]}                                                       (iff not tie_embeddings)
The query/key/value columns are head-major: head h of wq is columns h*Dh .. (h+1)*Dh (Hugging Face's q_proj.weight
transposed, no permutation); within a head, the first Dh/2 columns rotate with the last Dh/2 (rotate_half).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from islands.models import moe, transformer
from islands.models.base import Model, Params
from islands.models.config import ModelConfig
from islands.models.transformer import dense, normal_init, residual_std


def init_rms_norm(d: int) -> Params:
    return {"scale": jnp.ones((d,), jnp.float32)}


def rms_norm(p: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467) over the last axis, statistics in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + cfg.norm_eps)
    return (y * p["scale"]).astype(x.dtype)


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """The rotary frequencies θ^(-2i/Dh), i < Dh/2, float32 [Dh/2] as transformers computes them
    (`_compute_default_rope_parameters`), Llama 3.1's scaling applied where model.rope_scaling = "llama3"
    (`_compute_llama3_parameters`: wavelengths above original / low_freq_factor are divided by factor, those below
    original / high_freq_factor kept, the ones between interpolated). Constants of the trace: numpy, not jax."""
    dh = cfg.head_size
    inv = np.float32(1.0) / (np.float32(cfg.rope_theta) ** (np.arange(0, dh, 2, dtype=np.float32) / np.float32(dh)))
    if cfg.rope_scaling != "llama3":
        return inv
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
    original = cfg.rope_scaling_original_max_position
    wavelen = np.float32(2 * np.pi) / inv
    scaled = np.where(wavelen > original / low, inv / np.float32(factor), inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotate(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding of x [B, T, H, Dh] at positions int [B, T], in float32, back in x's dtype: x's first and
    second halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin) at angles position * inv_freq (transformers'
    apply_rotary_pos_emb with rotate_half)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def init_attention(key: jax.Array, cfg: ModelConfig) -> Params:
    k_q, k_k, k_v, k_o = jax.random.split(key, 4)
    d, q_width, kv_width = cfg.d_model, cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    p = {
        "wq": normal_init(k_q, (d, q_width), cfg.init_scale),
        "wk": normal_init(k_k, (d, kv_width), cfg.init_scale),
        "wv": normal_init(k_v, (d, kv_width), cfg.init_scale),
        "wo": normal_init(k_o, (q_width, d), residual_std(cfg)),
    }
    if cfg.qkv_bias or cfg.attn_bias:
        p |= {
            name: jnp.zeros((width,), jnp.float32)
            for name, width in (("bq", q_width), ("bk", kv_width), ("bv", kv_width))
        }
    if cfg.attn_bias:
        p["bo"] = jnp.zeros((d,), jnp.float32)
    if cfg.qk_norm:
        p |= {"q_norm": init_rms_norm(cfg.head_size), "k_norm": init_rms_norm(cfg.head_size)}
    return p


def project_qkv(
    p: Params, x: jax.Array, positions: jax.Array | None, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> queries [B, T, n_heads, Dh], keys and values [B, T, kv_heads, Dh] in x's dtype: projected (with
    biases where p has them), each head's queries and keys RMS-normalised where p has q_norm / k_norm (Qwen3), then
    rotated to their positions (0 .. T-1 where positions is None)."""
    b, t, _ = x.shape
    dh = cfg.head_size
    q = dense(x, p["wq"], p.get("bq")).reshape(b, t, cfg.n_heads, dh)
    k = dense(x, p["wk"], p.get("bk")).reshape(b, t, cfg.kv_heads, dh)
    v = dense(x, p["wv"], p.get("bv")).reshape(b, t, cfg.kv_heads, dh)
    if "q_norm" in p:
        q, k = rms_norm(p["q_norm"], q, cfg), rms_norm(p["k_norm"], k, cfg)
    positions = jnp.arange(t)[None] if positions is None else positions
    inv_freq = inverse_frequencies(cfg)
    return rotate(q, positions, inv_freq), rotate(k, positions, inv_freq), v


def init_mlp(key: jax.Array, cfg: ModelConfig) -> Params:
    k_gate, k_up, k_down = jax.random.split(key, 3)
    d, f = cfg.d_model, cfg.d_ff
    return {
        "w_gate": normal_init(k_gate, (d, f), cfg.init_scale),
        "w_up": normal_init(k_up, (d, f), cfg.init_scale),
        "w_down": normal_init(k_down, (f, d), residual_std(cfg)),
    }


def mlp(p: Params, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Dense SwiGLU MLP; no auxiliary loss."""
    return transformer.swiglu(p, x), jnp.zeros((), jnp.float32)


def init_embedding(key: jax.Array, cfg: ModelConfig) -> Params:
    return {"tok": normal_init(key, (cfg.vocab_size, cfg.d_model), cfg.init_scale)}


def embed(p: Params, tokens: jax.Array, positions: jax.Array | None) -> jax.Array:
    """Token embeddings of tokens [B, T] (positions enter as rotations of the queries and keys)."""
    return p["tok"][tokens]


def output(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The final RMSNorm and the output projection (lm_head, or the tied embedding) -> logits float32 [B, T, V]."""
    x = rms_norm(params["final_norm"], x, cfg)
    if "lm_head" in params:
        return dense(x, params["lm_head"]).astype(jnp.float32)
    return transformer.unembed(params["embed"], x)


LLAMA = transformer.Architecture(
    init_embed=init_embedding,
    init_norm=init_rms_norm,
    init_attention=init_attention,
    init_ff=init_mlp,
    embed=embed,
    norm=rms_norm,
    project_qkv=project_qkv,
    feed_forward=mlp,
    output=output,
)
"""The Llama family's dense decoder (kind llama)."""

LLAMA_MOE = LLAMA._replace(init_ff=moe.init_swiglu_experts, feed_forward=moe.swiglu_experts)
"""The Llama family with routed SwiGLU experts (kind llama_moe)."""


def init_params(key: jax.Array, cfg: ModelConfig, arch: transformer.Architecture) -> Params:
    """The shared blocks' params (transformer.init_params), and an lm_head [D, V] where embeddings are untied."""
    k_model, k_head = jax.random.split(key)
    params = transformer.init_params(k_model, cfg, arch)
    if not cfg.tie_embeddings:
        params["lm_head"] = normal_init(k_head, (cfg.d_model, cfg.vocab_size), cfg.init_scale)
    return params


def build(cfg: ModelConfig) -> Model:
    return Model(
        init=functools.partial(init_params, cfg=cfg, arch=LLAMA),
        loss=functools.partial(transformer.loss_fn, cfg=cfg, arch=LLAMA),
    )


def build_moe(cfg: ModelConfig) -> Model:
    return Model(
        init=functools.partial(init_params, cfg=cfg, arch=LLAMA_MOE),
        loss=functools.partial(moe.loss_fn, cfg=cfg, arch=LLAMA_MOE),
    )
