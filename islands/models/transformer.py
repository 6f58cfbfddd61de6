"""Decoder-only transformer (GPT-2 shape: Radford et al. 2019) as pure functions over a params pytree.

Pre-LayerNorm blocks (attention, then a feed-forward), causal multi-head self-attention with the softmax
in float32, GELU MLP, learned position embeddings, a final LayerNorm and an output projection tied to the
input embedding; with model.attn_bias, GPT-2's biases on the attention projections too (c_attn, c_proj).

The blocks are shared by every family: an `Architecture` names the few functions in which a family differs (its
embedding, norm, query/key/value projection, feed-forward and output, and their inits), and `init_params`,
`forward`, `forward_cached` and `loss_fn` run any of them. `GPT2` is this module's; the mixture-of-experts model
(`islands.models.moe`) swaps the feed-forward, the Llama family (`islands.models.llama`) the rest. Attention is
grouped-query (`attend`): cfg.kv_heads key/value heads, each seen by n_heads / kv_heads query heads (one each here).

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
     "blocks": [{"ln1": norm, "attn": {"wqkv": [D, 3D], "wo": [D, D], "bqkv": [3D], "bo": [D]}, "ln2": norm,
                 "ff": {"w1": [D, F], "b1": [F], "w2": [F, D], "b2": [D]}}, ...],
     "final_norm": {"scale": [D], "bias": [D]}}
with norm = {"scale": [D], "bias": [D]}, the attention biases iff model.attn_bias, and the feed-forward moe.py's for
kind moe. wqkv's columns are the queries, keys and values, each head-major (head h: columns h*Dh .. (h+1)*Dh).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from islands.models.adapted import Adapted
from islands.models.base import Metrics, Model, Params
from islands.models.config import ModelConfig, ModelError

FFInit = Callable[[jax.Array, ModelConfig], Params]
"""(key, cfg) -> the feed-forward params of one block."""

FFApply = Callable[[Params, jax.Array, ModelConfig], tuple[jax.Array, jax.Array]]
"""(ff params, x [B, T, D], cfg) -> (output [B, T, D], auxiliary loss scalar of this block)."""

ProjectQKV = Callable[[Params, jax.Array, jax.Array | None, ModelConfig], tuple[jax.Array, jax.Array, jax.Array]]
"""(attn params, x [B, T, D], positions int [B, T] or None for 0 .. T-1, cfg) -> (queries [B, T, n_heads, Dh], keys
and values [B, T, kv_heads, Dh]) in x's dtype, position information applied (rotary embeddings, where a family has
them)."""


class Architecture(NamedTuple):
    """The functions in which a family of decoders differs; `init_params`, `forward`, `forward_cached` and `loss_fn`
    build the rest from the shared blocks."""

    init_embed: FFInit
    """(key, cfg) -> params["embed"]."""

    init_norm: Callable[[int], Params]
    """width -> the params of one norm (ln1, ln2, final_norm)."""

    init_attention: FFInit
    """(key, cfg) -> a block's "attn" params."""

    init_ff: FFInit
    """(key, cfg) -> a block's "ff" params."""

    embed: Callable[[Params, jax.Array, jax.Array | None], jax.Array]
    """(params["embed"], tokens int [B, T], positions int [B, T] or None for 0 .. T-1) -> x float32 [B, T, D]."""

    norm: Callable[[Params, jax.Array, ModelConfig], jax.Array]
    """(norm params, x, cfg) -> x normalised, in x's dtype (statistics in float32)."""

    project_qkv: ProjectQKV
    """A block's queries, keys and values."""

    feed_forward: FFApply
    """A block's feed-forward."""

    output: Callable[[Params, jax.Array, ModelConfig], jax.Array]
    """(params, x [B, T, D], cfg) -> logits float32 [B, T, V]: the final norm and the output projection."""


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


def layer_norm(p: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + cfg.norm_eps)
    return (y * p["scale"] + p["bias"]).astype(x.dtype)


def dense(x: jax.Array, w: jax.Array | Adapted, b: jax.Array | None = None) -> jax.Array:
    """x @ w (+ b) in x's dtype: the float32 weight is cast where it is used, so bfloat16 activations run a
    bfloat16 matmul and the gradient still flows back (cast to float32) into the float32 parameter. A LoRA step's
    adapted matrix (`Adapted`) is applied with its factors, unmerged."""
    y = w.apply(x) if isinstance(w, Adapted) else x @ w.astype(x.dtype)
    return y if b is None else y + b.astype(x.dtype)


def init_attention(key: jax.Array, cfg: ModelConfig) -> Params:
    k_qkv, k_out = jax.random.split(key)
    d = cfg.d_model
    p = {
        "wqkv": normal_init(k_qkv, (d, 3 * d), cfg.init_scale),
        "wo": normal_init(k_out, (d, d), residual_std(cfg)),
    }
    if cfg.attn_bias:
        p |= {"bqkv": jnp.zeros((3 * d,), jnp.float32), "bo": jnp.zeros((d,), jnp.float32)}
    return p


def project_qkv(
    p: Params, x: jax.Array, positions: jax.Array | None, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> the queries, keys and values of every head, each [B, T, n_heads, D / n_heads] in x's dtype
    (the positions are in the embedding already)."""
    b, t, d = x.shape
    h = cfg.n_heads
    qkv = dense(x, p["wqkv"], p.get("bqkv")).reshape(b, t, 3, h, d // h)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


def attend(
    p: Params, q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, kv_layout: str = "bkhd"
) -> jax.Array:
    """Grouped-query attention of queries q [B, Tq, Hq, Dh] over keys and values of Hkv heads (Hkv divides Hq; query
    head h reads key/value head h // (Hq / Hkv), as Hugging Face's repeat_kv lays them out), then the output
    projection (and its bias "bo", where p has one) -> [B, Tq, D]. Query i sees key j where `visible[..., i, j]`
    (broadcast against [B, Hq, Tq, Tk]): the causal triangle in training, a cache's filled positions when generating
    (`forward_cached`). Keys and values are [B, Tk, Hkv, Dh] ("bkhd", as projected) or [B, Hkv, Tk, Dh] ("bhkd", as
    a KVCache holds them)."""
    b, tq, h, dh = q.shape
    kv_heads = k.shape[kv_layout.index("h")]
    group = h // kv_heads
    # Each key/value head's query heads side by side ([B, Tq, Hkv, G, Dh]), so no key or value is ever repeated.
    # With one query head per key/value head the einsums are the plain multi-head ones (the GPT-2 shape's, whose
    # parameter digests depend on their exact rounding).
    q_spec, w_spec = ("bqhd", "bhqk") if group == 1 else ("bqhgd", "bhgqk")
    q = q if group == 1 else q.reshape(b, tq, kv_heads, group, dh)
    # Scores and softmax in float32 whatever the activation dtype: exp() overflows in half precision. The
    # matmul itself stays in the activation dtype (upcast after it, not preferred_element_type=float32): its
    # backward then runs bfloat16 matmuls too, where a float32 output would make them mixed float32 ones.
    scores = jnp.einsum(f"{q_spec},{kv_layout}->{w_spec}", q, k).astype(jnp.float32) / math.sqrt(dh)
    tk = scores.shape[-1]
    scores = jnp.where(visible, scores.reshape(b, h, tq, tk), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    weights = weights if group == 1 else weights.reshape(b, kv_heads, group, tq, tk)
    out = jnp.einsum(f"{w_spec},{kv_layout}->{q_spec}", weights, v).reshape(b, tq, h * dh)
    return dense(out, p["wo"], p.get("bo"))


def attention(p: Params, x: jax.Array, cfg: ModelConfig, arch: Architecture) -> jax.Array:
    """Causal self-attention: position t attends to positions <= t only."""
    q, k, v = arch.project_qkv(p, x, None, cfg)
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


def swiglu(p: Params, x: jax.Array) -> jax.Array:
    """SwiGLU MLP (Shazeer 2020, arXiv 2002.05202), no biases: (silu(x @ w_gate) * (x @ w_up)) @ w_down."""
    return dense(jax.nn.silu(dense(x, p["w_gate"])) * dense(x, p["w_up"]), p["w_down"])


def init_embedding(key: jax.Array, cfg: ModelConfig) -> Params:
    k_tok, k_pos = jax.random.split(key)
    return {
        "tok": normal_init(k_tok, (cfg.vocab_size, cfg.d_model), cfg.init_scale),
        "pos": normal_init(k_pos, (cfg.seq_len, cfg.d_model), cfg.init_scale),
    }


def embed(p: Params, tokens: jax.Array, positions: jax.Array | None) -> jax.Array:
    """Token plus position embeddings of tokens [B, T]; at positions [B, T] (each row's own), else at 0 .. T-1."""
    return p["tok"][tokens] + (p["pos"][: tokens.shape[1]] if positions is None else p["pos"][positions])


def unembed(p: Params, x: jax.Array) -> jax.Array:
    """Logits through the transposed input embedding (tied weights), in float32 (upcast after the matmul, as
    for the attention scores, so the backward matmuls stay in the compute dtype)."""
    return dense(x, p["tok"].T).astype(jnp.float32)


def output(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The final LayerNorm and the tied output projection: x [B, T, D] -> logits float32 [B, T, V]."""
    return unembed(params["embed"], layer_norm(params["final_norm"], x, cfg))


GPT2 = Architecture(
    init_embed=init_embedding,
    init_norm=init_norm,
    init_attention=init_attention,
    init_ff=init_mlp,
    embed=embed,
    norm=layer_norm,
    project_qkv=project_qkv,
    feed_forward=mlp,
    output=output,
)
"""The GPT-2 shape (kind transformer)."""


def init_params(key: jax.Array, cfg: ModelConfig, arch: Architecture = GPT2) -> Params:
    k_embed, *k_blocks = jax.random.split(key, 1 + 2 * cfg.n_layers)
    blocks = [
        {
            "ln1": arch.init_norm(cfg.d_model),
            "attn": arch.init_attention(k_attn, cfg),
            "ln2": arch.init_norm(cfg.d_model),
            "ff": arch.init_ff(k_ff, cfg),
        }
        for k_attn, k_ff in zip(k_blocks[0::2], k_blocks[1::2], strict=True)
    ]
    return {"embed": arch.init_embed(k_embed, cfg), "blocks": blocks, "final_norm": arch.init_norm(cfg.d_model)}


def block(p: Params, x: jax.Array, cfg: ModelConfig, arch: Architecture) -> tuple[jax.Array, jax.Array]:
    """One pre-norm block: x + attention(ln1(x)), then + feed-forward(ln2(x)) -> (x, auxiliary loss)."""
    x = x + attention(p["attn"], arch.norm(p["ln1"], x, cfg), cfg, arch)
    return feed_forward(p, x, cfg, arch)


def feed_forward(p: Params, x: jax.Array, cfg: ModelConfig, arch: Architecture) -> tuple[jax.Array, jax.Array]:
    """A block's second half: x + feed-forward(ln2(x)) -> (x, auxiliary loss)."""
    y, aux = arch.feed_forward(p["ff"], arch.norm(p["ln2"], x, cfg), cfg)
    return x + y, aux


def forward(
    params: Params, tokens: jax.Array, cfg: ModelConfig, arch: Architecture = GPT2
) -> tuple[jax.Array, jax.Array]:
    """tokens int [B, T] (T <= seq_len) -> (logits float32 [B, T, V], auxiliary loss per block [n_layers])."""
    if tokens.ndim != 2 or tokens.shape[1] > cfg.seq_len:
        raise ModelError(
            f"model input must be [batch, <= model.seq_len ({cfg.seq_len})] tokens (got shape {tokens.shape})"
        )
    apply_block = functools.partial(block, cfg=cfg, arch=arch)
    if cfg.remat:
        # Save nothing inside a block: the backward pass keeps only each block's input (and its float32 params,
        # live anyway) and recomputes the rest, weight casts included: about one more forward pass per step.
        # dots_with_no_batch_dims_saveable would recompute only attention and elementwise ops but keep the four
        # projections' outputs, ~9 x d_model values per token per block against d_model here. The knob is there
        # for when activations do not fit, so it takes the smallest footprint.
        apply_block = jax.checkpoint(apply_block, policy=jax.checkpoint_policies.nothing_saveable)
    x = arch.embed(params["embed"], tokens, None).astype(cfg.compute_dtype)
    aux = []
    for p in params["blocks"]:
        x, block_aux = apply_block(p, x)
        aux.append(block_aux)
    return arch.output(params, x, cfg), jnp.stack(aux)


class KVCache(NamedTuple):
    """The keys and values of every block at every position of a fixed-size buffer, for generation
    (`forward_cached`): each [n_layers, B, kv_heads, length, head_size], in the compute dtype (grouped-query
    attention caches its key/value heads only). A position
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
    shape = (cfg.n_layers, batch, cfg.kv_heads, length, cfg.head_size)
    zeros = jnp.zeros(shape, cfg.compute_dtype)
    return KVCache(zeros, zeros)


def forward_cached(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: ModelConfig,
    arch: Architecture = GPT2,
) -> tuple[jax.Array, KVCache]:
    """tokens int [B, T] at positions int [B, T] (each row its own, < cache.length) -> (logits float32 [B, T, V],
    the cache with these positions' keys and values written).

    The blocks of `forward`, their attention over the cache: a query at position p sees every cached position <= p
    (its own included, written first), so with the positions before p written by earlier calls it computes what
    `forward` computes at p for the same sequence. Prefill (a whole prompt, positions 0 .. T-1) and each decode
    step (one token per row, at the row's own next position) are both this call. No auxiliary loss, no remat:
    nothing here is differentiated."""
    x = arch.embed(params["embed"], tokens, positions).astype(cfg.compute_dtype)
    rows = jnp.arange(tokens.shape[0])[:, None]
    visible = (jnp.arange(cache.length) <= positions[:, :, None])[:, None]  # [B, 1, T, length]
    ks, vs = cache
    for i, p in enumerate(params["blocks"]):
        q, k, v = arch.project_qkv(p["attn"], arch.norm(p["ln1"], x, cfg), positions, cfg)
        # The two index arrays around the head slice put their [B, T] first: the slots take k [B, T, H, Dh] as it is.
        ks = ks.at[i, rows, :, positions].set(k.astype(ks.dtype))
        vs = vs.at[i, rows, :, positions].set(v.astype(vs.dtype))
        x = x + attend(p["attn"], q, ks[i], vs[i], visible, kv_layout="bhkd")
        x, _ = feed_forward(p, x, cfg, arch)
    return arch.output(params, x, cfg), KVCache(ks, vs)


def target_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) at every position: logits [..., V], targets int [...] -> float32 [...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) over every position of the batch."""
    return -target_logprobs(logits, targets).mean()


def loss_fn(params: Params, batch: jax.Array, cfg: ModelConfig, arch: Architecture = GPT2) -> tuple[jax.Array, Metrics]:
    """Mean next-token cross-entropy (a routed feed-forward's loss adds its load balancing: moe.loss_fn)."""
    logits, _ = forward(params, batch[:, :-1], cfg, arch)
    ce = cross_entropy(logits, batch[:, 1:])
    return ce, {"ce": ce}


def build(cfg: ModelConfig) -> Model:
    return Model(init=functools.partial(init_params, cfg=cfg), loss=functools.partial(loss_fn, cfg=cfg))
