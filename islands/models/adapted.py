"""A frozen matrix and its LoRA factors, applied unmerged where the model applies the matrix (`transformer.dense`).

`Lora.adapted` (islands/models/lora.py) puts one in place of each adapted matrix of the parameters a LoRA step's
loss reads. Applied to x [..., in]: x·W + (α / r)·(x·A)·B, the two low-rank products at 2·r·(in + out) flops per row,
where the merged weight W + (α / r)·A·B costs a whole [in, out] matrix each step and, in the backward, the whole
weight gradient xᵀ·g, [in, out], to get A's and B's from (full fine-tuning's cost for that matrix). A pytree node:
its children (W, A, B) are traced arrays, the gradient flows into A and B, and the scale is static.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Adapted:
    """W [in, out] (the frozen base's, in its dtype) with A [in, r] and B [r, out], scale α / r."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = field(metadata={"static": True})

    def apply(self, x: jax.Array) -> jax.Array:
        """x·W + scale·(x·A)·B in x's dtype (each factor cast where it is used, as `transformer.dense` casts W)."""
        dtype = x.dtype
        return x @ self.w.astype(dtype) + (x @ self.a.astype(dtype)) @ (self.scale * self.b).astype(dtype)
