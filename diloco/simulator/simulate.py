"""`diloco simulate`: every island and the coordinator's round logic in one process.

The same `Island` steps (islands/island.py) and `GlobalRun` (diloco/run/global_run.py) that the multi-process system
runs are driven here by direct calls (`Lockstep`), so `simulate` is the fast, deterministic reference for `launch`:
on CPU with the same config both end with the same parameter digest. With `[stream]` set it runs Streaming DiLoCo
(fragments synced in turn, merged τ steps later), which the multi-process system does not do yet.

`train.mode = "sync"` runs the classic data-parallel baseline instead: one model and one AdamW on the union of the
islands' batches at every step, i.e. on exactly the tokens the islands see, so the two modes compare like for like.
`train.mode = "async"` runs asynchronous DiLoCo on a virtual clock (diloco/simulator/async_sim.py).

`train.vectorize = true` runs each run of inner steps of all the islands as one program (islands/vectorized.py)
instead of one island after another; everything between two runs (pushes, commits, merges, checkpoints) is the same.
It agrees with the sequential path to float rounding, not bit for bit (tests/test_vectorized.py).

Resume: after every `train.checkpoint_every` rounds the global state and every island's state are checkpointed;
running the same command with the same --run-dir continues from the newest round that all of them saved and, on
CPU with the same seed, ends with bit-identical parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from diloco.config import ConfigError, RunConfig, StreamConfig
from diloco.ops.progress import Progress
from diloco.run.checkpoint import latest_common_step, restore_state, save_state
from diloco.run.global_run import GlobalRun, checkpoint_due
from diloco.run.memory_plan import check_process
from diloco.run.rounds import Commit, OuterLoop
from diloco.run.rundir import RunDir
from diloco.run.setup import Evaluator, Setup, build_setup, make_island
from diloco.run.summary import Totals, summary
from diloco.run.warm_start import check_fresh, initial_inner_state, initial_params
from diloco.simulator.async_sim import run_async
from diloco.simulator.local_islands import finish, island_stores, save_islands, start_islands
from diloco.simulator.scripted_roster import ScriptedRoster
from islands.chunks import ChunkStream, Span
from islands.island import Batches, InnerRun, Island, PolicyBatches, RoundPush, empty_batch
from islands.mesh import accumulation_steps, build_mesh, data_width
from islands.vectorized import IslandStack
from outer_optimizer.fragments import merging_fragment, next_event, syncing_fragment
from pytrees.digest import tree_digest
from pytrees.naming import PyTree


class UnionStream:
    """The sync baseline's batches (an `islands.island.Batches`): batch k is every island's batch k, concatenated (a
    post-training workload's: leaf by leaf; rl's drawn by each island's stream with the one model's θ)."""

    def __init__(self, streams: list[Batches]) -> None:
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

    def next(self) -> PyTree:
        return _concatenated([s.next() for s in self.streams])

    def empty(self) -> PyTree:
        return empty_batch(self.streams[0])


class PolicyUnion(UnionStream):
    """The union of streams that draw with the policy (rl, `islands.island.PolicyBatches`): each with the one θ."""

    def next_for(self, params: PyTree) -> PyTree:
        return _concatenated([s.next_for(params) for s in self.streams])  # type: ignore[attr-defined]


def union_stream(streams: list[Batches]) -> UnionStream:
    """The sync baseline's stream over the islands' streams."""
    return PolicyUnion(streams) if isinstance(streams[0], PolicyBatches) else UnionStream(streams)


def _concatenated(batches: list[PyTree]) -> PyTree:
    return jax.tree.map(lambda *rows: np.concatenate(rows, axis=0), *batches)


def run_simulation(cfg: RunConfig, run_dir: Path, show_progress: bool = True) -> dict[str, Any]:
    """Train per `cfg` in one process; write the run directory; return summary.json's contents."""
    if cfg.roster.events and (run_dir / "config.toml").exists():
        raise ConfigError(
            f"roster.events: simulate replays the script from round 0, and '{run_dir}' holds a run already: give a "
            "new --run-dir"
        )
    setup = build_setup(cfg)
    # Device and batch problems are the user's: report them before any run directory is created.
    mesh = build_mesh(cfg.islands.devices, tensor=cfg.islands.tensor)
    accumulation_steps(cfg.train.batch_size, cfg.train.microbatch, data_width(mesh))
    check_fresh(cfg, run_dir)
    rd = RunDir(run_dir, cfg)
    try:
        run = {"sync": _run_sync, "async": run_async}.get(cfg.train.mode, _run_diloco)
        result = run(cfg, setup, rd, show_progress)
        rd.log_memory_peak()
        rd.write_summary(result)
        return result
    finally:
        rd.close()


def _run_diloco(cfg: RunConfig, setup: Setup, rd: RunDir, show_progress: bool) -> dict[str, Any]:
    names = list(cfg.islands.island_names)
    vectorize = cfg.train.vectorize  # then IslandStack compiles and checks its own program, not each island's step
    islands = [make_island(cfg, n, setup.model_of(n), setup.streams[n], check_memory=not vectorize) for n in names]
    world = GlobalRun(cfg, rd, setup, durable=True)  # one save at a time: islands/memory.py
    check_process(cfg, setup, islands, world.evaluate)  # all of it, before any island's state exists
    roster = ScriptedRoster(cfg, rd, world, islands, start_islands(cfg, rd, world, islands))
    totals = world.totals
    H = cfg.train.inner_steps
    lockstep = Lockstep(
        islands,
        world.loop,
        H,
        cfg.stream,
        step=world.loop.round * H,
        budget_s=cfg.train.round_seconds,
        vectorize=vectorize,
        lease=roster.lease if world.chunks is not None else None,  # made by `open_round`, in launch's order
    )
    progress = Progress(cfg.train.rounds, f"{cfg.run.name} diloco x{len(names)}", show_progress)
    t_sync = time.monotonic()

    def close(pushes: dict[str, RoundPush]) -> Commit:
        nonlocal t_sync
        for name, push in pushes.items():
            rd.log_inner(
                world.loop.round, name, push.run.first_step, push.run.losses, cfg.train.log_every, push.run.figures
            )
            totals.tokens += push.run.tokens
            totals.bytes_up += push.sent.payload_nbytes
            totals.compute_s += push.run.seconds
        seconds, t_sync = time.monotonic() - t_sync, time.monotonic()
        # The islands take turns here (or, vectorized, step together): a sync's wall time is every island's.
        totals.island_wall_s += seconds
        losses = [float(push.run.losses[-1]) for push in pushes.values()]
        if world.chunks is not None:  # what each island read, as its push would say (a refusal here is a bug)
            for island in lockstep.islands:
                if isinstance(island.stream, ChunkStream):
                    world.chunks.record(island.name, world.loop.sync, island.stream.claim())
        commit = world.close_round(losses=losses, seconds=seconds, deliveries=len(pushes))
        if world.loop.fragment == 0:
            progress.update(world.loop.round, float(np.mean(losses)), totals.final_eval_loss, commit.tokens / seconds)
        return commit

    try:
        while not world.done:
            if lockstep.step % H == 0 and roster.open_round(world.loop.round):
                lockstep.seat(roster.training)
            if lockstep.advance(close) and roster.stores and checkpoint_due(cfg, world.loop.round):
                save_islands(roster.saved(), roster.training, world.loop.round)
    finally:
        finish(world, list(roster.stores.values()), progress)
    return world.summary()


class Lockstep:
    """The islands of one process moving through (Streaming) DiLoCo's events together: `simulate`'s schedule.

    Each `advance` trains every island up to the next event of outer_optimizer/fragments.py: a fragment's sync
    (every island pushes Δ_p, `close` commits it) and/or the merge of a fragment committed τ steps earlier. Without
    streaming (P = 1, τ = 0) that is H steps, a push of all of θ, the commit, and θ_{r+1} taken as it is.

    With `vectorize` the steps up to the event are one program of every island (islands/vectorized.py), which hands
    each island its new state and its own InnerRun back: the rest of `advance` does not know the difference.
    """

    def __init__(
        self,
        islands: list[Island],
        loop: OuterLoop,
        inner_steps: int,
        stream: StreamConfig,
        step: int = 0,
        budget_s: float = 0.0,
        vectorize: bool = False,
        lease: Callable[[str, int], list[Span]] | None = None,
    ) -> None:
        """`lease(island, sequences)` (data.sampling = "chunks"): the spans an island reads next, asked at each
        round's start for the islands whose stream is a `ChunkStream` (diloco/run/chunk_ledger.py)."""
        self.islands, self.loop = islands, loop
        self.lease = lease
        self.H, self.P = inner_steps, stream.fragments
        self.tau, self.alpha = stream.overlap_steps, stream.merge_alpha
        self.step = step
        """Inner steps of the schedule so far (rounds are checkpointed at their ends, so a resume starts at r·H)."""
        self.budget_s = budget_s
        """train.round_seconds: each island trains what fits this many seconds of its own steps, at most H (whole
        rounds only, so the schedule's `step` then counts rounds of H, not each island's own steps)."""
        if vectorize and budget_s > 0:
            raise ValueError("a time budget needs each island's own step time: it cannot be vectorized")
        self._stack = IslandStack(islands) if vectorize else None
        self._since_push: dict[str, list[InnerRun]] = {island.name: [] for island in islands}

    def seat(self, islands: list[Island]) -> None:
        """The islands that train from this round on, in lease order (a roster script's change, between rounds)."""
        self.islands = list(islands)
        self._since_push = {island.name: self._since_push.get(island.name, []) for island in self.islands}

    def advance(self, close: Callable[[dict[str, RoundPush]], Commit]) -> bool:
        """Train to the next event and handle it; True when a round ended here (its last fragment committed)."""
        target = next_event(self.step, self.H, self.P, self.tau)
        if self.lease is not None and self.step % self.H == 0:
            for island in self.islands:
                if isinstance(island.stream, ChunkStream):
                    island.stream.begin(self.lease(island.name, self.H * island.stream.batch_size))
        for island, run in zip(self.islands, self._train(target - self.step), strict=True):
            self._since_push[island.name].append(run)
        self.step = target
        round_closed = False
        p = syncing_fragment(self.step, self.H, self.P)
        if p is not None:
            r, reference = self.loop.round, self.loop.fragment_params(p)
            pushes = {}
            for island in self.islands:
                push = island.encode_delta(InnerRun.joined(self._since_push[island.name]), reference)
                self._since_push[island.name] = []
                island.keep_residual(push)  # in one process every push is delivered
                self.loop.submit(island.name, r, push.sent.decoded, push.run.tokens, fragment=p)
                pushes[island.name] = push
            close(pushes)
            round_closed = self.loop.fragment == 0
        q = merging_fragment(self.step, self.H, self.P, self.tau)
        if q is not None:
            for island in self.islands:
                island.merge(self.loop.fragment_params(q), self.alpha)
        return round_closed

    def _train(self, n: int) -> list[InnerRun]:
        """n inner steps of every island (with a time budget, what fits it), one InnerRun per island in order."""
        if self._stack is not None:
            return self._stack.train(n)
        return [island.train_for(self.budget_s, n) for island in self.islands]


def _run_sync(cfg: RunConfig, setup: Setup, rd: RunDir, show_progress: bool) -> dict[str, Any]:
    """The data-parallel baseline: every step is one all-reduce over all islands (so rounds*H syncs)."""
    H = cfg.train.inner_steps
    streams = list(setup.streams.values())
    model = setup.model_of(cfg.islands.island_names[0])  # one workload: the config refuses mixed ones with sync
    island: Island = make_island(cfg, "sync", model, union_stream(streams))
    evaluate = Evaluator.of(cfg, setup)
    grad_bytes = setup.n_params * 4
    stores = island_stores(cfg, rd, ["sync"])
    step = latest_common_step(stores) if stores else None
    if step is not None:
        island.start(setup.init_params)
        assert island.state is not None
        state, meta = restore_state(stores[0], step, island.state)
        island.restore(state)
        totals = Totals.from_meta(meta["totals"])
        rd.truncate_after_round(totals.rounds)
        rd.log("resumed", round=totals.rounds, digest=tree_digest(state.params))
    else:  # afresh: θ_0 (and the inner state) may be a warm start's (diloco/run/warm_start.py)
        params = initial_params(cfg, setup.init_params, rd)
        island.start(params, initial_inner_state(cfg, island, params, rd))
        assert island.state is not None
        totals = Totals(islands_joined=1)
        loss, scores = evaluate.measure(island.state.params)
        totals.initial_eval_loss = totals.final_eval_loss = loss
        totals.initial_scores = totals.final_scores = scores or None
        rd.log("eval", step=0, eval_loss=loss, **({"scores": scores} if scores else {}))

    progress = Progress(cfg.train.rounds, f"{cfg.run.name} sync x{len(streams)}", show_progress)
    try:
        while totals.rounds < cfg.train.rounds:
            r, t_round = totals.rounds, time.monotonic()
            run = island.train(H)
            rd.log_inner(r, "sync", run.first_step, run.losses, cfg.train.log_every, run.figures)
            assert island.state is not None
            totals.rounds = r + 1
            totals.syncs += H
            totals.tokens += run.tokens
            totals.compute_s += run.seconds
            # A gradient all-reduce per step: each island sends its gradient and receives the mean.
            totals.bytes_up += grad_bytes * len(streams) * H
            totals.bytes_down += grad_bytes * len(streams) * H
            totals.final_eval_loss, scores = evaluate.measure(island.state.params)
            totals.final_scores = scores or None
            seconds = time.monotonic() - t_round
            totals.island_wall_s += seconds
            rd.log(
                "round",
                round=r,
                loss=float(run.losses[-1]),
                eval_loss=totals.final_eval_loss,
                **({"scores": scores} if scores else {}),
                tokens=totals.tokens,
                bytes_up=totals.bytes_up,
                bytes_down=totals.bytes_down,
                seconds=round(seconds, 4),
            )
            progress.update(r + 1, float(run.losses[-1]), totals.final_eval_loss, run.tokens / seconds)
            if stores and checkpoint_due(cfg, r + 1):
                save_state(stores[0], r + 1, island.state, {"totals": totals.to_meta()})
    finally:
        progress.close()
        for store in stores:
            store.close()
    return summary(
        cfg, totals, wall_s=rd.elapsed(), param_count=setup.n_params, params_digest=tree_digest(island.state.params)
    )
