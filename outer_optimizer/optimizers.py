"""Outer optimizers as optax `GradientTransformation`s (DiLoCo's outer loop).

The coordinator treats the averaged pseudo-gradient Δ as a gradient and runs one optax step on the global
parameters: `nesterov` (the paper's default: SGD with Nesterov momentum, lr 0.7, μ 0.9), `sgd` (lr 1 and no
momentum is FedAvg: θ becomes the islands' mean), `adam` (FedAdam), and `delayed_nesterov` (Async Local-SGD's
Nesterov whose momentum moves every `momentum_every` updates: outer_optimizer/asynchronous.py, made for
`train.mode = "async"`). Because they are plain optax transformations a user can `optax.chain` clipping or anything
else in front of them.

The `[outer]` section also chooses how the islands' pseudo-gradients are combined before that step
(`aggregate`, `norm_bound`, `trim`; the rules and their guarantees are in outer_optimizer/aggregate.py), and how
much a stale pseudo-gradient counts in the asynchronous mode (`staleness_exponent`).

Invariant (tested): one island with outer `sgd`, lr 1, no momentum reproduces plain inner training, since
θ + (-(θ - θ_local)) = θ_local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
import optax

from outer_optimizer.aggregate import RULES, Rule, make_rule, valid_norm_bound, valid_trim
from outer_optimizer.asynchronous import delayed_nesterov, valid_staleness_exponent


@dataclass(frozen=True)
class OuterConfig:
    kind: str = "nesterov"
    """Outer optimizer: "nesterov" (SGD + Nesterov momentum, DiLoCo default), "sgd" (FedAvg at lr 1), "adam", or
    "delayed_nesterov" (Nesterov whose momentum is updated and applied every `momentum_every` updates, SGD steps of
    lr/N in between: Async Local-SGD's remedy for stale pseudo-gradients, for train.mode = "async")."""
    lr: float = 0.7
    """Outer learning rate (paper: 0.7 for nesterov; 1.0 for sgd is FedAvg)."""
    momentum: float = 0.9
    """Momentum for nesterov, delayed_nesterov and sgd (0 disables it for sgd)."""
    b1: float = 0.9
    """Adam β1 (kind = "adam" only)."""
    b2: float = 0.99
    """Adam β2 (kind = "adam" only)."""
    eps: float = 1e-8
    """Adam ε (kind = "adam" only)."""
    momentum_every: int = 3
    """kind = "delayed_nesterov" only: N, the updates between two momentum steps; each update applies -lr·Δ/N and
    every N-th also -lr·β·m, so N updates make one Nesterov step on their mean (outer_optimizer/asynchronous.py).
    The paper sets N to the number of workers; 3 is configs/local.toml's and `diloco bench heterogeneous`'s count.
    1 is plain Nesterov, bit for bit."""
    staleness_exponent: float = 0.5
    """train.mode = "async" only: a in w(τ) = (1 + τ)^(-a), the weight of a pseudo-gradient taken from a θ that τ
    updates have moved since the island pulled it (0: no discount; 0.5 halves a Δ 3 updates stale)."""
    max_staleness: int = 16
    """train.mode = "async" only: a pseudo-gradient taken from a θ more than this many updates old is refused (its
    island restarts from the current θ, losing those steps), and the coordinator keeps this many updates so that an
    island catches up by pulling the ones it missed rather than the whole θ. `simulate` refuses a config whose
    islands.slowdown would make a push staler than this. With M equally fast islands pushes are about M - 1 stale.
    The coordinator holds max_staleness + 1 encoded updates in memory (int8: about a quarter of θ's fp32 bytes each)."""
    clip_norm: float = 0.0
    """If > 0, clip the pseudo-gradient's global norm before the outer step (chained with optax)."""
    aggregate: str = "trimmed_mean"
    """How the islands' pseudo-gradients become one Δ (outer_optimizer/aggregate.py says what each guarantees):
    "mean" (token-weighted, DiLoCo's own rule: one island can move θ anywhere), "norm_clip" (each Δ_i scaled to at
    most norm_bound × the round's median island norm, then the token-weighted mean), "trimmed_mean" (coordinate-wise,
    drop `trim` values at each end and average the rest), "median" (coordinate-wise median).
    Default "trimmed_mean": it drops the extreme values of every coordinate, so one Byzantine island cannot drag
    the Δ whatever it sends (scaled, sign-flipped, noise, float32 max), where the mean follows any one island and
    norm_clip still lets a bounded push through; with every island honest it gives up a little eval loss against the
    mean (BENCHMARKS.md, "Robust aggregation"). With 1 or 2 islands it is exactly the (unweighted) mean of their Δs,
    with 3 or 4 the coordinate-wise median."""
    norm_bound: float = 2.0
    """aggregate = "norm_clip": the largest island norm kept, as a multiple (>= 1) of the round's lower median island
    norm. 2 leaves room for honest islands, whose norms are alike, to go unclipped, and a round in which none is
    clipped is bit-identical to "mean"."""
    trim: float = 0.25
    """aggregate = "trimmed_mean": values dropped at each end of every coordinate, as a whole count (1, 2, ...) or as
    a fraction in [0, 0.5) of the round's islands, rounded up (0.25 drops 1 of 3 or 4 islands, 2 of 5 to 8): the
    number of Byzantine islands tolerated. At most (n-1)//2 are dropped, so with too few islands the rule becomes the
    coordinate-wise median, and with 2 islands their plain (unweighted) mean: no rule can tell which of two lies."""

    def __post_init__(self) -> None:
        if self.kind not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer.kind must be one of {', '.join(OUTER_OPTIMIZERS)} (got {self.kind!r})")
        if not self.lr > 0:
            raise ValueError(f"outer.lr must be > 0 (got {self.lr})")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer.momentum must be in [0, 1) (got {self.momentum})")
        if self.kind in ("nesterov", "delayed_nesterov") and self.momentum == 0:
            raise ValueError(f"outer.momentum must be > 0 for outer.kind = '{self.kind}' (use kind = 'sgd')")
        if self.momentum_every < 1:
            raise ValueError(f"outer.momentum_every must be >= 1 (got {self.momentum_every})")
        if self.max_staleness < 0:
            raise ValueError(f"outer.max_staleness must be >= 0 (got {self.max_staleness})")
        if not valid_staleness_exponent(self.staleness_exponent):
            raise ValueError(f"outer.staleness_exponent must be a finite number >= 0 (got {self.staleness_exponent})")
        for key in ("b1", "b2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"outer.{key} must be in [0, 1) (got {getattr(self, key)})")
        if self.clip_norm < 0:
            raise ValueError(f"outer.clip_norm must be >= 0 (got {self.clip_norm})")
        if self.aggregate not in RULES:
            raise ValueError(f"outer.aggregate must be one of {', '.join(RULES)} (got {self.aggregate!r})")
        if not valid_norm_bound(self.norm_bound):
            raise ValueError(f"outer.norm_bound must be a finite number >= 1 (got {self.norm_bound})")
        if not valid_trim(self.trim):
            raise ValueError(f"outer.trim must be a fraction in [0, 0.5) or a whole count >= 1 (got {self.trim})")

    def build(self) -> optax.GradientTransformation:
        """The optax transformation this config names, with optional clipping chained in front."""
        tx = OUTER_OPTIMIZERS[self.kind](self)
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), tx) if self.clip_norm > 0 else tx

    def aggregator(self) -> Rule:
        """The aggregation rule `aggregate` names, with its norm_bound or trim (what OuterLoop.commit applies)."""
        return make_rule(self.aggregate, self.norm_bound, self.trim)


def _sgd(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.sgd(cfg.lr, momentum=cfg.momentum or None)


def _nesterov(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=True)


def _adam(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.adam(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


def _delayed_nesterov(cfg: OuterConfig) -> optax.GradientTransformation:
    return delayed_nesterov(cfg.lr, cfg.momentum, cfg.momentum_every)


OUTER_OPTIMIZERS: dict[str, Callable[[OuterConfig], optax.GradientTransformation]] = {
    "nesterov": _nesterov,
    "sgd": _sgd,
    "adam": _adam,
    "delayed_nesterov": _delayed_nesterov,
}


def make_outer_step(
    tx: optax.GradientTransformation,
) -> Callable[[optax.Params, optax.OptState, optax.Updates], tuple[optax.Updates, optax.OptState]]:
    """A pure jitted `outer_update(params, opt_state, pseudo_grad) -> (update, opt_state)`.

    It returns the *update* u rather than θ + u so that the caller can quantize u for the downlink and commit
    exactly the decoded û it sends (docs/architecture.md, "The round": commit exactly what is sent).
    """

    @jax.jit
    def outer_update(
        params: optax.Params, opt_state: optax.OptState, pseudo_grad: optax.Updates
    ) -> tuple[optax.Updates, optax.OptState]:
        updates, new_state = tx.update(pseudo_grad, opt_state, params)
        return updates, new_state

    return outer_update


def apply_update(params: optax.Params, update: optax.Updates) -> optax.Params:
    """θ + û, the one float add every replica performs identically: IEEE float32 addition of host arrays (numpy).

    On the host because that is where every replica keeps its copy of the global θ (the coordinator's commit, an
    island's adopt) and the add is one pass over memory, which numpy makes directly where a jitted add would first
    move every host array into XLA's buffers and the results back out. Every replica runs
    this same function, so the sums agree bit for bit (docs/architecture.md, "The round")."""
    return jax.tree.map(lambda p, u: np.add(np.asarray(p), np.asarray(u)), params, update)
