"""`diloco bench big`: a big model under `diloco launch` on this host, each process's peak memory against its plan.

The config's federation (configs/smollm2-135m.toml: a SmolLM2-135M-shaped Llama, 2 islands, int8 both ways) runs as
`launch` runs it: the coordinator and one process per island over real gRPC (`finished_run`,
diloco.harness.procs.Federation). Before it starts, the memory plan of each of those processes
(diloco/run/memory_plan.py `launch_plans`: an island alone; the coordinator with every island's push at a sync) is
measured from the config and XLA's compiled programs, and the run is refused in one line when their peaks together
do not fit what this host has free (`launch_refusal`), as a Qwen2.5-0.5B-shaped model's are on a 24 GiB host
(configs/qwen2.5-0.5b.toml).

Reported (JSON), per process: its peak resident memory (`memory_peak`, the VmHWM each process logs as it ends), the
plan's peak and their ratio, peak / plan (the issue asks for it within 1.5x either way: `within_1_5x`); the plan's
parts (held state and the largest phase). Per island, tokens per second of its inner steps (the coordinator's `push`
events: tokens / compute_s, a median over the rounds). Per round, the payload bytes up and down (the `round`
events' cumulative bytes_up / bytes_down: the encoded tensors, not gRPC framing). `--smoke` shrinks the model to a
few seconds' run (`SMOKE`) for the bench-marked test. Run: ``diloco bench big CONFIG [--rounds R] [--smoke]
[--run-dir DIR] [key=value ...]``.
"""

from __future__ import annotations

import gc
import os
import statistics
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.bench.federation import finished_run
from diloco.config import RunConfig, load_config
from diloco.run.memory_plan import COORDINATOR, launch_plans, launch_refusal
from diloco.run.setup import build_setup
from islands.memory import ProcessPlan, host_room

SMOKE = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.vocab_size=512", "train.inner_steps=2"]
"""`--smoke`: the config's family and codecs on a model of a few hundred thousand parameters."""

RATIO_BOUND = 1.5
"""The issue's bound on peak / plan, either way."""

MIB = 1 << 20

START_S = 1200.0
"""The bound on the processes' start (each builds θ_0 and compiles its programs before it joins): a bound for a hang,
not a measure; a 135M island on a shared 2-core host takes minutes."""

EXIT_S = 300.0
"""How long the islands may take to end once the coordinator has (their last pull, checkpoint and Leave)."""


def measured_plans(cfg: RunConfig) -> dict[str, ProcessPlan]:
    """The memory plan of each process of the config's launch, by name; refused in one line (BenchError) when the
    processes' peaks together do not fit the memory this host has free now. What the measuring built (θ_0, the
    islands) is let go before the run starts."""
    plans = launch_plans(cfg, build_setup(cfg))
    gc.collect()
    refusal = launch_refusal(plans, host_room())
    if refusal is not None:
        raise BenchError(f"bench big: {refusal}")
    return plans


def against_plan(peak: int | None, plan: ProcessPlan) -> dict[str, Any]:
    """One process's measured peak beside its plan: the figures in MiB and peak / plan."""
    phase, extra = max(plan.phases().items(), key=lambda kv: kv[1])
    ratio = None if peak is None else round(peak / plan.peak, 3)
    return {
        "peak_rss_mib": None if peak is None else round(peak / MIB, 1),
        "plan_mib": round(plan.peak / MIB, 1),
        "ratio": ratio,
        "within_1_5x": ratio is not None and 1 / RATIO_BOUND <= ratio <= RATIO_BOUND,
        "plan_held_mib": round(plan.held / MIB, 1),
        "plan_peak_phase": phase,
        "plan_peak_phase_mib": round(extra / MIB, 1),
    }


def peak_of(events: list[dict[str, Any]]) -> int | None:
    """The highest peak a process of one name logged (`memory_peak`), None where none did."""
    return max((int(e["rss_peak_bytes"]) for e in events), default=None)


def per_round(rounds: list[dict[str, Any]], key: str) -> list[int]:
    """The bytes each round moved, from the `round` events' running totals."""
    totals = [0, *(int(r[key]) for r in rounds)]
    return [b - a for a, b in zip(totals, totals[1:], strict=False)]


def tokens_per_second(pushes: list[dict[str, Any]]) -> float | None:
    """The median of tokens / compute_s over an island's pushes (None without any timed one)."""
    rates = [p["tokens"] / p["compute_s"] for p in pushes if p.get("compute_s")]
    return round(statistics.median(rates), 1) if rates else None


def run_big_bench(
    config: str | Path, overrides: list[str], run_dir: Path, rounds: int | None = None, smoke: bool = False
) -> dict[str, Any]:
    overrides = [*(SMOKE if smoke else []), *overrides]
    cfg = load_config(config, overrides)
    rounds = cfg.train.rounds if rounds is None else rounds
    if rounds < 1:
        raise BenchError(f"bench big: --rounds must be >= 1 (got {rounds})")
    plans = measured_plans(cfg)
    load = [round(os.getloadavg()[0], 2)]
    with finished_run(config, overrides, run_dir, rounds, slack_s=START_S) as (cfg, fed, summary):
        fed.wait_exit(timeout_s=EXIT_S)  # each island logs its peak as it ends, after the coordinator's last commit
        peaks = {name: peak_of(fed.events("memory_peak", island=name)) for name in fed.names}
        peaks[COORDINATOR] = peak_of(fed.events("memory_peak"))
        pushes = fed.events("push")
        committed = fed.rounds()
    load.append(round(os.getloadavg()[0], 2))
    processes = {name: against_plan(peaks.get(name), plan) for name, plan in plans.items()}
    up, down = per_round(committed, "bytes_up"), per_round(committed, "bytes_down")
    return {
        "bench": "big",
        "config": str(config),
        "param_count": summary["param_count"],
        "islands": cfg.islands.count,
        "codec": {"uplink": cfg.codec.uplink, "downlink": cfg.codec.downlink},
        "tokens_per_step": cfg.train.batch_size * cfg.model.seq_len,
        "H": cfg.train.inner_steps,
        "rounds": rounds,
        "processes": processes,
        "all_within_1_5x": all(p["within_1_5x"] for p in processes.values()),
        "tokens_per_s": {name: tokens_per_second([p for p in pushes if p["island"] == name]) for name in fed.names},
        "bytes_up_per_round": up,
        "bytes_down_per_round": down,
        "wall_s": summary["wall_s"],
        "final_eval_loss": summary["final_eval_loss"],
        "load_avg_1min": load,
        "run_dir": str(run_dir),
    }
