"""`diloco bench overhead`: an island's inner-step throughput against a bare jitted optax loop.

Both loops train the same model on the same mesh with the same optimizer and the same host batches; the bare
loop is the textbook `jit(value_and_grad -> tx.update -> apply_updates)` with donation. The runs alternate
in ABBA order so that drift in the shared machine's load hits both alike; the medians of the per-pair ratios of
wall time and of process CPU time (the latter barely disturbed by other jobs) are reported. Target: island >= 95%
of bare.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import jax
import optax

from diloco.bench.errors import BenchError
from diloco.config import RunConfig
from diloco.run.setup import build_setup
from islands.inner import make_inner_optimizer
from islands.island import Island
from islands.mesh import batch_sharding, build_mesh, replicated

PyTree = Any


class _Clock:
    """Wall and process-CPU seconds of a block: CPU time is what other jobs on a shared machine disturb least."""

    def __enter__(self) -> _Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def _bare_loop(cfg: RunConfig, loss_fn: Any, params: PyTree, stream: Any) -> Any:
    """The plainest jitted optax loop on the island's mesh; returns run(steps) -> None."""
    tx = make_inner_optimizer(cfg.inner, cfg.total_inner_steps)
    mesh = build_mesh(cfg.islands.devices)
    rep, bsh = replicated(mesh), batch_sharding(mesh)

    def step(params: PyTree, opt_state: PyTree, batch: jax.Array) -> tuple[PyTree, PyTree, jax.Array]:
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch[0])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(step, donate_argnums=(0, 1))
    state = [jax.device_put(params, rep, may_alias=False)]
    state.append(jax.device_put(tx.init(state[0]), rep))

    def run(steps: int) -> None:
        p, o = state
        losses = []
        for _ in range(steps):
            p, o, loss = jitted(p, o, jax.device_put(stream.next()[None], bsh))
            losses.append(loss)
        jax.block_until_ready(losses)
        state[:] = [p, o]

    run(1)  # compile outside the timing
    return run


def run_overhead_bench(cfg: RunConfig, steps: int = 50, repeats: int = 5) -> dict[str, Any]:
    """Time `repeats` ABBA pairs of `steps` inner steps, island against bare loop; medians of the ratios."""
    if steps < 1 or repeats < 1:
        raise BenchError(f"bench overhead: --steps and --repeats must be >= 1 (got {steps}, {repeats})")
    name = cfg.islands.island_names[0]
    setup = build_setup(cfg, islands=[name])  # one island's data: what one island trains on
    stream = setup.streams[name]
    tx = make_inner_optimizer(cfg.inner, cfg.total_inner_steps)
    island = Island("bench", setup.model, tx, stream, n_devices=cfg.islands.devices, microbatch=0)
    island.start(setup.init_params)
    island.train(1)  # compile outside the timing
    bare = _bare_loop(cfg, setup.model.loss, setup.init_params, stream)
    tokens = steps * cfg.train.batch_size * cfg.model.seq_len
    wall_ratios, cpu_ratios, bare_tps, island_tps = [], [], [], []
    for i in range(repeats):
        # ABBA order: drift in the machine's load over a pair hits both loops alike.
        order = ("bare", "island") if i % 2 == 0 else ("island", "bare")
        clocks = {}
        for which in order:
            with _Clock() as clock:
                bare(steps) if which == "bare" else island.train(steps)
            clocks[which] = clock
        wall_ratios.append(clocks["bare"].wall / clocks["island"].wall)
        cpu_ratios.append(clocks["bare"].cpu / clocks["island"].cpu)
        bare_tps.append(tokens / clocks["bare"].wall)
        island_tps.append(tokens / clocks["island"].wall)
    return {
        "bench": "overhead",
        "model_params": setup.n_params,
        "devices": cfg.islands.devices,
        "steps_per_run": steps,
        "repeats": repeats,
        "bare_tokens_per_s_median": round(statistics.median(bare_tps), 1),
        "island_tokens_per_s_median": round(statistics.median(island_tps), 1),
        "throughput_ratio_wall": round(statistics.median(wall_ratios), 4),
        "throughput_ratio_cpu": round(statistics.median(cpu_ratios), 4),
        "wall_ratio_per_pair": [round(r, 4) for r in wall_ratios],
        "cpu_ratio_per_pair": [round(r, 4) for r in cpu_ratios],
        "load_average_1m": round(os.getloadavg()[0], 2),
        "target": ">= 0.95 (island throughput / bare throughput)",
    }
