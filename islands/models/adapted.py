"""A frozen matrix and its LoRA factors, applied unmerged where the model applies the matrix (`transformer.dense`).

`Lora.adapted` (islands/models/lora.py) puts one in place of each adapted matrix of the parameters a LoRA step's
loss reads. Applied to x [..., in]: x·W + (α / r)·(x·A)·B, the two low-rank products at 2·r·(in + out) flops per row,
where the merged weight W + (α / r)·A·B costs a whole [in, out] matrix each step and, in the backward, the whole
weight gradient xᵀ·g, [in, out], to get A's and B's from (full fine-tuning's cost for that matrix). A pytree node:
its children (W, A, B, and a training step's key) are traced arrays, the gradient flows into A and B, and the scale
and the dropout rate are static.

Dropout (workload.lora.dropout, PEFT's `lora_dropout`) drops the adapter's input alone: x·W + (α / r)·(drop(x)·A)·B,
drop(x) inverted dropout (each entry zeroed with probability p, the rest scaled by 1 / (1 - p), so E[drop(x)] = x and
the adapter's term keeps its expectation). It draws only where a training step gave a key; without one (evaluation)
nothing is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Adapted:
    """W [in, out] (the frozen base's, in its dtype) with A [in, r] and B [r, out], scale α / r; in a training step
    that draws, the key of this matrix's dropout mask and its rate."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = field(metadata={"static": True})
    key: jax.Array | None = None
    """The mask's key (None: nothing is dropped)."""
    dropout: float = field(default=0.0, metadata={"static": True})

    def apply(self, x: jax.Array) -> jax.Array:
        """x·W + scale·(drop(x)·A)·B in x's dtype (each factor cast where used, as `transformer.dense` casts W)."""
        dtype = x.dtype
        return x @ self.w.astype(dtype) + (self.dropped(x) @ self.a.astype(dtype)) @ (self.scale * self.b).astype(dtype)

    def dropped(self, x: jax.Array) -> jax.Array:
        """x [..., in] as the adapter reads it: each entry zeroed with probability `dropout`, the others scaled by
        1 / (1 - dropout), a mask of x's shape drawn from `key`; x itself without a key or at rate 0."""
        if self.key is None or self.dropout == 0:
            return x
        keep = jax.random.bernoulli(self.key, 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x * (1.0 / (1.0 - self.dropout)), 0)
