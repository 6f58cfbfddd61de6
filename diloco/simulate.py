"""`diloco simulate`: every island and the coordinator's round logic in one process.

The same `Island.train_round` (islands/island.py) and `GlobalRun` (diloco/global_run.py) that the multi-process
system runs are driven here by direct calls, so `simulate` is the fast, deterministic reference for `launch`: on
CPU with the same config both end with the same parameter digest. `train.mode = "sync"` runs the classic
data-parallel baseline instead: one model and one AdamW on the union of the islands' batches at every step, i.e.
on exactly the tokens the islands see, so the two modes compare like for like.

Resume: after every `train.checkpoint_every` rounds the global state and every island's state are checkpointed;
running the same command with the same --run-dir continues from the newest round that all of them saved and, on
CPU with the same seed, ends with bit-identical parameters.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from diloco.checkpoint import CheckpointStore, latest_common_step, restore_state, save_state
from diloco.config import RunConfig
from diloco.global_run import GlobalRun, checkpoint_due
from diloco.progress import Progress
from diloco.rundir import RunDir
from diloco.setup import Evaluator, Setup, build_setup, make_island
from diloco.summary import Totals, summary
from islands.data import BatchStream
from islands.island import Island
from islands.mesh import accumulation_steps, build_mesh
from transport.digest import tree_digest


class UnionStream:
    """The sync baseline's batches (an `islands.island.Batches`): batch k is every island's batch k, concatenated."""

    def __init__(self, streams: list[BatchStream]) -> None:
        self.streams = streams
        self.batch_size = sum(s.batch_size for s in streams)
        self.seq_len = streams[0].seq_len

    @property
    def cursor(self) -> int:
        return self.streams[0].cursor

    @cursor.setter
    def cursor(self, value: int) -> None:
        for s in self.streams:
            s.cursor = value

    def next(self) -> np.ndarray:
        return np.concatenate([s.next() for s in self.streams], axis=0)


def run_simulation(cfg: RunConfig, run_dir: Path, show_progress: bool = True) -> dict[str, Any]:
    """Train per `cfg` in one process; write the run directory; return summary.json's contents."""
    setup = build_setup(cfg)
    # Device and batch problems are the user's: report them before any run directory is created.
    accumulation_steps(cfg.train.batch_size, cfg.train.microbatch, build_mesh(cfg.islands.devices).size)
    rd = RunDir(run_dir, cfg)
    try:
        run = _run_sync if cfg.train.mode == "sync" else _run_diloco
        result = run(cfg, setup, rd, show_progress)
        rd.write_summary(result)
        return result
    finally:
        rd.close()


def _island_stores(cfg: RunConfig, rd: RunDir, names: list[str]) -> list[CheckpointStore]:
    return [CheckpointStore(rd.checkpoints / name) for name in names] if cfg.train.checkpoint_every else []


def _run_diloco(cfg: RunConfig, setup: Setup, rd: RunDir, show_progress: bool) -> dict[str, Any]:
    names = list(cfg.islands.island_names)
    world = GlobalRun(cfg, rd, setup, durable=False)
    islands = [make_island(cfg, name, setup.model, setup.streams[name]) for name in names]
    for island in islands:
        island.start(world.loop.params)
    stores = _island_stores(cfg, rd, names)
    step = latest_common_step([world.store, *stores]) if world.store is not None else None
    world.start(step)
    if step is not None:
        for island, store in zip(islands, stores, strict=True):
            assert island.state is not None
            island.restore(restore_state(store, step, island.state)[0])
    else:
        world.totals.islands_joined = len(names)
        for name in names:
            rd.log("island_joined", round=0, island=name)

    totals = world.totals
    progress = Progress(cfg.train.rounds, f"{cfg.run.name} diloco x{len(names)}", show_progress)
    try:
        while not world.done:
            r, t_round = world.loop.round, time.monotonic()
            last_losses = []
            for island in islands:
                push = island.train_round(world.loop.params, cfg.train.inner_steps)
                island.keep_residual(push)  # in one process every push is delivered
                world.loop.submit(island.name, r, push.sent.decoded, push.run.tokens)
                rd.log_inner(r, island.name, push.run.first_step, push.run.losses, cfg.train.log_every)
                last_losses.append(float(push.run.losses[-1]))
                totals.tokens += push.run.tokens
                totals.bytes_up += push.sent.payload_nbytes
                totals.compute_s += push.run.seconds
            seconds = time.monotonic() - t_round
            # The islands take turns here: a round's wall time is every island's wall time.
            totals.island_wall_s += seconds
            commit = world.close_round(losses=last_losses, seconds=seconds, deliveries=len(islands))
            for island in islands:
                island.set_params(world.loop.params)
            progress.update(world.loop.round, float(np.mean(last_losses)), totals.final_eval_loss,
                            commit.tokens / seconds)  # fmt: skip
            if stores and checkpoint_due(cfg, world.loop.round):
                for island, store in zip(islands, stores, strict=True):
                    save_state(store, world.loop.round, island.state, {})
    finally:
        progress.close()
        for store in stores:
            store.close()
        world.close()
    return world.summary()


def _run_sync(cfg: RunConfig, setup: Setup, rd: RunDir, show_progress: bool) -> dict[str, Any]:
    """The data-parallel baseline: every step is one all-reduce over all islands (so rounds*H syncs)."""
    H = cfg.train.inner_steps
    streams = list(setup.streams.values())
    island: Island = make_island(cfg, "sync", setup.model, UnionStream(streams))
    island.start(setup.init_params)
    evaluate = Evaluator(setup.model, setup.eval_stack)
    grad_bytes = setup.n_params * 4
    stores = _island_stores(cfg, rd, ["sync"])
    step = latest_common_step(stores) if stores else None
    assert island.state is not None
    if step is not None:
        state, meta = restore_state(stores[0], step, island.state)
        island.restore(state)
        totals = Totals.from_meta(meta["totals"])
        rd.truncate_after_round(totals.rounds)
        rd.log("resumed", round=totals.rounds, digest=tree_digest(state.params))
    else:
        totals = Totals(islands_joined=1)
        totals.initial_eval_loss = totals.final_eval_loss = evaluate(island.state.params)
        rd.log("eval", step=0, eval_loss=totals.initial_eval_loss)

    progress = Progress(cfg.train.rounds, f"{cfg.run.name} sync x{len(streams)}", show_progress)
    try:
        while totals.rounds < cfg.train.rounds:
            r, t_round = totals.rounds, time.monotonic()
            run = island.train(H)
            rd.log_inner(r, "sync", run.first_step, run.losses, cfg.train.log_every)
            assert island.state is not None
            totals.rounds = r + 1
            totals.syncs += H
            totals.tokens += run.tokens
            totals.compute_s += run.seconds
            # A gradient all-reduce per step: each island sends its gradient and receives the mean.
            totals.bytes_up += grad_bytes * len(streams) * H
            totals.bytes_down += grad_bytes * len(streams) * H
            totals.final_eval_loss = evaluate(island.state.params)
            seconds = time.monotonic() - t_round
            totals.island_wall_s += seconds
            rd.log(
                "round", round=r, loss=float(run.losses[-1]), eval_loss=totals.final_eval_loss, tokens=totals.tokens,
                bytes_up=totals.bytes_up, bytes_down=totals.bytes_down, seconds=round(seconds, 4),
            )  # fmt: skip
            progress.update(r + 1, float(run.losses[-1]), totals.final_eval_loss, run.tokens / seconds)
            if stores and checkpoint_due(cfg, r + 1):
                save_state(stores[0], r + 1, island.state, {"totals": totals.to_meta()})
    finally:
        progress.close()
        for store in stores:
            store.close()
    return summary(cfg, totals, wall_s=rd.elapsed(), param_count=setup.n_params,
                   params_digest=tree_digest(island.state.params))  # fmt: skip
