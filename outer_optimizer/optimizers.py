"""Outer optimizers as optax `GradientTransformation`s (DiLoCo's outer loop).

The coordinator treats the averaged pseudo-gradient Δ as a gradient and runs one optax step on the global
parameters: `nesterov` (the paper's default: SGD with Nesterov momentum, lr 0.7, μ 0.9), `sgd` (lr 1 and no
momentum is FedAvg: θ becomes the islands' mean), `adam` (FedAdam), and `delayed_nesterov` (Async Local-SGD's
Nesterov whose momentum moves every `momentum_every` updates: outer_optimizer/asynchronous.py, made for
`train.mode = "async"`), and `sparseloco` (SparseLoCo, arXiv 2508.15706, Algorithm 1: θ <- θ - lr·Δ with no outer
state; the momentum it drops lives on in each island's decayed error feedback, `OuterConfig.feedback_decay`, applied
by pytrees/feedback.py). Because they are plain optax transformations a user can `optax.chain` clipping or anything
else in front of them.

The `[outer]` section also chooses how the islands' pseudo-gradients are combined before that step
(`aggregate`, `norm_bound`, `trim`; the rules and their guarantees are in outer_optimizer/aggregate.py), and how
much a stale pseudo-gradient counts in the asynchronous mode (`staleness_exponent`).

Invariant (tested): one island with outer `sgd`, lr 1, no momentum reproduces plain inner training, since
θ + (-(θ - θ_local)) = θ_local.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax

from outer_optimizer.aggregate import Rule, make_rule
from outer_optimizer.asynchronous import delayed_nesterov
from outer_optimizer.config import OuterConfig


def _sgd(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.sgd(cfg.lr, momentum=cfg.momentum or None)


def _nesterov(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=True)


def _adam(cfg: OuterConfig) -> optax.GradientTransformation:
    return optax.adam(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


def _delayed_nesterov(cfg: OuterConfig) -> optax.GradientTransformation:
    return delayed_nesterov(cfg.lr, cfg.momentum, cfg.momentum_every)


def _sparseloco(cfg: OuterConfig) -> optax.GradientTransformation:
    # The outer step is plain SGD on the aggregate of the islands' sparse messages; outer.momentum is not used.
    return optax.sgd(cfg.lr)


OUTER_OPTIMIZERS: dict[str, Callable[[OuterConfig], optax.GradientTransformation]] = {
    "nesterov": _nesterov,
    "sgd": _sgd,
    "adam": _adam,
    "delayed_nesterov": _delayed_nesterov,
    "sparseloco": _sparseloco,
}
"""outer.kind -> its optax transformation; one entry for each of `outer_optimizer.config.KINDS`."""


def build_optimizer(cfg: OuterConfig) -> optax.GradientTransformation:
    """The optax transformation `cfg` names, with optional clipping chained in front."""
    tx = OUTER_OPTIMIZERS[cfg.kind](cfg)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx) if cfg.clip_norm > 0 else tx


def aggregator(cfg: OuterConfig) -> Rule:
    """The aggregation rule `cfg.aggregate` names, with its norm_bound or trim (what OuterLoop.commit applies)."""
    return make_rule(cfg.aggregate, cfg.norm_bound, cfg.trim)


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
