"""The logical axes of every built-in family's parameters: what each dimension of a leaf means.

A leaf's dimensions are named by what they index (MaxText's logical axis names, its `logical_axis_rules`): "embed"
(the model width D), "vocab", "heads" (query heads x head size, head-major), "kv_heads", "qkv" (GPT-2's fused query,
key and value columns), "mlp" (the feed-forward's hidden width F), "experts". islands/mesh.py maps them to an island's
mesh axes with one rules table; nothing here knows a mesh.

The names follow the params layouts in transformer.py (GPT-2), moe.py and llama.py: a leaf is named by its last two
path parts ("attn/wq"), or by its last where that alone says what it is ("w_down" [F, D], or [E, F, D] in an expert
stack). A LoRA adapter of a matrix (lora.py: A [in, r] and B [r, out] under the matrix's name) takes the matrix's
input axis and its output axis, its rank unsplit. An optimizer state mirrors the parameters under longer paths
("0/mu/blocks/3/attn/wq"): the same last parts, the same axes.
"""

from __future__ import annotations

from collections.abc import Mapping

from islands.models.config import ModelConfig

Axes = tuple[str | None, ...]
"""One logical name (or None: nothing to split by) per dimension of a leaf."""

_IN, _OUT = ("embed", "mlp"), ("mlp", "embed")

LEAF_AXES: Mapping[str, Mapping[int, Axes]] = {
    "embed/tok": {2: ("vocab", "embed")},
    "embed/pos": {2: (None, "embed")},
    "lm_head": {2: ("embed", "vocab")},
    "attn/wqkv": {2: ("embed", "qkv")},
    "attn/bqkv": {1: ("qkv",)},
    "attn/wq": {2: ("embed", "heads")},
    "attn/wk": {2: ("embed", "kv_heads")},
    "attn/wv": {2: ("embed", "kv_heads")},
    "attn/wo": {2: ("heads", "embed")},
    "attn/bq": {1: ("heads",)},
    "attn/bk": {1: ("kv_heads",)},
    "attn/bv": {1: ("kv_heads",)},
    "attn/bo": {1: ("embed",)},
    "q_norm/scale": {1: (None,)},
    "k_norm/scale": {1: (None,)},
    "scale": {1: ("embed",)},
    "bias": {1: ("embed",)},
    "w1": {2: _IN, 3: ("experts", *_IN)},
    "w_gate": {2: _IN, 3: ("experts", *_IN)},
    "w_up": {2: _IN, 3: ("experts", *_IN)},
    "w2": {2: _OUT, 3: ("experts", *_OUT)},
    "w_down": {2: _OUT, 3: ("experts", *_OUT)},
    "b1": {1: ("mlp",), 2: ("experts", "mlp")},
    "b2": {1: ("embed",), 2: ("experts", "embed")},
    "router": {2: ("embed", None)},
    "gate": {2: ("embed", None)},
}
"""Leaf name (its last two path parts, else its last) -> its logical axes by number of dimensions."""


def logical_axes(name: str, ndim: int) -> Axes | None:
    """The logical axes of the leaf `name` ("blocks/0/attn/wq", or an optimizer state's longer path) with `ndim`
    dimensions; () for a scalar; None where no built-in family has such a leaf (a user model's)."""
    if ndim == 0:
        return ()
    parts = name.split("/")
    if parts[-1] in ("lora_a", "lora_b") and ndim == 2:  # a LoRA adapter of a matrix (islands/models/lora.py)
        matrix = logical_axes("/".join(parts[:-1]), 2)
        if matrix is None:
            return None
        return (matrix[0], None) if parts[-1] == "lora_a" else (None, matrix[1])
    for key in ("/".join(parts[-2:]), parts[-1]):
        if key in LEAF_AXES:
            return LEAF_AXES[key].get(ndim)
    return None


def axis_units(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """How many whole units each logical axis of `cfg`'s leaves holds, where a unit is wider than one column: a split
    of the axis must keep each unit whole (a query head's Dh columns; GPT-2's fused columns hold 3 x n_heads heads)."""
    units = {"heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "qkv": 3 * cfg.n_heads}
    if cfg.kind in ("moe", "llama_moe"):
        units["experts"] = cfg.n_experts
    return tuple(units.items())
