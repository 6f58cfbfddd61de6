"""The coordinator's round logic, free of any transport: collect, aggregate, outer step, commit.

DiLoCo (arXiv 2311.08105), one outer round r:
    Δ = Σ_i w_i Δ_i / Σ_i w_i            (w_i = tokens island i trained on; islands summed in name order), or the
                                         robust rule outer.aggregate names (outer_optimizer/aggregate.py)
    u, s_{r+1} = outer_update(θ_r, s_r, Δ)
    θ_{r+1} = θ_r + u
The coordinator alone owns `GlobalState(round, params, outer_opt_state)`. It commits exactly the update it
hands to islands, so every island that applies the same update to θ_r holds bit-identical θ_{r+1}, which the
digest proves. The same object serves `diloco simulate` (called directly) and the gRPC coordinator.

Streaming DiLoCo (arXiv 2501.18512; outer_optimizer/fragments.py): the parameters are split into P fragments that
commit in turn, each with its own outer optimizer state. The open sync is (round, fragment); a contribution holds
only that fragment's leaves (name -> array), and a commit moves only those leaves of θ. The round advances when
fragment P-1 commits. P = 1 (one fragment of every leaf) is plain DiLoCo, with the same floats.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax

from floor.codec import CodecSpec, EncodedTensor
from outer_optimizer.aggregate import Aggregated, Rule, mean
from outer_optimizer.fragments import Fragments
from outer_optimizer.optimizers import apply_update, make_outer_step
from pytrees.digest import tree_digest
from pytrees.feedback import Residual, compress_tree, zero_residual
from pytrees.naming import PyTree, flatten_named, unflatten_named


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GlobalState:
    params: PyTree
    outer_opt_state: tuple[PyTree, ...]
    """One outer optimizer state per fragment, over that fragment's leaves (name -> array)."""
    down_residual: Residual = None
    """What the downlink codec dropped from past updates (error feedback), added to the next update: zeros at the
    start for a lossy codec, None for a lossless one."""
    round: int = field(default=0, metadata={"static": True})
    """Rounds committed so far; θ here is θ_round (host int)."""
    fragment: int = field(default=0, metadata={"static": True})
    """The fragment whose sync is open in this round (always 0 without streaming)."""


@dataclass(frozen=True)
class Contribution:
    island: str
    pseudo_grad: PyTree
    tokens: int


@dataclass(frozen=True)
class Commit:
    round: int
    """The round that was closed (θ_{round+1} is now global), or whose fragment was."""
    fragment: int
    """Which fragment was committed (0 without streaming)."""
    encoded: list[EncodedTensor]
    """û, the update that was committed, as it travels on the downlink (the fragment's leaves). Its decoded arrays are
    not kept: the coordinator keeps its last commits for their pulls, and a float32 û beside them would be one more θ
    held for the run's life."""
    islands: tuple[str, ...]
    tokens: int
    digest: str
    """Digest of the new global parameters."""
    fragment_digest: str
    """Digest of the committed fragment's new leaves (`fragment_digest`): what an island that applies û proves."""
    shares: Aggregated = field(repr=False, compare=False)
    """The rule's record of what it used of each island's Δ (its `delta` dropped), read by `kept`."""

    @functools.cached_property
    def kept(self) -> tuple[float, ...]:
        """Per island of `islands`: the share of its Δ the aggregation rule used (outer_optimizer.Aggregated.kept).
        Counted when first read, which the coordinator does off the islands' path (docs/architecture.md, "Commits
        off the critical path")."""
        return tuple(float(k) for k in self.shares.kept)

    @property
    def reduced(self) -> dict[str, float]:
        """Islands the rule clipped (norm_clip: the scale) or trimmed (trimmed_mean, median: the share of coordinates
        kept), for the round's log; empty under "mean"."""
        return {name: k for name, k in zip(self.islands, self.kept, strict=True) if k < 1.0}


def fragment_digest(fragments: Fragments, params: PyTree, p: int) -> str:
    """The digest that proves a copy of fragment p of θ bit-identical: with one fragment, θ's own `tree_digest`
    (what plain DiLoCo has always checked); with several, the digest of that fragment's leaves (name -> array).
    The coordinator and every island compute it the same way from the same config."""
    if fragments.count == 1:
        return tree_digest(params)
    return tree_digest(fragments.select(p, flatten_named(params, to_numpy=False)))


def fragment_digests(fragments: Fragments, params: PyTree, whole: str) -> list[str]:
    """Every fragment's `fragment_digest`, given θ's `tree_digest` (`whole`): with one fragment that is the digest
    itself, so θ is not hashed twice."""
    if fragments.count == 1:
        return [whole]
    return [fragment_digest(fragments, params, p) for p in range(fragments.count)]


class RoundError(ValueError):
    """A contribution that cannot be accepted for the open round (wrong round, duplicate island)."""


class OuterLoop:
    """Holds the global state and the contributions of the round that is open."""

    def __init__(
        self,
        state: GlobalState,
        tx: optax.GradientTransformation,
        downlink: CodecSpec,
        aggregate: Rule = mean,
        fragments: Fragments | None = None,
        union_of: float = 0.0,
    ) -> None:
        self.state = state
        self.downlink = downlink
        self.union_of = union_of
        """With a sparse `downlink`, the uplink's density when each commit is the union of its islands' sparse
        updates (`RunConfig.union_downlink`): a commit of n contributions is sent at n times it (`downlink_for`).
        0: every commit at `downlink`."""
        self.aggregate = aggregate
        """How the round's pseudo-gradients become one (`optimizers.aggregator`; default DiLoCo's weighted mean)."""
        self.fragments = fragments or Fragments.whole(list(flatten_named(state.params)))
        self._outer_update = make_outer_step(tx)
        self._pending: dict[str, Contribution] = {}

    @classmethod
    def fresh(
        cls,
        params: PyTree,
        tx: optax.GradientTransformation,
        downlink: CodecSpec,
        aggregate: Rule = mean,
        fragments: Fragments | None = None,
        union_of: float = 0.0,
    ) -> OuterLoop:
        fragments = fragments or Fragments.whole(list(flatten_named(params)))
        named = flatten_named(params, to_numpy=False)
        opt_states = tuple(tx.init(fragments.select(p, named)) for p in range(fragments.count))
        state = GlobalState(params, opt_states, zero_residual(params, downlink), round=0)
        return cls(state, tx, downlink, aggregate, fragments, union_of)

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def params(self) -> PyTree:
        return self.state.params

    @property
    def fragment(self) -> int:
        """The fragment whose sync is open."""
        return self.state.fragment

    @property
    def sync(self) -> int:
        """The open sync as one count, round·P + fragment (the round itself without streaming): the position the
        coordinator and islands compare (diloco/coordinator/membership.py answers pulls with it)."""
        return self.round * self.fragments.count + self.fragment

    def fragment_params(self, p: int | None = None) -> dict[str, PyTree]:
        """Fragment p's leaves of θ (default: the open one), name -> array."""
        return self.fragments.select(self.fragment if p is None else p, flatten_named(self.params, to_numpy=False))

    @property
    def pending(self) -> tuple[str, ...]:
        return tuple(sorted(self._pending))

    def submit(self, island: str, round: int, pseudo_grad: PyTree, tokens: int, fragment: int = 0) -> None:
        """Δ of the open sync: the open fragment's leaves, as a tree shaped like θ (P = 1) or name -> array."""
        if round != self.state.round or fragment != self.fragment:
            sent, open_ = (
                (f"round {round} fragment {fragment}", f"round {self.round} fragment {self.fragment}")
                if self.fragments.count > 1
                else (f"round {round}", f"round {self.round}")
            )
            raise RoundError(f"island {island} sent a pseudo-gradient for {sent}; {open_} is open")
        if island in self._pending:
            raise RoundError(f"island {island} already contributed to round {round}")
        if tokens <= 0:
            raise RoundError(f"island {island} reported {tokens} tokens for round {round}")
        named = flatten_named(pseudo_grad, to_numpy=False)
        if tuple(named) != self.fragments.names[self.fragment]:
            raise RoundError(f"island {island}'s pseudo-gradient does not hold fragment {self.fragment}'s tensors")
        self._pending[island] = Contribution(island, named, tokens)

    def snapshot(self) -> tuple[GlobalState, dict[str, Contribution]]:
        """The global state and the open round's contributions, to `rollback` to (both are never mutated in place)."""
        return self.state, dict(self._pending)

    def rollback(self, snapshot: tuple[GlobalState, dict[str, Contribution]]) -> None:
        """Undo everything since `snapshot`: a commit, or contributions added or withdrawn."""
        self.state, pending = snapshot
        self._pending = dict(pending)

    def withdraw(self, island: str) -> None:
        """Take an island's contribution out of the open round (it made the round impossible to commit)."""
        self._pending.pop(island, None)

    def largest_contribution(self) -> str:
        """The pending island whose Δ has the largest global norm (in float64, so even float32-max values compare)."""
        if not self._pending:
            raise RoundError(f"round {self.round} has no contributions")

        def norm(c: Contribution) -> float:
            leaves = jax.tree.leaves(c.pseudo_grad)
            return math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in leaves))

        return max(sorted(self._pending), key=lambda name: norm(self._pending[name]))

    def downlink_for(self, contributions: int) -> CodecSpec:
        """The spec a commit of `contributions` islands' pseudo-gradients is sent with: the union's density
        (`CodecSpec.union`, at most whole chunks) or `downlink` as it is."""
        return self.downlink.union(contributions, self.union_of) if self.union_of else self.downlink

    def warm_up(self, contributions: int) -> None:
        """Compile what a commit runs (the rule for this many contributions, every fragment's outer step, the
        downlink codec, the add) on zeros, changing nothing. The coordinator commits under its lock, where a first
        compile (seconds on a loaded machine) would hold up every heartbeat and pull of round 0."""
        theta = flatten_named(self.params)  # host arrays: `to_host`
        for p in range(self.fragments.count):
            mine = self.fragments.select(p, theta)
            zeros = {name: jnp.zeros_like(x) for name, x in mine.items()}
            combined = self.aggregate([zeros] * max(contributions, 1), [1] * max(contributions, 1))
            update, _ = self._outer_update(mine, self.state.outer_opt_state[p], combined.delta)
            residual = None if self.state.down_residual is None else self.fragments.select(p, self.state.down_residual)
            spec = self.downlink_for(max(contributions, 1))
            apply_update(mine, compress_tree(jax.device_get(update), residual, spec).decoded)

    def commit(self) -> Commit:
        """Close the open sync with every contribution received; the outer step of its fragment runs once."""
        if not self._pending:
            raise RoundError(f"round {self.round} has no contributions to commit")
        names = sorted(self._pending)  # fixed order: float sums agree in every process
        contributions = [self._pending[n] for n in names]
        combined = self.aggregate([c.pseudo_grad for c in contributions], [c.tokens for c in contributions])
        s, p = self.state, self.fragment
        theta = flatten_named(s.params)  # host arrays, θ_0 too: `to_host` caches nothing on it
        mine = self.fragments.select(p, theta)
        update, opt_state = self._outer_update(mine, s.outer_opt_state[p], combined.delta)
        # Commit exactly what is sent: û = decode(encode(u + e)); what the codec dropped is carried over.
        residual = None if s.down_residual is None else self.fragments.select(p, s.down_residual)
        sent = compress_tree(jax.device_get(update), residual, self.downlink_for(len(contributions)))
        new_params = unflatten_named({**theta, **apply_update(mine, sent.decoded)}, s.params)
        last = p + 1 == self.fragments.count
        self.state = GlobalState(
            params=new_params,
            outer_opt_state=(*s.outer_opt_state[:p], opt_state, *s.outer_opt_state[p + 1 :]),
            down_residual=None if s.down_residual is None else {**s.down_residual, **(sent.residual or {})},
            round=s.round + 1 if last else s.round,
            fragment=0 if last else p + 1,
        )
        self._pending.clear()
        return Commit(
            round=s.round,
            fragment=p,
            encoded=sent.encoded,
            islands=tuple(names),
            tokens=sum(c.tokens for c in contributions),
            digest=(digest := tree_digest(new_params)),
            fragment_digest=digest if self.fragments.count == 1 else fragment_digest(self.fragments, new_params, p),
            shares=dataclasses.replace(combined, delta=None),
        )
