"""Batched autoregressive generation with a KV cache, and the log-probabilities of given tokens (issue 27, part 3).

`generate` continues a batch of prompts of different lengths: one prefill pass over the prompts fills the cache
(`transformer.forward_cached` at positions 0 .. P-1), then a jitted loop emits one token per row per step, each row
at its own next position, until every row has stopped or `max_new_tokens` are out. The buffers have a fixed size
(P + max_new_tokens - 1 cache positions, [B, max_new_tokens] tokens), so one compilation serves every call of the
same shapes; temperature and top-p are traced values, not recompilations.

How a token is drawn (`next_token`): the logits are divided by the temperature, the nucleus of the resulting
distribution is kept (Holtzman et al. 2020, arXiv 1904.09751: the smallest set of most probable tokens whose mass
reaches top_p; `nucleus`) and one token is drawn from it, renormalised. Temperature 0 is greedy (the argmax,
whatever top_p). Step i's key is `fold_in(key, i)`, so a call is a pure function of its arguments.

A row's prompt is left-aligned in `prompts` and padded after `prompt_lens[b]`: the prefill writes the padding's keys
too, but a row writes its first new token at its own position prompt_lens[b], over the padding, before any query
can see that position, so padding is never attended. A row that emits `stop_token` emits `PAD` from then on.

The batch runs where its arrays are: `place_rows` splits the rows over an island's mesh (islands/mesh.py, the data
axis) and replicates the parameters, and the jitted loop keeps that layout. Every built-in kind shares the blocks
(`transformer.forward_cached` with the kind's `Architecture`, islands/models/registry.py); a grouped-query model's
cache holds its key/value heads only. A custom model has no cached forward and is refused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from floor.errors import UserError
from islands.mesh import Layout, data_width, row_sharding
from islands.models import transformer
from islands.models.base import Params
from islands.models.config import ModelConfig
from islands.models.registry import ARCHITECTURES
from islands.models.transformer import Architecture

PAD = 0
"""What a row emits after its stop token (its `lengths` entry says where its tokens end)."""

INF_BITS = 0x7F800000
"""float32 +inf as int32 bits: above every finite probability's."""


class SamplingError(UserError, ValueError):
    """A generation the model or its arguments cannot do (a custom model, a prompt too long, a bad temperature)."""


def architecture_of(cfg: ModelConfig) -> Architecture:
    """The functions of the model's blocks; a model without a cached forward is refused in one line."""
    if cfg.kind not in ARCHITECTURES:
        raise SamplingError(
            f"generation needs model.kind {', '.join(ARCHITECTURES)} (got {cfg.kind!r}: a custom model has no "
            "forward this project can cache)"
        )
    return ARCHITECTURES[cfg.kind]


def check_request(cfg: ModelConfig, prompt_width: int, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Refuse, in one line naming the argument, what `generate` cannot do: buffers beyond the context, no token to
    make, a temperature below 0, a top_p outside (0, 1]."""
    architecture_of(cfg)
    if max_new_tokens < 1:
        raise SamplingError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    if prompt_width < 1:
        raise SamplingError("a prompt needs at least one token")
    if prompt_width + max_new_tokens > cfg.seq_len:
        raise SamplingError(
            f"a prompt of {prompt_width} tokens and max_new_tokens {max_new_tokens} make "
            f"{prompt_width + max_new_tokens} positions, beyond model.seq_len ({cfg.seq_len})"
        )
    if not np.isfinite(temperature) or temperature < 0:
        raise SamplingError(f"temperature must be a finite number >= 0 (got {temperature})")
    if not 0 < top_p <= 1:
        raise SamplingError(f"top_p must be in (0, 1] (got {top_p})")


def nucleus(probs: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """bool [B, V]: the smallest set of most probable tokens whose mass reaches top_p (tokens tied with the least
    probable one in are kept too, so the set does not depend on the vocabulary's order); top_p >= 1 keeps all.

    The set is {p >= τ} for the largest τ whose set still holds top_p of the mass. τ is found by bisection over the
    bit patterns of the probabilities (non-negative float32s order as their int32 bits do), 31 masked sums over the
    vocabulary rather than a sort: XLA's sort of a [B, V] array costs more than the rest of a decode step on CPU."""
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        low, high = bounds  # the mass of {bits >= low} reaches top_p; that of {bits >= high} does not (or high is +inf)
        mid = low + (high - low) // 2
        reaches = jnp.where(bits >= mid[:, None], probs, 0.0).sum(-1) >= top_p
        return jnp.where(reaches, mid, low), jnp.where(reaches, high, mid)

    rows = probs.shape[0]
    start = (jnp.zeros((rows,), jnp.int32), jnp.full((rows,), INF_BITS, jnp.int32))
    low, _ = jax.lax.fori_loop(0, 31, halve, start)
    return (bits >= low[:, None]) | (top_p >= 1)


def next_token(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits float32 [B, V] -> int32 [B]: the argmax at temperature 0, else a draw from the nucleus of
    softmax(logits / temperature), renormalised (one uniform per row against the nucleus's cumulative mass)."""
    probs = jax.nn.softmax(logits / jnp.where(temperature > 0, temperature, 1.0), axis=-1)
    cumulative = jnp.cumsum(jnp.where(nucleus(probs, top_p), probs, 0.0), axis=-1)
    u = jax.random.uniform(key, (logits.shape[0], 1)) * cumulative[:, -1:]
    drawn = jnp.minimum(jnp.sum(cumulative <= u, axis=-1), logits.shape[-1] - 1)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "stop_token", "keep_logits"))
def rollout(
    params: Params,
    cfg: ModelConfig,
    prompts: jax.Array,
    prompt_lens: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    *,
    max_new_tokens: int,
    stop_token: int | None,
    keep_logits: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`generate`'s loop -> (tokens int32 [B, N], lengths int32 [B], and with keep_logits the logits float32
    [B, N, V] each token was drawn from; rows already stopped keep zeros). Arguments as `generate`'s, unchecked."""
    arch = architecture_of(cfg)
    b, width = prompts.shape
    prompt_lens = prompt_lens.astype(jnp.int32)
    cache = transformer.init_cache(cfg, b, width + max_new_tokens - 1)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
    logits, cache = transformer.forward_cached(params, prompts.astype(jnp.int32), positions, cache, cfg, arch)
    first = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    tokens = jnp.full((b, max_new_tokens), PAD, jnp.int32)
    kept = jnp.zeros((b, max_new_tokens, cfg.vocab_size) if keep_logits else (0,), jnp.float32)

    def emit(i: jax.Array, step_logits: jax.Array, state: tuple) -> tuple:
        """Draw step i's token from `step_logits` and record it (PAD for a row that has stopped)."""
        tokens, lengths, done, kept = state
        token = jnp.where(done, PAD, next_token(step_logits, jax.random.fold_in(key, i), temperature, top_p))
        tokens = tokens.at[:, i].set(token)
        if keep_logits:
            kept = kept.at[:, i].set(jnp.where(done[:, None], 0.0, step_logits))
        lengths = lengths + (~done).astype(jnp.int32)
        if stop_token is not None:
            done = done | (token == stop_token)
        return tokens, lengths, done, kept

    state = emit(jnp.int32(0), first, (tokens, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), kept))

    def more(carry: tuple) -> jax.Array:
        i, _, (_, _, done, _) = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def step(carry: tuple) -> tuple:
        i, cache, state = carry
        previous = state[0][:, i - 1]
        step_logits, cache = transformer.forward_cached(
            params, previous[:, None], (prompt_lens + i - 1)[:, None], cache, cfg, arch
        )
        return i + 1, cache, emit(i, step_logits[:, 0], state)

    _, _, (tokens, lengths, _, kept) = jax.lax.while_loop(more, step, (jnp.int32(1), cache, state))
    return tokens, lengths, kept if keep_logits else None


def _concrete(x: jax.Array) -> np.ndarray | None:
    """x's values when it has them (not a tracer of an enclosing jit)."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def generate(
    params: Params,
    model_cfg: ModelConfig,
    prompts: jax.Array,
    prompt_lens: jax.Array,
    *,
    key: jax.Array,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_token: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """prompts int32 [B, P] (each row's prompt left-aligned, padded after prompt_lens[b]); returns (new tokens int32
    [B, max_new_tokens], padded after each row's stop; lengths int32 [B] counting the stop token if any).
    temperature 0 is greedy. Jitted (static: model_cfg, max_new_tokens, stop_token, P).

    Bad arguments are a SamplingError naming them: P + max_new_tokens beyond model.seq_len, a temperature below 0,
    top_p outside (0, 1], a prompt length outside 1 .. P (checked when prompt_lens is concrete)."""
    if prompts.ndim != 2:
        raise SamplingError(f"prompts must be [batch, tokens] (got shape {prompts.shape})")
    check_request(model_cfg, prompts.shape[1], max_new_tokens, temperature, top_p)
    if prompt_lens.shape != prompts.shape[:1]:
        raise SamplingError(f"prompt_lens must be [batch] = [{prompts.shape[0]}] (got shape {prompt_lens.shape})")
    lens = _concrete(prompt_lens)
    if lens is not None and lens.size and not (1 <= lens.min() and lens.max() <= prompts.shape[1]):
        raise SamplingError(f"prompt_lens must be in 1 .. {prompts.shape[1]} (got {lens.min()} .. {lens.max()})")
    tokens, lengths, _ = rollout(
        params,
        model_cfg,
        prompts,
        prompt_lens,
        key,
        jnp.float32(temperature),
        jnp.float32(top_p),
        max_new_tokens=max_new_tokens,
        stop_token=stop_token,
    )
    return tokens, lengths


@functools.partial(jax.jit, static_argnums=1)
def _token_logprobs(params: Params, model_cfg: ModelConfig, tokens: jax.Array, temperature: jax.Array) -> jax.Array:
    logits, _ = transformer.forward(params, tokens[:, :-1], model_cfg, ARCHITECTURES[model_cfg.kind])
    return transformer.target_logprobs(logits / temperature, tokens[:, 1:])


def token_logprobs(params: Params, model_cfg: ModelConfig, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for every t under softmax(logits / temperature): float32 [B, T-1],
    from the full forward (no cache). At temperature T it is the distribution `next_token` draws from (top_p aside);
    dividing by 1 is exact, so T = 1 is the plain model.

    The training forward (remat and compute dtype as configured), so it differentiates like the loss does."""
    architecture_of(model_cfg)
    if tokens.ndim != 2 or not 2 <= tokens.shape[1] <= model_cfg.seq_len + 1:
        raise SamplingError(
            f"tokens must be [batch, 2 .. model.seq_len + 1 ({model_cfg.seq_len + 1})] (got shape {tokens.shape})"
        )
    return _token_logprobs(params, model_cfg, tokens, jnp.float32(temperature))


def place_rows(layout: Layout, params: Params, *rows: np.ndarray) -> tuple[Params, list[jax.Array]]:
    """Parameters and row arrays on an island's mesh: the parameters as the island lays them out (`Layout`), each row
    array [B, ...] split over the data axis. B is padded up to a multiple of the data axis's devices by repeating the
    last row; the caller keeps the first B rows of what comes back."""
    n = data_width(layout.mesh)
    placed_params = jax.device_put(params, layout.shardings(params))
    placed = []
    for array in rows:
        extra = -len(array) % n
        padded = np.concatenate([array, np.repeat(array[-1:], extra, axis=0)]) if extra else array
        placed.append(jax.device_put(padded, row_sharding(layout.mesh)))
    return placed_params, placed
