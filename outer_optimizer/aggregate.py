"""Aggregation of pseudo-gradients (DiLoCo, arXiv 2311.08105, Algorithm 1, line 12).

A pseudo-gradient is Δ_i = θ_global - θ_i: global parameters minus the island's parameters after its H inner
steps. Its sign matches an ordinary gradient (it points uphill), so an outer optimizer can treat it as one.

The mean is weighted by the tokens each island trained on, so a slow island that finished fewer steps (or
trained a smaller batch) counts for less. Islands are summed in the order given; callers pass them sorted by
island name so that every process adds the same floats in the same order and gets bit-identical results.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax


def pseudo_gradient(global_params: optax.Params, local_params: optax.Params) -> optax.Updates:
    """Δ = global - local (the sign docs/architecture.md fixes, "The round": an outer *descent* step subtracts it)."""
    return jax.tree.map(lambda g, p: g - p, global_params, local_params)


def weighted_mean(deltas: Sequence[optax.Updates], weights: Sequence[float]) -> optax.Updates:
    """Σ w_i Δ_i / Σ w_i, summed left to right in the order given (deterministic float sums)."""
    if len(deltas) == 0:
        raise ValueError("weighted_mean needs at least one pseudo-gradient")
    if len(deltas) != len(weights):
        raise ValueError(f"weighted_mean got {len(deltas)} pseudo-gradients but {len(weights)} weights")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weighted_mean weights must be >= 0 with a positive sum (got {list(weights)})")
    total = float(sum(weights))
    scales = [float(w) / total for w in weights]
    acc = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) * scales[0], deltas[0])
    for delta, scale in zip(deltas[1:], scales[1:], strict=True):
        acc = jax.tree.map(lambda a, x, s=scale: a + jnp.asarray(x, jnp.float32) * s, acc, delta)
    return acc
