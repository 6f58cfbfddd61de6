"""`diloco bench simulator`: `simulate` with its islands stepped in turn against stepped as one program, side by side.

Two `simulate` runs of one config, M islands, N rounds, identical but for train.vectorize:
  sequential   train.vectorize = false: each island's inner steps in turn (the reference path)
  vectorized   train.vectorize = true: the inner steps of all islands as one program (islands/vectorized.py)

Reported (JSON), for each run and as sequential / vectorized ratios (> 1: vectorized is faster):
  wall_s     the whole run (summary.json's wall_s): setup, compilation, every round, evaluation
  cpu_s      this process's CPU seconds in the run: on a machine shared with other work, wall time also measures the
             others, CPU time much less so (both are given, with the 1-minute load average before and after)
  inner_s    the seconds spent in inner steps, summed over the islands (the run's Totals.compute_s, from its last
             checkpoint): compilation left out by both paths, so what every further step costs, also per island step
             (ms_per_island_step); the vectorized path's share of it includes stacking and unstacking the states
and how far the vectorized run is from the sequential one: the largest |difference| of the final eval loss, of the
eval loss at every commit, and of any final parameter (the last checkpoint's θ, checkpointed only at the end), and
whether the parameter digests are equal (they need not be: vmap may sum in another order).

The runs are timed, so each must start afresh: a --run-dir that already holds one is refused, and JAX's in-memory
caches are cleared before each run, so the second does not reuse what the first compiled (the evaluation, the outer
step, the model's init). A persistent compilation cache (JAX_COMPILATION_CACHE_DIR) would still serve both.

Run: ``diloco bench simulator CONFIG [--islands 4] [--rounds N] [--run-dir DIR] [key=value ...]``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from diloco.bench.convergence import config_variant
from diloco.bench.errors import BenchError
from diloco.config import RunConfig, cannot_vectorize
from diloco.run.rundir import read_events
from diloco.run.setup import build_setup
from diloco.run.warm_start import newest_step, read_item
from diloco.simulator.simulate import run_simulation
from pytrees.naming import flatten_named

PATHS = ("sequential", "vectorized")


def final_params(cfg: RunConfig, run_dir: Path) -> dict[str, np.ndarray]:
    """θ of a finished run's newest coordinator checkpoint (its last round's: `checkpoint_due` always saves it)."""
    step_dir = newest_step([run_dir / "checkpoints" / "coordinator"])
    if step_dir is None:
        raise BenchError(f"bench simulator: {run_dir} holds no coordinator checkpoint")
    return flatten_named(read_item(step_dir, "params", build_setup(cfg).init_params, "parameters"))


def commit_evals(run_dir: Path) -> list[tuple[int, float]]:
    """(round, eval loss) of every commit (`round` and, with streaming, `sync` events), in order."""
    events = read_events(run_dir / "metrics.jsonl")
    return [(e["round"], e["eval_loss"]) for e in events if e["event"] in ("sync", "round")]


def inner_seconds(run_dir: Path) -> float:
    """Seconds in inner steps over all islands: Totals.compute_s as the run's last coordinator checkpoint holds it
    (diloco/run/checkpoint.py saves the totals in the JSON item `meta`, which orbax writes as meta/metadata)."""
    step_dir = newest_step([run_dir / "checkpoints" / "coordinator"])
    if step_dir is None:
        raise BenchError(f"bench simulator: {run_dir} holds no coordinator checkpoint")
    return float(json.loads((step_dir / "meta" / "metadata").read_text())["totals"]["compute_s"])


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def run_simulator_bench(cfg: RunConfig, run_dir: Path, islands: int = 4, rounds: int | None = None) -> dict[str, Any]:
    """The two runs, their times and how far apart their results are (module docstring)."""
    rounds = cfg.train.rounds if rounds is None else rounds
    if islands < 1 or rounds < 1:
        raise BenchError(f"bench simulator: --islands and --rounds must be >= 1 (got {islands} and {rounds})")
    for key in PATHS:
        if (run_dir / key).exists():
            raise BenchError(f"bench simulator: {run_dir / key} exists; the runs are timed, give a new --run-dir")
    names = list(cfg.islands.names[:islands]) if len(cfg.islands.names) >= islands else []
    # Only the last round is checkpointed: its θ is compared, and no other save is timed.
    train = {"mode": "diloco", "rounds": rounds, "checkpoint_every": rounds}
    sequential = config_variant(cfg, islands={"count": islands, "names": names}, train={**train, "vectorize": False})
    why = cannot_vectorize(sequential)
    if why is not None:
        raise BenchError(f"bench simulator: this config cannot be vectorized: {why}")
    runs = {"sequential": sequential, "vectorized": config_variant(sequential, train={"vectorize": True})}

    results, cpu_s, load = {}, {}, [round(os.getloadavg()[0], 2)]
    for key, variant in runs.items():
        jax.clear_caches()
        t0 = time.process_time()
        results[key] = run_simulation(variant, run_dir / key, show_progress=False)
        cpu_s[key] = round(time.process_time() - t0, 3)
        load.append(round(os.getloadavg()[0], 2))
    wall_s = {key: r["wall_s"] for key, r in results.items()}
    inner_s = {key: inner_seconds(run_dir / key) for key in runs}
    steps = rounds * cfg.train.inner_steps * islands
    evals = {key: commit_evals(run_dir / key) for key in runs}
    assert [r for r, _ in evals["sequential"]] == [r for r, _ in evals["vectorized"]]
    params = {key: final_params(variant, run_dir / key) for key, variant in runs.items()}
    seq, vec = (results[key] for key in PATHS)
    eval_gap = max(abs(a - b) for (_, a), (_, b) in zip(evals["sequential"], evals["vectorized"], strict=True))
    params_gap = max(float(np.max(np.abs(params["vectorized"][k] - v))) for k, v in params["sequential"].items())
    return {
        "bench": "simulator",
        "islands": islands,
        "rounds": rounds,
        "H": cfg.train.inner_steps,
        "stream": {"fragments": cfg.stream.fragments, "overlap_steps": cfg.stream.overlap_steps},
        "param_count": seq["param_count"],
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "inner_s": {key: round(s, 3) for key, s in inner_s.items()},
        "ms_per_island_step": {key: round(1e3 * s / steps, 3) for key, s in inner_s.items()},
        "speedup": {
            "wall": _ratio(wall_s["sequential"], wall_s["vectorized"]),
            "cpu": _ratio(cpu_s["sequential"], cpu_s["vectorized"]),
            "inner": _ratio(inner_s["sequential"], inner_s["vectorized"]),
        },
        "final_eval_loss": {key: r["final_eval_loss"] for key, r in results.items()},
        "max_abs_diff": {
            "final_eval_loss": abs(vec["final_eval_loss"] - seq["final_eval_loss"]),
            "eval_loss": eval_gap,
            "params": params_gap,
        },
        "params_digest_equal": seq["params_digest"] == vec["params_digest"],
        "load_avg_1m": load,
        "run_dirs": {key: str(run_dir / key) for key in runs},
    }
