"""Streaming DiLoCo's fragments and schedule (arXiv 2501.18512): which parameters sync together, and when.

The model's leaves (named as `pytrees.naming.flatten_named` names them: ``blocks/3/attn/wo``) are split into P
fragments. Each fragment syncs every H inner steps, but at its own offset, so that one fragment is on the wire
at a time and the bytes of a sync fall about P times:

    S = H / P                            steps between two syncs (H must be a multiple of P)
    sync n = 1, 2, 3, ... happens after inner step n·S and syncs fragment (n - 1) mod P
    so fragment p syncs after steps (p + 1)·S + k·H: with P = 1, after every H-th step (plain DiLoCo)

Layouts (`stream.layout`) of the repeated blocks (a leaf whose path is ``<group>/<k>/...`` with an integer k):

    strided      block k -> fragment k mod P: each fragment holds layers from the whole depth (the paper's choice,
                 which keeps every fragment's share of the model's function alike)
    contiguous   block k -> fragment k·P // n_blocks: fragment 0 holds the first layers, fragment P-1 the last

Every other leaf (embeddings, the final norm), largest first, joins the fragment with the fewest elements so far,
so fragments stay close in size (a model whose embedding outweighs a block cannot be split evenly, though).
Everything here is a pure function of names and sizes: every process computes the same fragments and the same
schedule from the same config, with nothing on the wire.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

LAYOUTS = ("strided", "contiguous")
_BLOCK = re.compile(r"^[^/]+/(\d+)/")

T = TypeVar("T")


class FragmentError(ValueError):
    """The model cannot be split as the config asks (more fragments than it has parts)."""


@dataclass(frozen=True)
class Fragments:
    """The leaf names of each fragment, sorted; every leaf of the model is in exactly one."""

    names: tuple[tuple[str, ...], ...]

    @classmethod
    def whole(cls, leaf_names: Sequence[str]) -> Fragments:
        """One fragment holding every leaf: plain DiLoCo."""
        return cls((tuple(sorted(leaf_names)),))

    @classmethod
    def split(cls, sizes: Mapping[str, int], count: int, layout: str = "strided") -> Fragments:
        """Split leaves (name -> element count) into `count` fragments per `layout` (module docstring)."""
        if layout not in LAYOUTS:
            raise FragmentError(f"stream.layout must be one of {', '.join(LAYOUTS)} (got {layout!r})")
        if count < 1:
            raise FragmentError(f"stream.fragments must be >= 1 (got {count})")
        if count == 1:
            return cls.whole(list(sizes))
        blocks = {name: int(m.group(1)) for name in sizes if (m := _BLOCK.match(name))}
        n_blocks = max(blocks.values(), default=-1) + 1
        groups: list[list[str]] = [[] for _ in range(count)]
        for name in sorted(blocks):
            k = blocks[name]
            groups[k % count if layout == "strided" else k * count // n_blocks].append(name)
        totals = [sum(sizes[n] for n in g) for g in groups]
        for name in sorted(set(sizes) - set(blocks), key=lambda n: (-sizes[n], n)):
            smallest = totals.index(min(totals))
            groups[smallest].append(name)
            totals[smallest] += sizes[name]
        if any(not g for g in groups):
            others = len(sizes) - len(blocks)
            raise FragmentError(
                f"stream.fragments = {count} but the model splits into at most {n_blocks + others} parts "
                f"({n_blocks} repeated blocks and {others} other tensors)"
            )
        return cls(tuple(tuple(sorted(g)) for g in groups))

    @property
    def count(self) -> int:
        return len(self.names)

    def select(self, p: int, named: Mapping[str, T]) -> dict[str, T]:
        """Fragment p's entries of a name-keyed mapping (parameters, a Δ, a residual), in name order."""
        return {name: named[name] for name in self.names[p]}


def check_schedule(inner_steps: int, fragments: int, overlap_steps: int) -> str | None:
    """Why (H, P, τ) cannot be scheduled, or None."""
    if inner_steps % fragments:
        return f"train.inner_steps ({inner_steps}) must be a multiple of stream.fragments ({fragments})"
    if not 0 <= overlap_steps < inner_steps:
        # A fragment's global copy must arrive before that fragment syncs again, H steps later.
        return f"stream.overlap_steps must be in [0, train.inner_steps) = [0, {inner_steps}) (got {overlap_steps})"
    return None


def syncing_fragment(step: int, inner_steps: int, fragments: int) -> int | None:
    """The fragment that syncs right after inner step `step` (counted from 1), or None between syncs."""
    stride = inner_steps // fragments
    if step <= 0 or step % stride:
        return None
    return (step // stride - 1) % fragments


def merging_fragment(step: int, inner_steps: int, fragments: int, overlap_steps: int) -> int | None:
    """The fragment whose committed global copy an island merges right after inner step `step`: the one that
    synced τ = `overlap_steps` steps earlier (with τ = 0, right after its own sync), or None."""
    return syncing_fragment(step - overlap_steps, inner_steps, fragments)


def next_event(step: int, inner_steps: int, fragments: int, overlap_steps: int) -> int:
    """The first inner step after `step` at which a fragment syncs or is merged: how far to train next."""
    stride = inner_steps // fragments
    next_sync = (step // stride + 1) * stride
    if overlap_steps == 0:
        return next_sync
    k = max(1, (step - overlap_steps) // stride + 1)  # the first sync k·S whose merge k·S + τ comes after `step`
    return min(next_sync, k * stride + overlap_steps)
