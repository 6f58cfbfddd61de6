"""`diloco bench overhead`: an island's inner-step throughput against a bare jitted optax loop.

Both loops train the same model on the same mesh with the same optimizer and the same host batches; the bare
loop is the textbook `jit(value_and_grad -> tx.update -> apply_updates)` with donation. The runs alternate
(bare, island, bare, island, ...) so that noise from the shared machine hits both alike, and the ratio of
median throughputs is reported. Target: island >= 95% of bare.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import numpy as np
import optax

from diloco.config import RunConfig
from diloco.simulate import build_setup
from islands.inner import make_inner_optimizer
from islands.island import Island
from islands.mesh import batch_sharding, build_mesh, replicated

PyTree = Any


def _bare_loop(cfg: RunConfig, loss_fn: Any, params: PyTree, stream: Any, steps: int) -> float:
    """Seconds for `steps` steps of the plainest jitted optax loop on the island's mesh."""
    tx = make_inner_optimizer(cfg.inner, cfg.total_inner_steps)
    mesh = build_mesh(cfg.islands.devices)
    rep, bsh = replicated(mesh), batch_sharding(mesh)

    @jax.jit
    def step(params: PyTree, opt_state: PyTree, batch: jax.Array) -> tuple[PyTree, PyTree, jax.Array]:
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch[0])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    p = jax.device_put(params, rep, may_alias=False)
    o = jax.device_put(tx.init(p), rep)
    p, o, loss = step(p, o, jax.device_put(stream.next()[None], bsh))  # compile outside the timing
    jax.block_until_ready(loss)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        p, o, loss = step(p, o, jax.device_put(stream.next()[None], bsh))
        losses.append(loss)
    jax.block_until_ready(losses)
    return time.perf_counter() - t0


def run_overhead_bench(cfg: RunConfig, steps: int = 50, repeats: int = 5) -> dict[str, Any]:
    setup = build_setup(cfg)
    stream = setup.streams[0]
    tx = make_inner_optimizer(cfg.inner, cfg.total_inner_steps)
    island = Island("bench", setup.model, tx, stream, n_devices=cfg.islands.devices, microbatch=0)
    island.start(setup.init_params)
    island.train(1)  # compile outside the timing
    tokens = steps * cfg.train.batch_size * cfg.model.seq_len
    bare_tps, island_tps, ratios = [], [], []
    for _ in range(repeats):
        b = tokens / _bare_loop(cfg, setup.model.loss, setup.init_params, stream, steps)
        i = tokens / island.train(steps).seconds
        bare_tps.append(b)
        island_tps.append(i)
        ratios.append(i / b)
    return {
        "bench": "overhead",
        "model_params": setup.n_params,
        "devices": cfg.islands.devices,
        "steps_per_run": steps,
        "repeats": repeats,
        "bare_tokens_per_s_median": round(statistics.median(bare_tps), 1),
        "island_tokens_per_s_median": round(statistics.median(island_tps), 1),
        "ratio_of_medians": round(statistics.median(island_tps) / statistics.median(bare_tps), 4),
        "ratio_per_pair": [round(r, 4) for r in ratios],
        "median_pair_ratio": round(float(np.median(ratios)), 4),
        "step_ms_island_median": round(
            1000 * steps * cfg.train.batch_size * cfg.model.seq_len / statistics.median(island_tps) / steps, 3
        ),
    }
