"""The model contract every island trains: a pair of pure functions (their config is `islands/models/config.py`).

A model is `init(key) -> params` and `loss(params, batch) -> (loss, metrics)` over a plain pytree of
float32 arrays (nested dicts and lists, no flax/haiku), so the DiLoCo machinery (pseudo-gradients,
codecs, digests, checkpoints) sees nothing but leaves and never needs to know which model it moves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

Params = Any
"""A pytree (nested dicts/lists) of float32 jax arrays."""

Metrics = dict[str, jax.Array]
"""Scalar metrics reported next to the loss; always holds at least `ce` (cross-entropy)."""


@dataclass(frozen=True)
class Model:
    """A trainable model as two pure, jit-friendly functions."""

    init: Callable[[jax.Array], Params]
    """rng key -> params pytree (float32 leaves)."""

    loss: Callable[[Params, jax.Array], tuple[jax.Array, Metrics]]
    """(params, batch) -> (scalar loss to minimise, scalar metrics with at least "ce").
    batch is int32 [B, seq_len + 1]: inputs are batch[:, :-1], targets batch[:, 1:]."""

    axis_units: tuple[tuple[str, int], ...] = ()
    """How many whole units (heads, experts) each logical axis of its leaves holds (islands/models/axes.py), which a
    tensor-parallel split keeps whole; none for a user model, whose leaves name no logical axes."""

    step_figures: tuple[str, ...] = ()
    """Metrics of `loss` that each inner step reports beside the loss (a post-training workload's: rl's training
    reward and KL, dpo's preference accuracy); none for a language model, whose loss is its figure."""


def param_count(params: Params) -> int:
    """Total number of scalars in a params pytree (also of `jax.eval_shape(model.init, key)`)."""
    return sum(math.prod(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(params))
