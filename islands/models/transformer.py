"""Decoder-only transformer (GPT-2 shape: Radford et al. 2019) as pure functions over a params pytree.

Pre-LayerNorm blocks (attention, then a feed-forward), causal multi-head self-attention with the softmax
in float32, GELU MLP, learned position embeddings, a final LayerNorm and an output projection tied to the
input embedding. The feed-forward is pluggable (`ff_init`/`ff_apply`) so the mixture-of-experts model
(`islands.models.moe`) reuses everything else here unchanged.

Mixed precision (`cfg.compute_dtype`): the parameters are always float32 (the master weights the optimizer,
the pseudo-gradients and the coordinator see). The embedding output is cast to the compute dtype and every
weight is cast to its input's dtype where it is used (`dense`), so with bfloat16 every matmul, forward and
backward, and the residual stream run in bfloat16 while the gradients arrive in float32. Layer-norm
statistics, the attention softmax and the cross-entropy run in float32, on scores and logits upcast from the
matmuls that make them. `cfg.remat` recomputes each block in the backward pass (`forward` says how).

Generation (islands/sampling.py) runs the same blocks over a cache of keys and values (`forward_cached`): the
attention is `project_qkv` then `attend`, with the causal triangle in training and the cache's filled positions there.

Params layout (float32 leaves; the blocks are a list so Streaming DiLoCo can cut fragments by layer):
    {"embed": {"tok": [V, D], "pos": [T, D]},
     "blocks": [{"ln1": norm, "attn": {"wqkv": [D, 3D], "wo": [D, D]}, "ln2": norm, "ff": ...}, ...],
     "final_norm": {"scale": [D], "bias": [D]}}
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from islands.models.base import Metrics, Model, Params
from islands.models.config import ModelConfig, ModelError

FFInit = Callable[[jax.Array, ModelConfig], Params]
"""(key, cfg) -> the feed-forward params of one block."""

FFApply = Callable[[Params, jax.Array, ModelConfig], tuple[jax.Array, jax.Array]]
"""(ff params, x [B, T, D], cfg) -> (output [B, T, D], auxiliary loss scalar of this block)."""


def normal_init(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    # The barrier stops XLA from folding `std` into the sampler's own constants under jit, which changes
    # the rounding: with it, jit(init) and eager init give bit-identical params (the same θ_0 digest).
    return std * jax.lax.optimization_barrier(jax.random.normal(key, shape, jnp.float32))


def residual_std(cfg: ModelConfig) -> float:
    # GPT-2: projections that write into the residual stream are scaled by 1/sqrt(2 * n_layers) so the
    # stream's variance does not grow with depth (two residual writes per block).
    return cfg.init_scale / math.sqrt(2 * cfg.n_layers)


def init_norm(d: int) -> Params:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def layer_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"] + p["bias"]).astype(x.dtype)


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x @ w (+ b) in x's dtype: the float32 weight is cast where it is used, so bfloat16 activations run a
    bfloat16 matmul and the gradient still flows back (cast to float32) into the float32 parameter."""
    y = x @ w.astype(x.dtype)
    return y if b is None else y + b.astype(x.dtype)


def init_attention(key: jax.Array, cfg: ModelConfig) -> Params:
    k_qkv, k_out = jax.random.split(key)
    d = cfg.d_model
    return {
        "wqkv": normal_init(k_qkv, (d, 3 * d), cfg.init_scale),
        "wo": normal_init(k_out, (d, d), residual_std(cfg)),
    }


def project_qkv(p: Params, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> the queries, keys and values of every head, each [B, T, n_heads, D / n_heads] in x's dtype."""
    b, t, d = x.shape
    h = cfg.n_heads
    qkv = dense(x, p["wqkv"]).reshape(b, t, 3, h, d // h)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def attend(
    p: Params, q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, kv_layout: str = "bkhd"
) -> jax.Array:
    """Multi-head attention of queries q [B, Tq, H, Dh] over keys and values, then the output projection ->
    [B, Tq, H * Dh]. Query i sees key j where `visible[..., i, j]` (broadcast against [B, H, Tq, Tk]): the causal
    triangle in training, a cache's filled positions when generating (`forward_cached`). Keys and values are
    [B, Tk, H, Dh] ("bkhd", as projected) or [B, H, Tk, Dh] ("bhkd", as a KVCache holds them)."""
    b, tq, h, dh = q.shape
    # Scores and softmax in float32 whatever the activation dtype: exp() overflows in half precision. The
    # matmul itself stays in the activation dtype (upcast after it, not preferred_element_type=float32): its
    # backward then runs bfloat16 matmuls too, where a float32 output would make them mixed float32 ones.
    scores = jnp.einsum(f"bqhd,{kv_layout}->bhqk", q, k).astype(jnp.float32) / math.sqrt(dh)
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"bhqk,{kv_layout}->bqhd", weights, v).reshape(b, tq, h * dh)
    return dense(out, p["wo"])


def attention(p: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal multi-head self-attention: position t attends to positions <= t only."""
    q, k, v = project_qkv(p, x, cfg)
    t = x.shape[1]
    return attend(p, q, k, v, jnp.tril(jnp.ones((t, t), dtype=bool)))


def init_mlp(key: jax.Array, cfg: ModelConfig) -> Params:
    k_in, k_out = jax.random.split(key)
    d, f = cfg.d_model, cfg.d_ff
    return {
        "w1": normal_init(k_in, (d, f), cfg.init_scale),
        "b1": jnp.zeros((f,), jnp.float32),
        "w2": normal_init(k_out, (f, d), residual_std(cfg)),
        "b2": jnp.zeros((d,), jnp.float32),
    }


def mlp(p: Params, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Dense GELU MLP; no auxiliary loss."""
    y = dense(jax.nn.gelu(dense(x, p["w1"], p["b1"])), p["w2"], p["b2"])
    return y, jnp.zeros((), jnp.float32)


def init_embedding(key: jax.Array, cfg: ModelConfig) -> Params:
    k_tok, k_pos = jax.random.split(key)
    return {
        "tok": normal_init(k_tok, (cfg.vocab_size, cfg.d_model), cfg.init_scale),
        "pos": normal_init(k_pos, (cfg.seq_len, cfg.d_model), cfg.init_scale),
    }


def embed(p: Params, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Token plus position embeddings of tokens [B, T]; at positions [B, T] (each row's own), else at 0 .. T-1."""
    return p["tok"][tokens] + (p["pos"][: tokens.shape[1]] if positions is None else p["pos"][positions])


def unembed(p: Params, x: jax.Array) -> jax.Array:
    """Logits through the transposed input embedding (tied weights), in float32 (upcast after the matmul, as
    for the attention scores, so the backward matmuls stay in the compute dtype)."""
    return dense(x, p["tok"].T).astype(jnp.float32)


def init_params(key: jax.Array, cfg: ModelConfig, ff_init: FFInit = init_mlp) -> Params:
    k_embed, *k_blocks = jax.random.split(key, 1 + 2 * cfg.n_layers)
    blocks = [
        {
            "ln1": init_norm(cfg.d_model),
            "attn": init_attention(k_attn, cfg),
            "ln2": init_norm(cfg.d_model),
            "ff": ff_init(k_ff, cfg),
        }
        for k_attn, k_ff in zip(k_blocks[0::2], k_blocks[1::2], strict=True)
    ]
    return {"embed": init_embedding(k_embed, cfg), "blocks": blocks, "final_norm": init_norm(cfg.d_model)}


def block(p: Params, x: jax.Array, cfg: ModelConfig, ff_apply: FFApply) -> tuple[jax.Array, jax.Array]:
    """One pre-LayerNorm block: x + attention(ln1(x)), then + feed-forward(ln2(x)) -> (x, auxiliary loss)."""
    x = x + attention(p["attn"], layer_norm(p["ln1"], x), cfg)
    return feed_forward(p, x, cfg, ff_apply)


def feed_forward(p: Params, x: jax.Array, cfg: ModelConfig, ff_apply: FFApply) -> tuple[jax.Array, jax.Array]:
    """A block's second half: x + feed-forward(ln2(x)) -> (x, auxiliary loss)."""
    y, aux = ff_apply(p["ff"], layer_norm(p["ln2"], x), cfg)
    return x + y, aux


def output(params: Params, x: jax.Array) -> jax.Array:
    """The final LayerNorm and the tied output projection: x [B, T, D] -> logits float32 [B, T, V]."""
    return unembed(params["embed"], layer_norm(params["final_norm"], x))


def forward(
    params: Params, tokens: jax.Array, cfg: ModelConfig, ff_apply: FFApply = mlp
) -> tuple[jax.Array, jax.Array]:
    """tokens int [B, T] (T <= seq_len) -> (logits float32 [B, T, V], auxiliary loss per block [n_layers])."""
    if tokens.ndim != 2 or tokens.shape[1] > cfg.seq_len:
        raise ModelError(
            f"model input must be [batch, <= model.seq_len ({cfg.seq_len})] tokens (got shape {tokens.shape})"
        )
    apply_block = functools.partial(block, cfg=cfg, ff_apply=ff_apply)
    if cfg.remat:
        # Save nothing inside a block: the backward pass keeps only each block's input (and its float32 params,
        # live anyway) and recomputes the rest, weight casts included: about one more forward pass per step.
        # dots_with_no_batch_dims_saveable would recompute only attention and elementwise ops but keep the four
        # projections' outputs, ~9 x d_model values per token per block against d_model here. The knob is there
        # for when activations do not fit, so it takes the smallest footprint.
        apply_block = jax.checkpoint(apply_block, policy=jax.checkpoint_policies.nothing_saveable)
    x = embed(params["embed"], tokens).astype(cfg.compute_dtype)
    aux = []
    for p in params["blocks"]:
        x, block_aux = apply_block(p, x)
        aux.append(block_aux)
    return output(params, x), jnp.stack(aux)


class KVCache(NamedTuple):
    """The keys and values of every block at every position of a fixed-size buffer, for generation
    (`forward_cached`): each [n_layers, B, n_heads, length, d_model / n_heads], in the compute dtype. A position
    holds what was last written there; which positions a query may see is `forward_cached`'s to say. Heads before
    positions: a decode step reads a head's positions as one contiguous block (the other order reads them strided,
    at well under half the speed on CPU)."""

    k: jax.Array
    v: jax.Array

    @property
    def length(self) -> int:
        return self.k.shape[3]


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
    """An empty (zero) cache of `length` <= seq_len positions for `batch` rows."""
    if not 1 <= length <= cfg.seq_len:
        raise ModelError(f"a KV cache holds 1 to model.seq_len ({cfg.seq_len}) positions (got {length})")
    shape = (cfg.n_layers, batch, cfg.n_heads, length, cfg.d_model // cfg.n_heads)
    zeros = jnp.zeros(shape, cfg.compute_dtype)
    return KVCache(zeros, zeros)


def forward_cached(
    params: Params, tokens: jax.Array, positions: jax.Array, cache: KVCache, cfg: ModelConfig, ff_apply: FFApply = mlp
) -> tuple[jax.Array, KVCache]:
    """tokens int [B, T] at positions int [B, T] (each row its own, < cache.length) -> (logits float32 [B, T, V],
    the cache with these positions' keys and values written).

    The blocks of `forward`, their attention over the cache: a query at position p sees every cached position <= p
    (its own included, written first), so with the positions before p written by earlier calls it computes what
    `forward` computes at p for the same sequence. Prefill (a whole prompt, positions 0 .. T-1) and each decode
    step (one token per row, at the row's own next position) are both this call. No auxiliary loss, no remat:
    nothing here is differentiated."""
    x = embed(params["embed"], tokens, positions).astype(cfg.compute_dtype)
    rows = jnp.arange(tokens.shape[0])[:, None]
    visible = (jnp.arange(cache.length) <= positions[:, :, None])[:, None]  # [B, 1, T, length]
    ks, vs = cache
    for i, p in enumerate(params["blocks"]):
        q, k, v = project_qkv(p["attn"], layer_norm(p["ln1"], x), cfg)
        # The two index arrays around the head slice put their [B, T] first: the slots take k [B, T, H, Dh] as it is.
        ks = ks.at[i, rows, :, positions].set(k.astype(ks.dtype))
        vs = vs.at[i, rows, :, positions].set(v.astype(vs.dtype))
        x = x + attend(p["attn"], q, ks[i], vs[i], visible, kv_layout="bhkd")
        x, _ = feed_forward(p, x, cfg, ff_apply)
    return output(params, x), KVCache(ks, vs)


def target_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) at every position: logits [..., V], targets int [...] -> float32 [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) over every position of the batch."""
    return -target_logprobs(logits, targets).mean()


def loss_fn(params: Params, batch: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, Metrics]:
    logits, _ = forward(params, batch[:, :-1], cfg)
    ce = cross_entropy(logits, batch[:, 1:])
    return ce, {"ce": ce}


def build(cfg: ModelConfig) -> Model:
    return Model(init=functools.partial(init_params, cfg=cfg), loss=functools.partial(loss_fn, cfg=cfg))
