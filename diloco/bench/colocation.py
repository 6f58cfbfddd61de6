"""`diloco bench colocation`: how fast islands that share a host step, against their fair share of its cores.

One island process alone gives the lone inner-step time t1. Then N island processes train at once, in three ways:
  default   as `launch` starts them (XLA's own thread pool in each: as many threads as the host has cores)
  1thread   XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 in each
  pinned    each process pinned to its share of the cores (os.sched_setaffinity; round-robin when N > cores)
The fair share is t1 · max(1, N / cores): 3 islands on 2 cores should each step in 1.5 t1 (if a lone island keeps
every core busy; one that does not can do better). Reported: each variant's slowest island against that share.
Each process trains `--warmup` steps (compile), then `--steps` timed steps on its own shard (the same
`Island.train` as every driver), one step per call, and prints its median step time.

Run: ``diloco bench colocation CONFIG [--islands 3] [--steps 20] [key=value ...]`` (JSON on stdout).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from diloco.bench.errors import BenchError
from diloco.procs import devices_env

ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
VARIANTS = ("default", "1thread", "pinned")


def _child(config: str, overrides: Sequence[str], island: int, warmup: int, steps: int) -> None:
    """In a child process: train one island and print its median step seconds (JSON)."""
    from diloco.config import load_config
    from diloco.setup import build_setup, make_island

    cfg = load_config(config, list(overrides))
    name = cfg.islands.island_names[island % cfg.islands.count]
    setup = build_setup(cfg, islands=[name])
    isl = make_island(cfg, name, setup.model, setup.streams[name], n_devices=1)
    isl.start(setup.init_params)
    isl.train(warmup)
    times = []
    for _ in range(steps):
        times.append(isl.train(1).seconds)
    print(json.dumps({"median_step_s": statistics.median(times), "cpus": sorted(os.sched_getaffinity(0))}))


def _run(config: str, overrides: Sequence[str], n: int, variant: str, warmup: int, steps: int) -> list[float]:
    cores = sorted(os.sched_getaffinity(0))
    procs = []
    for i in range(n):
        flags = ONE_THREAD if variant == "1thread" else ""
        env = {**os.environ, **devices_env(1, flags), "JAX_PLATFORMS": "cpu"}
        argv = [sys.executable, "-m", "diloco.bench.colocation", config, str(i), str(warmup), str(steps), *overrides]
        share = {cores[i % len(cores)]} if variant == "pinned" else None
        preexec = (lambda cpus=share: os.sched_setaffinity(0, cpus)) if share else None
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=preexec))  # fmt: skip
    medians = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise BenchError(f"bench colocation: an island process failed: {err.strip().splitlines()[-1:]}")
        medians.append(json.loads(out.strip().splitlines()[-1])["median_step_s"])
    return medians


def run_colocation_bench(
    config: str, overrides: Sequence[str], islands: int = 3, steps: int = 20, warmup: int = 3
) -> dict[str, Any]:
    if islands < 2 or steps < 3:
        raise BenchError(f"bench colocation: --islands must be >= 2 and --steps >= 3 (got {islands}, {steps})")
    cores = len(os.sched_getaffinity(0))
    t0 = time.monotonic()
    lone = _run(config, overrides, 1, "default", warmup, steps)[0]
    fair = lone * max(1.0, islands / cores)
    results: dict[str, Any] = {}
    for variant in VARIANTS:
        medians = _run(config, overrides, islands, variant, warmup, steps)
        worst = max(medians)
        results[variant] = {"median_step_s": [round(m, 4) for m in medians], "worst_over_fair": round(worst / fair, 3)}
    return {
        "bench": "colocation", "cores": cores, "islands": islands, "steps": steps,
        "lone_step_s": round(lone, 4), "fair_share_step_s": round(fair, 4), "variants": results,
        "wall_s": round(time.monotonic() - t0, 1),
    }  # fmt: skip


if __name__ == "__main__":
    _config, _island, _warmup, _steps, *_overrides = sys.argv[1:]
    _child(_config, _overrides, int(_island), int(_warmup), int(_steps))
