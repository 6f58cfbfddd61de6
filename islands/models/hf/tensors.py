"""Tensors between Hugging Face's names and layouts and this project's params pytree, one `Rule` per leaf.

A leaf (named as pytrees/naming.py names it: "blocks/0/attn/wq") is one Hugging Face tensor, or several stacked on a
new first axis (the experts of a mixture: "model.layers.0.mlp.experts.{0..E-1}.gate_proj.weight"), transposed where
Hugging Face keeps a Linear's weight as [out, in] and the project as [in, out] (GPT-2's Conv1D is [in, out] already).
Import (`check`, then `read`) makes float32 master weights of whatever float dtype the checkpoint holds; export
(`hf_sizes`, `hf_tensor`) casts them to the dtype asked for. A float32 checkpoint comes back bit for bit, and so does a
bfloat16 or float16 one exported in its own dtype (a float32 value made from one converts back exactly).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from islands.models.hf.checkpoint import Checkpoint, CheckpointError

FLOAT_KINDS = "f"
"""numpy dtype kinds a weight may have on import (ml_dtypes' bfloat16 and float8 are kind "V": see `is_float`)."""

BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Suffixes of tensors some checkpoints carry that are not weights (rotary tables, GPT-2's causal masks): skipped."""


@dataclass(frozen=True)
class Rule:
    """How one leaf of the params pytree is stored in a Hugging Face checkpoint."""

    ours: str
    """The leaf's name ("blocks/0/attn/wq")."""
    theirs: tuple[str, ...]
    """The Hugging Face tensor, or the tensors stacked on the leaf's first axis (one per expert)."""
    transpose: bool = False
    """Hugging Face's tensor is the transpose of the leaf (of each slice of it, when stacked)."""

    def their_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each of `theirs`, given the leaf's."""
        piece = ours[1:] if len(self.theirs) > 1 else ours
        return tuple(reversed(piece)) if self.transpose else piece


def linear(ours: str, theirs: str) -> Rule:
    """A Linear's weight (or a stack of them): [out, in] there, [in, out] here."""
    return Rule(ours, (theirs,), transpose=True)


def same(ours: str, theirs: str) -> Rule:
    """A tensor stored as the leaf is (embeddings, norms, biases, Conv1D weights)."""
    return Rule(ours, (theirs,))


def slots(rules: Sequence[Rule]) -> dict[str, tuple[Rule, int]]:
    """Hugging Face tensor name -> (its rule, its index in the rule's `theirs`: the slice of the leaf it is)."""
    return {name: (rule, i) for rule in rules for i, name in enumerate(rule.theirs)}


def is_float(dtype: np.dtype) -> bool:
    return dtype.kind in FLOAT_KINDS or dtype.name.startswith(("bfloat16", "float8"))


def _located(checkpoint: Checkpoint, name: str) -> str | None:
    """The checkpoint's name for Hugging Face tensor `name`: itself, or without its first part ("transformer.h.0..."
    saved as "h.0...": the base model's own save, as the original GPT-2 checkpoints are)."""
    if name in checkpoint.tensors:
        return name
    bare = name.partition(".")[2]
    return bare if bare in checkpoint.tensors else None


def check(
    checkpoint: Checkpoint,
    rules: Sequence[Rule],
    shapes: Mapping[str, tuple[int, ...]],
    what: str,
    ignored: Sequence[str] = (),
    where: str = "init.from",
) -> dict[str, str]:
    """Refuse, in one line, a checkpoint that lacks a tensor the rules need, holds one of another shape or of a dtype
    that is not a float, or holds a weight no rule reads (`ignored` names, and `BUFFERS`, excepted); `shapes` are the
    leaves' (the model's abstract init), `what` names the model in the message. Returns the rules' names -> the
    checkpoint's."""
    assert {rule.ours for rule in rules} == set(shapes), "a family's rules and its model's leaves differ"
    found: dict[str, str] = {}
    for rule in rules:
        want = rule.their_shape(shapes[rule.ours])
        for name in rule.theirs:
            located = _located(checkpoint, name)
            if located is None:
                raise CheckpointError(f"{where}: '{checkpoint.directory}' has no tensor '{name}', which {what} needs")
            shard, entry = checkpoint.tensors[located]
            if entry.shape != want:
                raise CheckpointError(
                    f"{where}: tensor '{located}' in '{shard}' is {list(entry.shape)}, but {what} needs {list(want)}"
                )
            if not is_float(entry.dtype):
                raise CheckpointError(f"{where}: tensor '{located}' in '{shard}' is {entry.dtype}, not a float")
            found[name] = located
    skipped = set(ignored) | set(found.values())
    extra = sorted(n for n in checkpoint.tensors if n not in skipped and not n.endswith(BUFFERS))
    if extra:
        raise CheckpointError(
            f"{where}: '{checkpoint.directory}' holds tensor '{extra[0]}', which is no part of {what} "
            f"({len(extra)} such tensors)"
        )
    return found


def read(
    checkpoint: Checkpoint, rules: Sequence[Rule], shapes: Mapping[str, tuple[int, ...]], located: Mapping[str, str]
) -> Iterator[tuple[str, np.ndarray]]:
    """Every leaf as a float32 array in the project's layout, each given out as soon as it is whole, the checkpoint
    read shard by shard (`check` first: it gives `located`). Each Hugging Face tensor goes into its leaf as soon as it
    is read, so what is held at once is the leaf being made (a stack of experts may wait for a later shard)."""
    where = {located[name]: slot for name, slot in slots(rules).items()}
    partial: dict[str, tuple[np.ndarray, int]] = {}
    for name, array in checkpoint.read(where):
        rule, i = where[name]
        value = array.T if rule.transpose else array
        if len(rule.theirs) == 1:
            yield rule.ours, np.ascontiguousarray(value, np.float32)
            continue
        leaf, filled = partial.pop(rule.ours, None) or (np.empty(shapes[rule.ours], np.float32), 0)
        leaf[i] = value
        if filled + 1 == len(rule.theirs):
            yield rule.ours, leaf
        else:
            partial[rule.ours] = (leaf, filled + 1)


def hf_sizes(rules: Sequence[Rule], shapes: Mapping[str, tuple[int, ...]], dtype: np.dtype) -> list[tuple[str, int]]:
    """Each Hugging Face tensor of an export, in the rules' order, with its bytes in `dtype`."""
    return [
        (name, math.prod(rule.their_shape(shapes[rule.ours])) * dtype.itemsize)
        for rule in rules
        for name in rule.theirs
    ]


def export_tensor(rule: Rule, i: int, params: Mapping[str, np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Hugging Face tensor `rule.theirs[i]` made from its leaf, in `dtype`, contiguous."""
    leaf = params[rule.ours]
    piece = leaf[i] if len(rule.theirs) > 1 else leaf
    return np.ascontiguousarray((piece.T if rule.transpose else piece).astype(dtype))
