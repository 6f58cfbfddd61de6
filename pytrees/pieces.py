"""A leaf as pieces that follow its shards: Δ of a parameter split over an island's devices (`Split`).

An island's θ_local leaf split over its devices (FSDP, a tensor axis) is read one shard at a time
(`islands.island.delta_of`): each shard's values come from its device alone and its Δ is formed against the same
region of the global copy, so no whole leaf of θ_local is gathered on the host. Each piece is then error-fed and
encoded alone (`pytrees.feedback.compress_split`) and travels as a piece of its tensor (`floor.codec`, "Pieces"); the
coordinator assembles the pieces it receives.

A leaf is split only where every piece decodes to exactly what the whole leaf's encoding would
(`floor.codec.piece_decodes_as_whole`): the blocks of the blockwise codecs fall inside the shards. Otherwise it is
read whole, as before. Either way the coordinator decodes the same values bit for bit, so pieces never change a
digest; only how the bytes are cut differs.

On a multi-process island whose parameters are split across its processes (FSDP over them), each process holds only
its own pieces of such a leaf: its `Split` is partial (`complete` is False), and so are its decoded values and its
residual for that leaf; the leader gathers every process's encoded pieces into the island's one push
(diloco/worker/island_group.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Split:
    """A leaf's values as regions that tile it: ``pieces`` of ``(offset, values)``, in its shards' order."""

    shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, ...], np.ndarray], ...]

    def regions(self) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...], np.ndarray]]:
        """Each piece's offset, its region of the leaf as slices, and its values."""
        for offset, values in self.pieces:
            yield offset, region(offset, values.shape), values

    @property
    def complete(self) -> bool:
        """The pieces tile the whole leaf (they never overlap: they are shards of one array)."""
        return sum(values.size for _, values in self.pieces) == math.prod(self.shape)

    def at(self, offset: tuple[int, ...]) -> np.ndarray:
        """The piece at `offset`."""
        for o, values in self.pieces:
            if o == offset:
                return values
        raise KeyError(f"no piece at {offset} of a leaf of shape {self.shape}")

    def whole(self) -> np.ndarray:
        """The leaf assembled (float32, as every piece is); only a complete Split has one."""
        assert self.complete, f"a partial Split of a leaf of shape {self.shape} has no whole"
        out = np.empty(self.shape, np.float32)
        for _, where, values in self.regions():
            out[where] = values
        return out


def values_at(x: np.ndarray | Split, offset: tuple[int, ...], where: tuple[slice, ...]) -> np.ndarray:
    """A piece's values (at `offset`, the region `where`) of a whole leaf, or of a Split holding that piece."""
    return x.at(offset) if isinstance(x, Split) else x[where]


def region(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
