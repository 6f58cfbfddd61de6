"""Mixture-of-experts transformer: the dense transformer with each block's MLP replaced by a top-k routed
mixture of GELU experts (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021, arXiv 2101.03961); and the
Llama family's routed SwiGLU experts (kind llama_moe: Mixtral, Qwen3-MoE; with Qwen2-MoE's shared expert behind a
sigmoid gate where model.shared_expert_d_ff > 0), over the same routing.

Routing: router softmax over experts per token, keep the top_k, renormalise their gates to sum to 1
(for top_k = 1 the raw probability is kept as in Switch, else the router would get no gradient from the
task loss). Kind llama_moe renormalises iff model.norm_topk_prob, as transformers' Qwen3-MoE does.
Dispatch is dense: every expert runs on every token and the gates mask the result, which is simple, exact
and jit-friendly at the sizes trained here; large models would want capacity-based dispatch instead.

Load balancing (Switch eq. 4): aux = n_experts * sum_e f_e * P_e per block, where f_e is the fraction of
routing slots (token, k) sent to expert e and P_e the mean router probability of e. It is 1 for a
perfectly balanced (or uniform) router and n_experts when everything goes to one expert. The loss adds
aux_loss_weight * (aux averaged over blocks) to the cross-entropy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from islands.models import transformer
from islands.models.base import Metrics, Model, Params
from islands.models.config import ModelConfig


def init_experts(key: jax.Array, cfg: ModelConfig) -> Params:
    k_router, k_in, k_out = jax.random.split(key, 3)
    e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
    return {
        "router": transformer.normal_init(k_router, (d, e), cfg.init_scale),
        "w1": transformer.normal_init(k_in, (e, d, f), cfg.init_scale),
        "b1": jnp.zeros((e, f), jnp.float32),
        "w2": transformer.normal_init(k_out, (e, f, d), transformer.residual_std(cfg)),
        "b2": jnp.zeros((e, d), jnp.float32),
    }


def route(router_logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """router logits [N, E] -> (combine weights [N, E] with top_k non-zeros per row, each row's summing to 1 where
    `normalize`, load-balancing aux)."""
    n_experts = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    gates = top_p / top_p.sum(-1, keepdims=True) if normalize else top_p
    slots = jax.nn.one_hot(top_i, n_experts, dtype=jnp.float32)  # [N, K, E]
    combine = jnp.einsum("nk,nke->ne", gates, slots)
    # f_e counts hard assignments (no gradient); the gradient reaches the router through P_e.
    fraction = slots.sum(axis=(0, 1)) / (slots.shape[0] * top_k)
    mean_prob = probs.mean(axis=0)
    return combine, n_experts * jnp.sum(fraction * mean_prob)


def experts(p: Params, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The MoE feed-forward (a transformer.FFApply): x [B, T, D] -> (y [B, T, D], aux scalar)."""
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    # The router runs in float32 whatever the compute dtype (Switch Transformer's "selective precision":
    # routing decisions are unstable in bfloat16); it is a [D, E] matmul, cheap next to the experts'.
    combine, aux = route(tokens.astype(jnp.float32) @ p["router"], cfg.top_k, normalize=cfg.top_k > 1)
    dtype = tokens.dtype  # the experts' weights are cast at use, like transformer.dense does
    hidden = jax.nn.gelu(jnp.einsum("nd,edf->nef", tokens, p["w1"].astype(dtype)) + p["b1"].astype(dtype))
    outs = jnp.einsum("nef,efd->ned", hidden, p["w2"].astype(dtype)) + p["b2"].astype(dtype)
    y = jnp.einsum("ne,ned->nd", combine.astype(outs.dtype), outs)
    return y.reshape(b, t, d), aux


def init_swiglu_experts(key: jax.Array, cfg: ModelConfig) -> Params:
    k_router, k_gate, k_up, k_down, k_shared = jax.random.split(key, 5)
    e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
    p = {
        "router": transformer.normal_init(k_router, (d, e), cfg.init_scale),
        "w_gate": transformer.normal_init(k_gate, (e, d, f), cfg.init_scale),
        "w_up": transformer.normal_init(k_up, (e, d, f), cfg.init_scale),
        "w_down": transformer.normal_init(k_down, (e, f, d), transformer.residual_std(cfg)),
    }
    if cfg.shared_expert_d_ff:
        k_gate, k_up, k_down, k_sigmoid = jax.random.split(k_shared, 4)
        fs = cfg.shared_expert_d_ff
        p["shared"] = {
            "w_gate": transformer.normal_init(k_gate, (d, fs), cfg.init_scale),
            "w_up": transformer.normal_init(k_up, (d, fs), cfg.init_scale),
            "w_down": transformer.normal_init(k_down, (fs, d), transformer.residual_std(cfg)),
            "gate": transformer.normal_init(k_sigmoid, (d, 1), cfg.init_scale),
        }
    return p


def swiglu_experts(p: Params, x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The llama_moe feed-forward (a transformer.FFApply): x [B, T, D] -> (y [B, T, D], aux scalar). Routed SwiGLU
    experts, plus the shared expert times sigmoid(x @ gate) where p has one (transformers' Qwen2MoeSparseMoeBlock)."""
    b, t, d = x.shape
    tokens = x.reshape(b * t, d)
    combine, aux = route(tokens.astype(jnp.float32) @ p["router"], cfg.top_k, normalize=cfg.norm_topk_prob)
    dtype = tokens.dtype
    gate = jnp.einsum("nd,edf->nef", tokens, p["w_gate"].astype(dtype))
    up = jnp.einsum("nd,edf->nef", tokens, p["w_up"].astype(dtype))
    outs = jnp.einsum("nef,efd->ned", jax.nn.silu(gate) * up, p["w_down"].astype(dtype))
    y = jnp.einsum("ne,ned->nd", combine.astype(outs.dtype), outs)
    if "shared" in p:
        shared = p["shared"]
        y = y + jax.nn.sigmoid(transformer.dense(tokens, shared["gate"])) * transformer.swiglu(shared, tokens)
    return y.reshape(b, t, d), aux


GPT2_MOE = transformer.GPT2._replace(init_ff=init_experts, feed_forward=experts)
"""The GPT-2 shape with routed GELU experts (kind moe)."""


def forward(
    params: Params, tokens: jax.Array, cfg: ModelConfig, arch: transformer.Architecture = GPT2_MOE
) -> tuple[jax.Array, jax.Array]:
    """tokens int [B, T] -> (logits float32 [B, T, V], load-balancing aux per block [n_layers])."""
    return transformer.forward(params, tokens, cfg, arch)


def loss_fn(
    params: Params, batch: jax.Array, cfg: ModelConfig, arch: transformer.Architecture = GPT2_MOE
) -> tuple[jax.Array, Metrics]:
    """Cross-entropy + aux_loss_weight * the load-balancing loss averaged over blocks."""
    logits, aux_per_block = forward(params, batch[:, :-1], cfg, arch)
    ce = transformer.cross_entropy(logits, batch[:, 1:])
    aux = aux_per_block.mean()
    return ce + cfg.aux_loss_weight * aux, {"ce": ce, "aux": aux}


def init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    return transformer.init_params(key, cfg, GPT2_MOE)


def build(cfg: ModelConfig) -> Model:
    return Model(init=functools.partial(init_params, cfg=cfg), loss=functools.partial(loss_fn, cfg=cfg))
