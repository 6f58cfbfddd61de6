"""The `[outer]` section of a run config, and the checks of its values that the outer loop's functions share.

JAX-free, like every config section, so that loading and validating a config does not import JAX
(tests/test_layering.py); `optimizers.py` builds the optax transformation and the aggregation rule from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("nesterov", "sgd", "adam", "delayed_nesterov", "sparseloco")
"""The values of outer.kind (`optimizers.OUTER_OPTIMIZERS` builds each)."""

RULES = ("mean", "norm_clip", "trimmed_mean", "median")
"""The values of outer.aggregate."""


def valid_norm_bound(bound: float) -> bool:
    """A finite bound >= 1: below 1 even the median island would be shrunk (that is outer.lr's job)."""
    return math.isfinite(bound) and bound >= 1


def valid_trim(trim: float) -> bool:
    """A fraction in [0, 0.5) or a whole count >= 1 (a fraction of 0.5 or more would trim every value)."""
    return 0 <= trim < 0.5 or (math.isfinite(trim) and trim >= 1 and trim == int(trim))


def valid_staleness_exponent(exponent: float) -> bool:
    """A finite a >= 0 (a negative one would weigh stale Δs more than fresh ones)."""
    return math.isfinite(exponent) and exponent >= 0


@dataclass(frozen=True)
class OuterConfig:
    kind: str = "nesterov"
    """Outer optimizer: "nesterov" (SGD + Nesterov momentum, DiLoCo default), "sgd" (FedAvg at lr 1), "adam", or
    "delayed_nesterov" (Nesterov whose momentum is updated and applied every `momentum_every` updates, SGD steps of
    lr/N in between: Async Local-SGD's remedy for stale pseudo-gradients, for train.mode = "async"), or "sparseloco"
    (SparseLoCo, arXiv 2508.15706: no outer momentum, θ moves by -lr times the aggregate; the islands' error feedback,
    decayed by `error_decay` every sync, plays the momentum's part: needs a lossy codec.uplink, "sparse" the one the
    paper pairs it with)."""
    lr: float = 0.7
    """Outer learning rate (paper: 0.7 for nesterov; 1.0 for sgd is FedAvg and SparseLoCo's)."""
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
    error_decay: float = 0.95
    """kind = "sparseloco" only: β in e <- β·e + Δ, each island's error feedback decayed before its new pseudo-gradient
    is added (SparseLoCo's Algorithm 1; 0.95 its value). In (0, 1]: 1 is plain error feedback."""
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

    @property
    def feedback_decay(self) -> float:
        """The decay of the islands' error feedback: `error_decay` for sparseloco, 1 (none) for every other kind."""
        return self.error_decay if self.kind == "sparseloco" else 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"outer.kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        if not self.lr > 0:
            raise ValueError(f"outer.lr must be > 0 (got {self.lr})")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer.momentum must be in [0, 1) (got {self.momentum})")
        if self.kind in ("nesterov", "delayed_nesterov") and self.momentum == 0:
            raise ValueError(f"outer.momentum must be > 0 for outer.kind = '{self.kind}' (use kind = 'sgd')")
        if not 0 < self.error_decay <= 1:
            raise ValueError(f"outer.error_decay must be in (0, 1] (got {self.error_decay})")
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
