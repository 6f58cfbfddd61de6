"""`train.mode = "async"` in `diloco simulate`: asynchronous DiLoCo (Async Local-SGD, arXiv 2401.09135), event-driven
on a virtual clock.

No island waits for another. Each trains H inner steps from the θ it last pulled, pushes Δ = θ_pulled - θ_local and
at once pulls the current θ to start its next H steps. The coordinator applies every Δ the moment it arrives:

    τ = updates applied since the island pulled θ               staleness (`staleness`)
    g = w(τ) · Δ,   w(τ) = (1 + τ)^(-a)                         a = outer.staleness_exponent
    commit g alone: outer step (outer.kind; the paper's is "delayed_nesterov"), θ += û, evaluate, `round` event
(outer_optimizer/asynchronous.py has the formulas). A commit holds one island's Δ, so outer.aggregate has nothing to
combine (every rule is the identity on one input): the asynchronous mode gives no Byzantine robustness.

Virtual clock. An island whose islands.slowdown factor is s (1 when not listed) takes s time units per inner step,
so its k-th push happens at time k·H·s, and pushes are applied in the order of those times, ties in island-name
order (`push_order`). One unit is one inner step of an island at full speed. The order depends on the config only,
never on how fast this machine happens to be, so a run is reproducible bit for bit; the measured seconds (which
include the slowdown's sleeping) are reported beside it (the `seconds` of each `round` event, summary.json's
wall_s) and never decide anything. An island 2x slower than the rest pushes half as often.

One process. The islands take turns: an island trains its H steps when its push comes up, not while the others
train. Its steps depend only on the θ it pulled and its own state, so the result is what concurrent islands would
compute. Between two updates every island but the one that just pushed holds exactly the θ it pulled, which is why
its checkpointed state is all a resume needs.

Run length. train.rounds counts updates (one island's H steps each), so islands.count × the rounds of a plain run
trains the same tokens. Each island's inner learning-rate schedule spans the steps it will take, which the push
order fixes in advance (a fast island's cosine is longer than a slow one's; both end with the run).

Metrics. One `round` event per update (round = the update's index) with GlobalRun's fields plus island, staleness,
weight and vtime (the push's virtual time); the pushing island's `inner` events carry the same round. bytes_down
counts the τ + 1 updates the pushing island pulls to catch up (the same encoded size each, exact without zstd).

Resume. The global state and every island's are checkpointed every train.checkpoint_every updates (diloco/
local_islands.py); the push order and the staleness of every push follow from the config, so the count of updates
applied says where each island stands: a resumed run ends with the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp

from diloco.config import ConfigError, RunConfig
from diloco.ops.progress import Progress
from diloco.run.global_run import GlobalRun, checkpoint_due
from diloco.run.memory_plan import check_process
from diloco.run.rundir import RunDir
from diloco.run.setup import Setup, make_island
from diloco.simulator.local_islands import finish, save_islands, start_islands
from islands.chunks import ChunkStream
from outer_optimizer.asynchronous import discount, staleness_weight
from pytrees.naming import flatten_named


@dataclass(frozen=True)
class Push:
    """One push of the asynchronous schedule."""

    time: Fraction
    """Virtual time of the push: k·H·s for the island's k-th push (exact, so equal times compare equal)."""
    island: str


def push_order(factors: Mapping[str, float], inner_steps: int, updates: int) -> list[Push]:
    """The first `updates` pushes of the islands `factors` names (name -> slowdown factor s >= 1), in the order the
    coordinator applies them: by virtual time k·H·s (k = 1, 2, ... for the island's k-th push), ties in name order.

    Times are exact rationals of the factors' float values, so two islands whose pushes coincide tie exactly.
    """
    queue = [(Fraction(s) * inner_steps, name, 1) for name, s in factors.items()]
    heapq.heapify(queue)
    order = []
    while queue and len(order) < updates:
        t, name, k = heapq.heappop(queue)
        order.append(Push(t, name))
        heapq.heappush(queue, (Fraction(factors[name]) * inner_steps * (k + 1), name, k + 1))
    return order


def staleness(order: Sequence[Push]) -> list[int]:
    """τ of each push in `order`: the updates applied after the island pulled θ (at its previous push, else at the
    start) and before its push. With M equally fast islands every push after the first M is M - 1 stale."""
    pulled: dict[str, int] = {}
    out = []
    for u, push in enumerate(order):
        out.append(u - pulled.get(push.island, 0))
        pulled[push.island] = u + 1
    return out


def async_order(cfg: RunConfig) -> list[Push]:
    """The run's pushes on the virtual clock (`push_order` of the islands' islands.slowdown factors)."""
    slow = cfg.islands.slowdowns()
    factors = {name: slow.get(name, 1.0) for name in cfg.islands.island_names}
    return push_order(factors, cfg.train.inner_steps, cfg.train.rounds)


def planned_steps(order: Sequence[Push], names: Sequence[str], inner_steps: int) -> dict[str, int]:
    """The inner steps each island's learning-rate schedule spans: its pushes in `order` times H, at least one push
    (an island slowed past the run's end still gets a valid schedule). The island processes plan with the same
    clock, so their schedules depend on the config only, whatever their real pushes turn out to be."""
    pushes = Counter(push.island for push in order)
    return {name: max(pushes[name], 1) * inner_steps for name in names}


def run_async(cfg: RunConfig, setup: Setup, rd: RunDir, show_progress: bool) -> dict[str, Any]:
    """Train per `cfg` with asynchronous pushes (module docstring); return summary.json's contents."""
    names = list(cfg.islands.island_names)
    order = async_order(cfg)
    taus = staleness(order)
    if taus and max(taus) > cfg.outer.max_staleness:
        worst = order[taus.index(max(taus))].island
        raise ConfigError(
            f"train.mode = 'async': island {worst}'s pushes would be up to {max(taus)} updates stale, over "
            f"outer.max_staleness = {cfg.outer.max_staleness} (the coordinator would refuse them); raise it"
        )
    world = GlobalRun(cfg, rd, setup, durable=True)  # one save at a time: islands/memory.py
    steps = planned_steps(order, names, cfg.train.inner_steps)
    islands = {
        name: make_island(cfg, name, setup.model_of(name), setup.streams[name], total_steps=steps[name])
        for name in names
    }
    check_process(cfg, setup, list(islands.values()), world.evaluate)  # all of it, before any island's state exists
    stores = start_islands(cfg, rd, world, list(islands.values()))
    totals = world.totals
    progress = Progress(cfg.train.rounds, f"{cfg.run.name} async x{len(names)}", show_progress)
    try:
        while not world.done:
            u = world.loop.round
            island, tau = islands[order[u].island], taus[u]
            assert island.state is not None
            t0 = time.monotonic()
            # θ as the island pulled it, τ updates ago, copied: the inner steps donate (free) the island's buffers.
            pulled = jax.tree.map(lambda x: jnp.array(x, copy=True), flatten_named(island.state.params, to_numpy=False))
            chunks = world.chunks if isinstance(island.stream, ChunkStream) else None
            if chunks is not None:  # its H steps read what the ledger leases it now, and the update consumes them
                island.stream.begin(chunks.lease(island.name, cfg.train.inner_steps * island.stream.batch_size))
            push = island.encode_delta(island.train(cfg.train.inner_steps), pulled)
            if chunks is not None:
                chunks.record(island.name, u, island.stream.taken())
            island.keep_residual(push)  # in one process every push is delivered
            weight = staleness_weight(tau, cfg.outer.staleness_exponent)
            world.loop.submit(island.name, u, discount(push.sent.decoded, weight), push.run.tokens)
            rd.log_inner(u, island.name, push.run.first_step, push.run.losses, cfg.train.log_every, push.run.figures)
            totals.tokens += push.run.tokens
            totals.bytes_up += push.sent.payload_nbytes
            totals.compute_s += push.run.seconds
            seconds = time.monotonic() - t0
            totals.island_wall_s += seconds
            loss = float(push.run.losses[-1])
            vtime = float(order[u].time)
            commit = world.close_round(
                losses=[loss],
                seconds=seconds,
                deliveries=tau + 1,
                annotations={"island": island.name, "staleness": tau, "weight": round(weight, 6), "vtime": vtime},
            )
            island.set_params(world.loop.params)  # it pulls the new θ and starts its next H steps
            if stores and checkpoint_due(cfg, world.loop.round):
                save_islands(stores, list(islands.values()), world.loop.round)
            progress.update(world.loop.round, loss, totals.final_eval_loss, commit.tokens / max(seconds, 1e-9))
    finally:
        finish(world, stores, progress)
    return world.summary()
