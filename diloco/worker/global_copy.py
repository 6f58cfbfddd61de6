"""An island's copy of the global θ, as a value: where it stands in the schedule and how a commit moves it.

The copy is what an island's Δ is taken from and what every commit is checked against: θ at sync position
`position` (`OuterLoop.sync`: round·P + fragment; -1 before the first pull) and each fragment's digest in it (sent
with a push, so the coordinator knows which θ Δ was taken from). A commit moves it by `apply`, a pure function of
the copy and the pulled payload:

    update of the next position -> θ_p + û_p, proved by the commit's digest (the fragment's; with P = 1, θ's)
    full θ                      -> θ as it came, proved by its digest
    anything else               -> None: the caller decides (pull the full θ, or stop)

No sockets, no clock, no log: the island's worker (diloco/worker/island_worker.py) pulls, logs and decides what a
refusal means. A streaming fragment's update can be applied ahead, on the pull lane that brought it (`ready`): decoding,
adding and hashing then stay off the training thread, and `apply` takes that result as it is when the copy still
holds the leaves it was applied to (a fragment's leaves change only by its own commits and by a restart from the
full θ), and redoes it otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from diloco.run.rounds import fragment_digest, fragment_digests
from floor.codec import CodecError, CodecSpec
from outer_optimizer.fragments import Fragments
from outer_optimizer.optimizers import apply_update
from pytrees.digest import tree_digest
from pytrees.naming import PyTree, flatten_named, unflatten_named
from transport.handler import PullPayload
from transport.tensors import decoder


def arrays_of(payload: PullPayload, sent_with: Sequence[CodecSpec] = ()) -> dict[str, np.ndarray] | None:
    """The payload's tensors decoded, by name (float32); None when one does not decode, or (``sent_with``: the
    specs the run sends commits with, `RunConfig.downlink_specs`) was sent at a density or width the run does not
    send (`floor.codec.decode`)."""
    decode = decoder(sent_with)
    try:
        return {t.name: np.array(decode(t), np.float32) for t in payload.tensors}
    except CodecError:
        return None


def same_leaves(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same arrays under the same names: the same objects, not equal ones (cheap, and exact)."""
    return a.keys() == b.keys() and all(a[n] is b[n] for n in a)


def rolled_back(held: GlobalCopy, taken: GlobalCopy) -> bool:
    """Taking the full θ `taken` in place of the copy `held` undoes commits the island held: `taken` is at an earlier
    position, or at the same one with another θ. A coordinator restarted from a checkpoint older than a commit it had
    served does this (docs/architecture.md, "Commits off the critical path"). A copy that lagged and is replaced by a
    later θ cannot tell here whether its own θ was one the run forgot; the soak reads that from the digests."""
    if held.params is None or held.position < 0:
        return False
    return taken.position < held.position or (taken.position == held.position and taken.digests != held.digests)


@dataclass(frozen=True)
class Ready:
    """A streaming fragment's update applied ahead of `apply` (`GlobalCopy.ready`): the fragment's leaves of the
    copy it was applied to (`base`) and the leaves it makes, which passed the commit's digest."""

    position: int
    """The sync position the copy reaches with it."""
    base: dict[str, np.ndarray]
    leaves: dict[str, np.ndarray]
    on_mesh: dict[str, Any] | None = None
    """`leaves` placed on the island's mesh by the pull lane, ready for a merge with α = 0 (`Island.merge`); None
    with α > 0, or when `apply` redid the update (the merge places the leaves itself)."""


@dataclass(frozen=True)
class GlobalCopy:
    """θ at sync position `position` with each fragment's digest in it (`digests`); `params` None before the first
    pull. `fragments` and `like` (θ's tree structure) are the run's and never change."""

    fragments: Fragments
    like: PyTree
    params: PyTree = None
    position: int = -1
    digests: tuple[str, ...] = ()
    downlink: tuple[CodecSpec, ...] = ()
    """The specs the run sends commits with (`RunConfig.downlink_specs`): an update sent with another is refused as
    one that does not prove out. Empty: any."""

    @classmethod
    def whole(
        cls, fragments: Fragments, like: PyTree, params: PyTree, position: int, downlink: tuple[CodecSpec, ...] = ()
    ) -> GlobalCopy:
        """θ taken as a whole at `position` (a checkpoint of the island's own), its digests computed here."""
        params = jax.tree.map(np.asarray, params)
        digests = tuple(fragment_digests(fragments, params, tree_digest(params)))
        return cls(fragments, like, params, position, digests, downlink)

    @property
    def count(self) -> int:
        """P: the number of fragments (1 without streaming)."""
        return self.fragments.count

    @property
    def round(self) -> int:
        """The round of the copy (-1: none)."""
        return self.position // self.count if self.position >= 0 else -1

    def position_of(self, payload: PullPayload) -> int:
        """The sync position a payload brings the copy to."""
        return payload.round * self.count + payload.fragment

    def fragment(self, p: int) -> dict[str, np.ndarray]:
        """Fragment p's leaves of the copy, by name."""
        return self.fragments.select(p, flatten_named(self.params))

    def apply(self, payload: PullPayload, ready: Ready | None = None) -> GlobalCopy | None:
        """The copy moved to the payload's position: the fragment's û applied to the position the copy holds
        (`ready`: already applied ahead, taken when it was applied to the leaves the copy holds now), or the full
        θ taken; None when the payload does not prove out (an update of another position, or a digest that fails).
        """
        if payload.kind == "update":
            return self._updated(payload, ready)
        return self._replaced(payload)

    def ready(self, payload: PullPayload, base: dict[str, np.ndarray] | None = None) -> Ready | None:
        """A streaming fragment's update (P > 1) applied to that fragment's leaves of this copy (`base`, default
        the leaves it holds now) and proved by the commit's digest (the fragment's `fragment_digest`: its leaves by
        name); None when it is not such an update or fails. Pure, so a pull lane runs it as soon as the pull lands
        (diloco/worker/island_sync.py), and `apply` only checks that the copy it meets still holds `base`."""
        if self.count == 1 or payload.kind != "update" or self.params is None:
            return None
        position = self.position_of(payload)
        if base is None:
            base = self.fragment((position - 1) % self.count)
        update = arrays_of(payload, self.downlink)
        if update is None or set(update) != set(base):
            return None
        # Host arrays, so that the copy's leaves stay these objects (flatten_named of a device array makes a new one).
        leaves = {name: np.asarray(v) for name, v in apply_update(base, update).items()}
        if tree_digest(leaves) != payload.param_digest.hex():
            return None
        return Ready(position, base, leaves)

    def _updated(self, payload: PullPayload, ready: Ready | None) -> GlobalCopy | None:
        """θ_p += û_p when the update is for the position the copy holds and its digest checks out."""
        p = self.position % self.count
        if self.position < 0 or self.position_of(payload) != self.position + 1:
            return None
        theta = flatten_named(self.params)
        base = self.fragments.select(p, theta)
        if self.count > 1:
            if ready is None or ready.position != self.position + 1 or not same_leaves(ready.base, base):
                ready = self.ready(payload, base)
            if ready is None:
                return None
            new = unflatten_named({**theta, **ready.leaves}, self.like)
        else:  # plain rounds prove all of θ: its digest needs the whole new tree
            update = arrays_of(payload, self.downlink)
            if update is None or set(update) != set(base):
                return None
            new = unflatten_named({**theta, **apply_update(base, update)}, self.like)
            if fragment_digest(self.fragments, new, p) != payload.param_digest.hex():
                return None
        digests = (*self.digests[:p], payload.param_digest.hex(), *self.digests[p + 1 :])
        return replace(self, params=new, position=self.position + 1, digests=digests)

    def _replaced(self, payload: PullPayload) -> GlobalCopy | None:
        """The full θ of the payload's position, when it matches its digest."""
        arrays = arrays_of(payload)  # θ itself, in fp32
        if arrays is None:
            return None
        new = jax.tree.map(np.asarray, unflatten_named(arrays, self.like))
        digest = tree_digest(new)
        if digest != payload.param_digest.hex():
            return None
        digests = tuple(fragment_digests(self.fragments, new, digest))
        return replace(self, params=new, position=self.position_of(payload), digests=digests)
