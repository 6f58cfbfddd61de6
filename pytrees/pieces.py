"""A leaf read shard by shard: Δ of a parameter split over an island's devices, as pieces that follow its shards.

An island's θ_local leaf split over its devices (FSDP, a tensor axis) is read one shard at a time: each shard's
values come from its device alone and its Δ is formed against the same region of the global copy, so no whole
leaf of θ_local is gathered on the host. Each piece is then error-fed and encoded alone and travels as a piece of
its tensor (`floor.codec`, "Pieces"); the coordinator assembles the pieces it receives.

A leaf is split only where every piece decodes to exactly what the whole leaf's encoding would
(`floor.codec.piece_decodes_as_whole`): the blocks of the blockwise codecs fall inside the shards. Otherwise it is
read whole, as before. Either way the coordinator decodes the same values bit for bit, so pieces never change a
digest; only how the bytes are cut differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from floor.codec import CodecSpec, piece_decodes_as_whole
from pytrees.naming import to_host


@dataclass(frozen=True)
class Split:
    """A leaf's values as regions that tile it: ``pieces`` of ``(offset, values)``, in its shards' order."""

    shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, ...], np.ndarray], ...]

    def regions(self) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...], np.ndarray]]:
        """Each piece's offset, its region of the leaf as slices, and its values."""
        for offset, values in self.pieces:
            yield offset, region(offset, values.shape), values

    def whole(self) -> np.ndarray:
        """The leaf assembled (float32, as every piece is)."""
        out = np.empty(self.shape, np.float32)
        for _, where, values in self.regions():
            out[where] = values
        return out


def region(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def own_shards(x: jax.Array) -> list[Any]:
    """The shards that hold each value of `x` once (replica 0), for a leaf this process holds all of; [] otherwise."""
    if not x.is_fully_addressable:
        return []
    return [s for s in x.addressable_shards if s.replica_id == 0]


def _offset(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(0 if s.start is None else int(s.start) for s in index) + (0,) * (len(shape) - len(index))


def delta_of(reference: Any, local: Any, spec: CodecSpec) -> np.ndarray | Split:
    """Δ = reference - local for one leaf (float32 on the host): by shard (a `Split`) when `local` is split over
    devices and each shard can travel as a piece under `spec`, else whole."""
    shards = own_shards(local) if isinstance(local, jax.Array) else []
    shape = tuple(int(d) for d in np.shape(local))
    places = [(_offset(s.index, shape), tuple(int(d) for d in s.data.shape)) for s in shards]
    if len(shards) < 2 or not all(
        piece_decodes_as_whole(spec.kind, spec.block_size, shape, offset, piece) for offset, piece in places
    ):
        return to_host(reference) - to_host(local)
    ref = to_host(reference)
    return Split(
        shape,
        tuple(
            (offset, np.asarray(ref[region(offset, piece)] - np.asarray(s.data), np.float32))
            for s, (offset, piece) in zip(shards, places, strict=True)
        ),
    )
