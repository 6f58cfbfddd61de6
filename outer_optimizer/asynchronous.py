"""The outer step of asynchronous DiLoCo (Async Local-SGD, Liu et al. 2024, arXiv 2401.09135), as pure functions.

In the asynchronous mode the coordinator applies each island's pseudo-gradient the moment it arrives instead of
averaging one per island per round. Two things then differ from a round's outer step:

    staleness   Δ_i was taken from the θ the island pulled, τ updates ago; other islands have moved θ since. It is
                down-weighted by w(τ) = (1 + τ)^(-a) (`staleness_weight`, polynomial staleness discount: FedAsync,
                Xie et al. 2019, arXiv 1903.03934) before the outer step sees it.
    momentum    Nesterov momentum applied at every single arrival compounds stale directions (the paper's finding);
                `delayed_nesterov` keeps a buffer of arrivals and updates and applies the momentum only every N-th
                one (the paper's Delayed Nesterov, Algorithm 3), with plain SGD steps in between.

Both are independent of any transport or driver: `diloco/simulator/async_sim.py` (the event-driven `simulate` mode)
calls them. The config keys are `outer.kind = "delayed_nesterov"`, `outer.momentum_every` (N) and
`outer.staleness_exponent` (a), in `outer_optimizer/optimizers.py`'s `OuterConfig`, which validates them with the
helpers here.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from outer_optimizer.config import valid_staleness_exponent


def staleness_weight(staleness: int, exponent: float) -> float:
    """w(τ) = (1 + τ)^(-a): the weight of a pseudo-gradient that is τ outer updates stale.

    τ is the number of updates the coordinator applied between the island's pull of θ and its push (0: nothing
    happened meanwhile, so w = 1 exactly and the Δ goes in unchanged). a = `outer.staleness_exponent` >= 0; a = 0
    weighs every Δ 1 (no discount), a = 0.5 halves a Δ that is 3 updates stale, a = 1 quarters it.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0 (got {staleness})")
    if not valid_staleness_exponent(exponent):
        raise ValueError(f"staleness exponent must be a finite number >= 0 (got {exponent})")
    return float((1.0 + staleness) ** -exponent)


def discount(delta: optax.Updates, weight: float) -> optax.Updates:
    """w · Δ, leaf by leaf in float32 (w = 1 leaves every value bit for bit as it was)."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) * weight, delta)


class DelayedNesterovState(NamedTuple):
    """What `delayed_nesterov` carries between arrivals (checkpointed with the rest of the outer state)."""

    count: jax.Array
    """int32 scalar: pseudo-gradients received so far (t)."""
    momentum: optax.Updates
    """m: updated every N-th arrival only."""
    buffer: optax.Updates
    """Σ g of the arrivals since the last momentum update (zeros after it)."""


def delayed_nesterov(lr: float, momentum: float, every: int) -> optax.GradientTransformation:
    """Delayed Nesterov (DN) as an optax transformation: ε = lr, β = momentum, N = every. For arrival t = 1, 2, ...
    with (staleness-weighted) pseudo-gradient g_t:

        b_t = b_{t-1} + g_t                                   the buffer, every arrival
        if t mod N = 0:   m_t = b_t / N + β m_{t-1};  b_t = 0;  u_t = -ε (g_t / N + β m_t)
        else:             m_t = m_{t-1};                        u_t = -ε g_t / N

    Over N arrivals θ moves by -ε (mean(g) + β m_t): exactly one Nesterov step (optax's form, below) on the mean of
    the N pseudo-gradients, but applied a piece at a time, so every island pulls a θ that already holds its own Δ
    while the momentum is fed the buffer's mean rather than each stale Δ alone. N = 1 is optax's Nesterov SGD bit for
    bit (m_t = g_t + β m_{t-1}, u_t = -ε (g_t + β m_t)): the same float operations in the same order.
    """
    if not every >= 1:
        raise ValueError(f"delayed Nesterov needs every >= 1 (got {every})")

    def init(params: optax.Params) -> DelayedNesterovState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update(
        updates: optax.Updates, state: DelayedNesterovState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, DelayedNesterovState]:
        del params
        count = state.count + 1
        due = count % every == 0
        buffer = jax.tree.map(lambda b, g: b + g, state.buffer, updates)
        m = jax.tree.map(lambda b, m: jnp.where(due, b / every + momentum * m, m), buffer, state.momentum)
        buffer = jax.tree.map(lambda b: jnp.where(due, jnp.zeros_like(b), b), buffer)
        # `g / every + β m` is optax's `g + decay * trace` when N = 1; the momentum term is 0 between due arrivals.
        out = jax.tree.map(lambda g, m: (g / every + jnp.where(due, momentum * m, 0.0)) * -lr, updates, m)
        return out, DelayedNesterovState(count, m, buffer)

    return optax.GradientTransformation(init, update)
