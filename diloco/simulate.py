"""`diloco simulate`: every island and the coordinator's round logic in one process.

The same `Island` (islands/) and `OuterLoop` (diloco/rounds.py) that the multi-process system runs are driven
here by direct calls, so `simulate` is the fast, deterministic reference for `launch`. `train.mode = "sync"`
runs the classic data-parallel baseline instead: one model and one AdamW on the union of the islands' batches
at every step, i.e. on exactly the tokens the islands see, so the two modes compare like for like.

Resume: after every `train.checkpoint_every` rounds the coordinator's state and every island's inner state and
data cursor are checkpointed with orbax; running the same command with the same --run-dir continues from the
newest round that all of them saved and, on CPU with the same seed, ends with bit-identical parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from diloco.checkpoint import CheckpointStore, latest_common_step
from diloco.config import RunConfig
from diloco.progress import Progress
from diloco.rounds import GlobalState, OuterLoop
from diloco.rundir import RunDir
from islands.compress import compress_tree, is_lossless
from islands.data import BatchStream, eval_batches, load_sources
from islands.inner import make_eval_fn, make_inner_optimizer
from islands.island import Island
from islands.mesh import accumulation_steps, build_mesh, replicated
from islands.models import Model, build_model, param_count
from outer_optimizer import pseudo_gradient
from transport.codecs import CodecSpec, flatten_named
from transport.digest import tree_digest

PyTree = Any


@dataclass
class Setup:
    """What every mode needs: the model, the islands' data streams, the evaluation batches."""

    model: Model
    streams: list[BatchStream]
    eval_stack: np.ndarray
    init_params: PyTree
    n_params: int


def build_setup(cfg: RunConfig) -> Setup:
    names = cfg.islands.island_names
    model = build_model(cfg.model)
    shards, val = load_sources(cfg.data, len(names), cfg.model.vocab_size, cfg.run.seed, cfg.model.seq_len)
    streams = [
        BatchStream(tokens, cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed, stream_id=i)
        for i, tokens in enumerate(shards)
    ]
    stack = np.stack(eval_batches(val, max(cfg.train.eval_batches, 1), cfg.train.batch_size, cfg.model.seq_len))
    params = model.init(jax.random.key(cfg.run.seed))
    return Setup(model, streams, stack, params, param_count(params))


class UnionStream:
    """The sync baseline's batches: batch k is the concatenation of every island's batch k."""

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


class Evaluator:
    """Loss of a parameter set on the fixed validation batches, replicated on the first device."""

    def __init__(self, model: Model, eval_stack: np.ndarray) -> None:
        mesh = build_mesh(1)
        self._fn = make_eval_fn(model.loss, mesh)
        self._batches = jax.device_put(eval_stack, replicated(mesh))
        self._sharding = replicated(mesh)

    def __call__(self, params: PyTree) -> float:
        return float(self._fn(jax.device_put(params, self._sharding), self._batches))


def _island(cfg: RunConfig, name: str, model: Model, stream: BatchStream | UnionStream) -> Island:
    tx = make_inner_optimizer(cfg.inner, cfg.total_inner_steps)
    return Island(
        name,
        model,
        tx,
        stream,  # type: ignore[arg-type]
        n_devices=cfg.islands.devices,
        microbatch=cfg.train.microbatch,
        shard_params=cfg.islands.shard_params,
    )


def _log_inner(rd: RunDir, cfg: RunConfig, round_: int, island: str, losses: np.ndarray, first_step: int) -> None:
    for i in range(cfg.train.log_every - 1, len(losses), cfg.train.log_every):
        rd.log("inner", round=round_, island=island, step=first_step + i + 1, loss=float(losses[i]))


def run_simulation(cfg: RunConfig, run_dir: Path, show_progress: bool = True) -> dict[str, Any]:
    """Train per `cfg` in one process; write the run directory; return summary.json's contents."""
    setup = build_setup(cfg)
    # Device and batch problems are the user's: report them before any run directory is created.
    accumulation_steps(cfg.train.batch_size, cfg.train.microbatch, build_mesh(cfg.islands.devices).size)
    rd = RunDir(run_dir, cfg)
    try:
        if cfg.train.mode == "sync":
            return _run_sync(cfg, setup, rd, show_progress)
        return _run_diloco(cfg, setup, rd, show_progress)
    finally:
        rd.close()


def _fresh_totals(setup: Setup) -> dict[str, Any]:
    """Run totals of either mode; stored in checkpoint metadata so a resumed run keeps counting."""
    return {
        "rounds": 0, "syncs": 0, "tokens": 0, "bytes_up": 0, "bytes_down": 0, "inner_s": 0.0,
        "initial_eval_loss": None, "param_count": setup.n_params,
    }  # fmt: skip


def _summary(cfg: RunConfig, rd: RunDir, totals: dict[str, Any], final_eval: float, digest: str) -> dict:
    wall = rd.elapsed()
    return {
        "mode": cfg.train.mode,
        "rounds": totals["rounds"],
        "inner_steps_per_island": totals["rounds"] * cfg.train.inner_steps,
        "syncs": totals["syncs"],
        "final_eval_loss": final_eval,
        "initial_eval_loss": totals["initial_eval_loss"],
        "tokens": totals["tokens"],
        "bytes_up": totals["bytes_up"],
        "bytes_down": totals["bytes_down"],
        "wall_s": round(wall, 3),
        # In one process the islands take turns: the share of wall time spent inside inner steps.
        "compute_utilization": round(totals["inner_s"] / wall, 4) if wall > 0 else 0.0,
        "islands_lost": 0,
        "islands_joined": len(cfg.islands.island_names) if cfg.train.mode == "diloco" else 1,
        "param_count": totals["param_count"],
        "params_digest": digest,
    }


def _run_diloco(cfg: RunConfig, setup: Setup, rd: RunDir, show_progress: bool) -> dict[str, Any]:
    names = cfg.islands.island_names
    H = cfg.train.inner_steps
    outer_tx = cfg.outer.build()
    loop = OuterLoop.fresh(setup.init_params, outer_tx, cfg.codec.spec("downlink"))
    uplink = cfg.codec.spec("uplink")
    islands = [_island(cfg, n, setup.model, s) for n, s in zip(names, setup.streams, strict=True)]
    for isl in islands:
        isl.start(loop.params)
    evaluate = Evaluator(setup.model, setup.eval_stack)
    totals = _fresh_totals(setup)

    stores = _stores(cfg, rd, ["coordinator", *names])
    restored = latest_common_step(stores) if stores else None
    if restored is not None:
        state, meta = stores[0].restore(restored, _global_like(loop, setup.init_params))
        loop.state = GlobalState(
            params=state["params"],
            outer_opt_state=state["outer"],
            down_residual=state.get("down_residual"),
            round=meta["round"],
        )
        totals.update(meta["totals"])
        for isl, store in zip(islands, stores[1:], strict=True):
            assert isl.state is not None
            saved, imeta = store.restore(restored, _island_like(isl, uplink))
            isl.start(loop.params, saved["inner"], step=imeta["step"], cursor=imeta["cursor"])
            isl.state = replace(isl.state, residual=saved.get("residual"))
        rd.truncate_after_round(loop.round)
        rd.log("resumed", round=loop.round, digest=tree_digest(loop.params))
    else:
        totals["initial_eval_loss"] = evaluate(loop.params)
        rd.log("eval", step=0, eval_loss=totals["initial_eval_loss"])
        for name in names:
            rd.log("island_joined", round=0, island=name)

    progress = Progress(cfg.train.rounds, f"{cfg.run.name} diloco x{len(names)}", show_progress)
    eval_loss = totals.get("final_eval_loss") or totals["initial_eval_loss"]
    try:
        while loop.round < cfg.train.rounds:
            r, t_round = loop.round, time.monotonic()
            last_losses = []
            for isl in islands:
                run = isl.train(H)
                assert isl.state is not None
                delta = pseudo_gradient(loop.params, isl.state.params)
                sent = compress_tree(jax.device_get(delta), isl.state.residual, uplink)
                isl.state = replace(isl.state, residual=sent.residual)
                loop.submit(isl.name, r, sent.decoded, run.tokens)
                totals["bytes_up"] += sent.nbytes
                _log_inner(rd, cfg, r, isl.name, run.losses, run.first_step)
                last_losses.append(float(run.losses[-1]))
                totals["tokens"] += run.tokens
                totals["inner_s"] += run.seconds
            commit = loop.commit()
            for isl in islands:
                isl.set_params(loop.params)
            totals["rounds"] = loop.round
            totals["syncs"] += 1
            totals["bytes_down"] += sum(t.nbytes for t in commit.encoded) * len(islands)
            eval_loss = evaluate(loop.params)
            totals["final_eval_loss"] = eval_loss
            seconds = time.monotonic() - t_round
            rd.log(
                "round", round=r, loss=float(np.mean(last_losses)), eval_loss=eval_loss, tokens=totals["tokens"],
                bytes_up=totals["bytes_up"], bytes_down=totals["bytes_down"], islands=list(commit.islands),
                digest=commit.digest, seconds=round(seconds, 4),
            )  # fmt: skip
            progress.update(loop.round, float(np.mean(last_losses)), eval_loss, commit.tokens / seconds)
            if _due(cfg, loop.round):
                stores[0].save(loop.round, _global_saved(loop), {"round": loop.round, "totals": totals})
                for isl, store in zip(islands, stores[1:], strict=True):
                    assert isl.state is not None
                    saved = {"inner": isl.state.inner_opt_state}
                    if isl.state.residual is not None:
                        saved["residual"] = isl.state.residual
                    store.save(loop.round, saved, {"step": isl.state.step, "cursor": isl.state.data_cursor})
    finally:
        progress.close()
        for store in stores:
            store.close()
    summary = _summary(cfg, rd, totals, eval_loss, tree_digest(loop.params))
    rd.write_summary(summary)
    return summary


def _global_saved(loop: OuterLoop) -> dict[str, Any]:
    saved = {"params": loop.params, "outer": loop.state.outer_opt_state}
    if loop.state.down_residual is not None:
        saved["down_residual"] = loop.state.down_residual
    return saved


def _global_like(loop: OuterLoop, params: PyTree) -> dict[str, Any]:
    """The structure a coordinator checkpoint restores into (a lossy downlink also keeps its residual)."""
    like = {"params": loop.params, "outer": loop.state.outer_opt_state}
    if not is_lossless(loop.downlink):
        like["down_residual"] = {k: np.zeros_like(v) for k, v in flatten_named(params).items()}
    return like


def _island_like(isl: Island, uplink: CodecSpec) -> dict[str, Any]:
    assert isl.state is not None
    like = {"inner": isl.state.inner_opt_state}
    if not is_lossless(uplink):
        like["residual"] = {k: np.zeros_like(v) for k, v in flatten_named(isl.state.params).items()}
    return like


def _due(cfg: RunConfig, completed_rounds: int) -> bool:
    every = cfg.train.checkpoint_every
    return every > 0 and (completed_rounds % every == 0 or completed_rounds == cfg.train.rounds)


def _stores(cfg: RunConfig, rd: RunDir, owners: list[str]) -> list[CheckpointStore]:
    if cfg.train.checkpoint_every == 0:
        return []
    return [CheckpointStore(rd.checkpoints / owner) for owner in owners]


def _run_sync(cfg: RunConfig, setup: Setup, rd: RunDir, show_progress: bool) -> dict[str, Any]:
    """The data-parallel baseline: every step is one all-reduce over all islands (so rounds*H syncs)."""
    H = cfg.train.inner_steps
    n_islands = len(setup.streams)
    island = _island(cfg, "sync", setup.model, UnionStream(setup.streams))
    island.start(setup.init_params)
    evaluate = Evaluator(setup.model, setup.eval_stack)
    grad_bytes = setup.n_params * 4
    totals = _fresh_totals(setup)
    stores = _stores(cfg, rd, ["sync"])
    restored = latest_common_step(stores) if stores else None
    if restored is not None:
        assert island.state is not None
        state, meta = stores[0].restore(
            restored, {"params": island.state.params, "inner": island.state.inner_opt_state}
        )
        island.start(state["params"], state["inner"], step=meta["step"], cursor=meta["cursor"])
        totals.update(meta["totals"])
        rd.truncate_after_round(totals["rounds"])
        rd.log("resumed", round=totals["rounds"], digest=tree_digest(state["params"]))
    else:
        totals["initial_eval_loss"] = evaluate(island.state.params)  # type: ignore[union-attr]
        rd.log("eval", step=0, eval_loss=totals["initial_eval_loss"])

    progress = Progress(cfg.train.rounds, f"{cfg.run.name} sync x{n_islands}", show_progress)
    eval_loss = totals.get("final_eval_loss") or totals["initial_eval_loss"]
    try:
        while totals["rounds"] < cfg.train.rounds:
            r, t_round = totals["rounds"], time.monotonic()
            run = island.train(H)
            _log_inner(rd, cfg, r, "sync", run.losses, run.first_step)
            assert island.state is not None
            totals["rounds"] = r + 1
            totals["syncs"] += H
            totals["tokens"] += run.tokens
            totals["inner_s"] += run.seconds
            # A gradient all-reduce per step: each island sends its gradient and receives the mean.
            totals["bytes_up"] += grad_bytes * n_islands * H
            totals["bytes_down"] += grad_bytes * n_islands * H
            eval_loss = evaluate(island.state.params)
            totals["final_eval_loss"] = eval_loss
            seconds = time.monotonic() - t_round
            rd.log(
                "round", round=r, loss=float(run.losses[-1]), eval_loss=eval_loss, tokens=totals["tokens"],
                bytes_up=totals["bytes_up"], bytes_down=totals["bytes_down"], seconds=round(seconds, 4),
            )  # fmt: skip
            progress.update(r + 1, float(run.losses[-1]), eval_loss, run.tokens / seconds)
            if _due(cfg, r + 1):
                stores[0].save(
                    r + 1,
                    {"params": island.state.params, "inner": island.state.inner_opt_state},
                    {"step": island.state.step, "cursor": island.state.data_cursor, "totals": totals},
                )
    finally:
        progress.close()
        for store in stores:
            store.close()
    assert island.state is not None
    summary = _summary(cfg, rd, totals, eval_loss, tree_digest(island.state.params))
    rd.write_summary(summary)
    return summary
