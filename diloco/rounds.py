"""The coordinator's round logic, free of any transport: collect, aggregate, outer step, commit.

DiLoCo (arXiv 2311.08105), one outer round r:
    Δ = Σ_i w_i Δ_i / Σ_i w_i            (w_i = tokens island i trained on; islands summed in name order), or the
                                         robust rule outer.aggregate names (outer_optimizer/aggregate.py)
    u, s_{r+1} = outer_update(θ_r, s_r, Δ)
    θ_{r+1} = θ_r + u
The coordinator alone owns `GlobalState(round, params, outer_opt_state)`. It commits exactly the update it
hands to islands, so every island that applies the same update to θ_r holds bit-identical θ_{r+1}, which the
digest proves. The same object serves `diloco simulate` (called directly) and the gRPC coordinator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import numpy as np
import optax

from islands.compress import Residual, compress_tree, zero_residual
from outer_optimizer import Rule, apply_update, make_outer_step, mean
from transport.codecs import CodecSpec, EncodedTensor, PyTree
from transport.digest import tree_digest


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GlobalState:
    params: PyTree
    outer_opt_state: PyTree
    down_residual: Residual = None
    """What the downlink codec dropped from past updates (error feedback), added to the next update: zeros at the
    start for a lossy codec, None for a lossless one."""
    round: int = field(default=0, metadata={"static": True})
    """Rounds committed so far; θ here is θ_round (host int)."""


@dataclass(frozen=True)
class Contribution:
    island: str
    pseudo_grad: PyTree
    tokens: int


@dataclass(frozen=True)
class Commit:
    round: int
    """The round that was closed (θ_{round+1} is now global)."""
    update: PyTree
    """û: the decoded update that was committed and is sent."""
    encoded: list[EncodedTensor]
    """û as it travels on the downlink."""
    islands: tuple[str, ...]
    tokens: int
    digest: str
    """Digest of the new global parameters."""
    kept: tuple[float, ...]
    """Per island of `islands`: the share of its Δ the aggregation rule used (outer_optimizer.Aggregated.kept)."""

    @property
    def reduced(self) -> dict[str, float]:
        """Islands the rule clipped (norm_clip: the scale) or trimmed (trimmed_mean, median: the share of coordinates
        kept), for the round's log; empty under "mean"."""
        return {name: k for name, k in zip(self.islands, self.kept, strict=True) if k < 1.0}


class RoundError(ValueError):
    """A contribution that cannot be accepted for the open round (wrong round, duplicate island)."""


class OuterLoop:
    """Holds the global state and the contributions of the round that is open."""

    def __init__(
        self, state: GlobalState, tx: optax.GradientTransformation, downlink: CodecSpec, aggregate: Rule = mean
    ) -> None:
        self.state = state
        self.downlink = downlink
        self.aggregate = aggregate
        """How the round's pseudo-gradients become one (`OuterConfig.aggregator()`; default DiLoCo's weighted mean)."""
        self._outer_update = make_outer_step(tx)
        self._pending: dict[str, Contribution] = {}

    @classmethod
    def fresh(
        cls, params: PyTree, tx: optax.GradientTransformation, downlink: CodecSpec, aggregate: Rule = mean
    ) -> OuterLoop:
        state = GlobalState(params, tx.init(params), zero_residual(params, downlink), round=0)
        return cls(state, tx, downlink, aggregate)

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def params(self) -> PyTree:
        return self.state.params

    @property
    def pending(self) -> tuple[str, ...]:
        return tuple(sorted(self._pending))

    def submit(self, island: str, round: int, pseudo_grad: PyTree, tokens: int) -> None:
        if round != self.state.round:
            raise RoundError(f"island {island} sent a pseudo-gradient for round {round}; round {self.round} is open")
        if island in self._pending:
            raise RoundError(f"island {island} already contributed to round {round}")
        if tokens <= 0:
            raise RoundError(f"island {island} reported {tokens} tokens for round {round}")
        self._pending[island] = Contribution(island, pseudo_grad, tokens)

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

    def commit(self) -> Commit:
        """Close the open round with every contribution received; the outer step runs once."""
        if not self._pending:
            raise RoundError(f"round {self.round} has no contributions to commit")
        names = sorted(self._pending)  # fixed order: float sums agree in every process
        contributions = [self._pending[n] for n in names]
        combined = self.aggregate([c.pseudo_grad for c in contributions], [c.tokens for c in contributions])
        update, new_opt_state = self._outer_update(self.state.params, self.state.outer_opt_state, combined.delta)
        # Commit exactly what is sent: û = decode(encode(u + e)); what the codec dropped is carried over.
        sent = compress_tree(jax.device_get(update), self.state.down_residual, self.downlink)
        new_params = apply_update(self.state.params, sent.decoded)
        closed = self.state.round
        self.state = GlobalState(
            params=new_params, outer_opt_state=new_opt_state, down_residual=sent.residual, round=closed + 1
        )
        self._pending.clear()
        return Commit(
            round=closed,
            update=sent.decoded,
            encoded=sent.encoded,
            islands=tuple(names),
            tokens=sum(c.tokens for c in contributions),
            digest=tree_digest(new_params),
            kept=tuple(float(k) for k in jax.device_get(combined.kept)),
        )
