"""Federation benchmarks under faults: recovery time of a killed island, and convergence with an island lost.

Both start a real federation (coordinator + island processes over gRPC, diloco.procs.Federation) and act on it
with SIGKILL, the fault DESIGN.md's fault model promises to survive ("island process killed mid-round" and
"island comes back").

* `run_recovery_bench` — time to rejoin. Islands run with the config's WAN link profile (network.links, the
  user-space shaper). After `kill_after` committed rounds one island (by default the one with the slowest
  downlink: ap-south, 50 Mbit/s, in configs/links/wan3.toml) is SIGKILLed; once the coordinator has committed a
  round without it (so it is behind and must pull the full θ, the expensive path), it is started again with
  the same command line. The figure is the wall time from that restart to its first `train_start` event:
  process start, imports, restoring its own checkpoint, join, pulling θ_r over its link, digest check.
  Acceptance bound: parameter bytes (fp32 params × 4) / the link's down bandwidth + 10 s.
* `run_fault_bench` — convergence under faults (DiLoCo, arXiv 2311.08105, claims robustness to islands that
  drop out). Two runs of one config and seed: fault-free, and one where an island is SIGKILLed at round ≈ R/3
  and restarted at ≈ 2R/3 (it resumes its inner state and data cursor from its own checkpoint and pulls θ).
  Acceptance: final eval losses within 3% of each other.

Run: ``python -m diloco.bench_federation recovery configs/local.toml [--run-dir DIR] [key=value ...]`` and
``python -m diloco.bench_federation faults configs/faults.toml [--run-dir DIR] [key=value ...]``; each prints JSON.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco.config import RunConfig, load_config
from diloco.procs import Federation
from transport.shaper import load_link_profiles, profile_for

RECOVERY_SLACK_S = 10.0
"""The recovery bound's allowance for starting a process, importing JAX and restoring a checkpoint."""

FAULT_TOLERANCE = 0.03
"""Largest accepted relative difference between the final eval losses with and without the fault."""


class BenchError(ValueError):
    """The benchmark cannot run with this config (the message names the key)."""


def param_count(cfg: RunConfig) -> int:
    """Number of model parameters (the full θ an island pulls when it rejoins is this many fp32 values)."""
    import jax
    import numpy as np

    from diloco.simulate import build_setup

    return int(sum(np.size(leaf) for leaf in jax.tree.leaves(build_setup(cfg).init_params)))


def _pick_victim(cfg: RunConfig, victim: str | None, by_link: bool) -> str:
    names = cfg.islands.island_names
    if victim is not None:
        if victim not in names:
            raise BenchError(f"victim '{victim}' is not in islands.names ({', '.join(names)})")
        return victim
    if by_link and cfg.network.links:
        profiles = load_link_profiles(cfg.network.links)
        # The slowest downlink: the worst case for pulling the full θ on rejoin (last name on a tie).
        return min(reversed(names), key=lambda n: profile_for(profiles, n).down_mbps)
    return names[-1]


def _rounds_with(fed: Federation, name: str, after_round: int = -1) -> list[int]:
    return [r["round"] for r in fed.rounds() if r["round"] > after_round and name in r.get("islands", [])]


# -- recovery ----------------------------------------------------------------------------------------------------


def run_recovery_bench(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    victim: str | None = None,
    kill_after: int = 3,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    cfg = load_config(config_path, overrides)
    if not cfg.network.links:
        raise BenchError("network.links is empty: the recovery bound needs the island's link profile")
    if cfg.train.checkpoint_every != 1:
        raise BenchError("train.checkpoint_every must be 1: a restarted island resumes from its own checkpoint")
    if not 1 <= kill_after < cfg.train.rounds - 2:
        raise BenchError(f"kill_after must be in [1, train.rounds - 2) (train.rounds is {cfg.train.rounds})")
    victim = _pick_victim(cfg, victim, by_link=True)
    down_mbps = profile_for(load_link_profiles(cfg.network.links), victim).down_mbps
    param_bytes = param_count(cfg) * 4
    transfer_s = param_bytes * 8 / (down_mbps * 1e6) if down_mbps > 0 else 0.0
    bound_s = transfer_s + RECOVERY_SLACK_S
    t0 = time.monotonic()
    with Federation(config_path, overrides, run_dir) as fed:
        fed.start()
        fed.wait_rounds(kill_after, timeout_s)
        fed.kill_island(victim)
        killed_round = len(fed.rounds())  # the round that was open when it died
        # Restart once the federation has moved on without it, so the island must pull the full θ.
        fed.wait_for(
            lambda: True if [r for r in fed.rounds() if victim not in r.get("islands", [])] else None,
            timeout_s, f"a round committed without {victim}",
        )  # fmt: skip
        restarted_round = len(fed.rounds())
        seen = len(fed.events(island=victim))
        first_seen: dict[str, float] = {}

        def new_event_times() -> dict[str, float] | None:
            now = time.monotonic()
            for e in fed.events(island=victim)[seen:]:
                first_seen.setdefault(e["event"], now)
            return first_seen if "train_start" in first_seen else None

        t_restart = time.monotonic()
        fed.start_island(victim)
        fed.wait_for(new_event_times, timeout_s, f"{victim}'s first train_start after its restart", poll_s=0.02)
        after = fed.events(island=victim)[seen:]
        summary = fed.wait_done(timeout_s)
        rejoined_rounds = _rounds_with(fed, victim, after_round=restarted_round - 1)
    figure_s = first_seen["train_start"] - t_restart
    synced = next((e for e in after if e["event"] == "synced"), None)
    return {
        "bench": "recovery",
        "config": str(config_path),
        "overrides": list(overrides),
        "run_dir": str(run_dir),
        "victim": victim,
        "killed_in_round": killed_round,
        "restarted_in_round": restarted_round,
        "recovery_s": round(figure_s, 3),
        "bound_s": round(bound_s, 3),
        "pass": figure_s <= bound_s,
        "param_bytes": param_bytes,
        "down_mbps": down_mbps,
        "full_theta_transfer_s": round(transfer_s, 3),
        "pulled": synced["kind"] if synced else None,
        # Wall seconds from the restart to the first time each of the island's events was seen.
        "breakdown_s": {k: round(v - t_restart, 3) for k, v in sorted(first_seen.items(), key=lambda kv: kv[1])},
        "rounds_with_victim_after_restart": rejoined_rounds,
        "rounds": summary["rounds"],
        "final_eval_loss": summary["final_eval_loss"],
        "islands_lost": summary["islands_lost"],
        "wall_s": round(time.monotonic() - t0, 1),
    }


# -- convergence under faults ------------------------------------------------------------------------------------


def _one_run(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    fault: tuple[str, int, int] | None,
    timeout_s: float,
) -> dict[str, Any]:
    t0 = time.monotonic()
    with Federation(config_path, overrides, run_dir) as fed:
        fed.start()
        if fault is not None:
            victim, kill_at, restart_at = fault
            fed.wait_rounds(kill_at, timeout_s)
            fed.kill_island(victim)
            fed.wait_rounds(restart_at, timeout_s)
            fed.start_island(victim)
        summary = fed.wait_done(timeout_s)
        rounds = fed.rounds()
    out = {
        "final_eval_loss": summary["final_eval_loss"],
        "rounds": summary["rounds"],
        "tokens": summary["tokens"],
        "islands_lost": summary["islands_lost"],
        "wall_s": round(time.monotonic() - t0, 1),
        "run_dir": str(run_dir),
    }
    if fault is not None:
        out["rounds_without_victim"] = [r["round"] for r in rounds if fault[0] not in r.get("islands", [])]
    return out


def run_fault_bench(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    victim: str | None = None,
    timeout_s: float = 1200.0,
) -> dict[str, Any]:
    cfg = load_config(config_path, overrides)
    R = cfg.train.rounds
    if R < 6:
        raise BenchError(f"train.rounds must be >= 6 to kill at R/3 and restart at 2R/3 (got {R})")
    if cfg.islands.count < 2 or cfg.quorum.min_islands > cfg.islands.count - 1:
        raise BenchError("the run must go on without one island: need islands.count >= 2 and "
                         f"quorum.min_islands <= islands.count - 1 (got {cfg.quorum.min_islands})")  # fmt: skip
    if cfg.train.checkpoint_every != 1:
        raise BenchError("train.checkpoint_every must be 1: the restarted island resumes from its own checkpoint")
    victim = _pick_victim(cfg, victim, by_link=False)
    kill_at, restart_at = max(1, R // 3), max(2, 2 * R // 3)
    clean = _one_run(config_path, overrides, run_dir / "fault_free", None, timeout_s)
    faulty = _one_run(config_path, overrides, run_dir / "faulty", (victim, kill_at, restart_at), timeout_s)
    a, b = clean["final_eval_loss"], faulty["final_eval_loss"]
    rel = abs(b - a) / abs(a) if a and math.isfinite(a) and math.isfinite(b) else math.inf
    return {
        "bench": "faults",
        "config": str(config_path),
        "overrides": list(overrides),
        "islands": cfg.islands.count,
        "rounds": R,
        "victim": victim,
        "killed_at_round": kill_at,
        "restarted_at_round": restart_at,
        "fault_free": clean,
        "faulty": faulty,
        "final_eval_loss_fault_free": a,
        "final_eval_loss_faulty": b,
        "rel_diff": round(rel, 5),
        "tolerance": FAULT_TOLERANCE,
        "pass": rel <= FAULT_TOLERANCE,
    }


# -- command line --------------------------------------------------------------------------------------------------


def add_parsers(bsub: Any) -> None:
    """Add `recovery` and `faults` to the `diloco bench` subparsers (`bsub` from add_subparsers)."""
    helps = {
        "recovery": "time for a SIGKILLed island to rejoin vs params/bandwidth + 10 s",
        "faults": "final eval loss with an island killed at R/3, back at 2R/3, vs fault-free",
    }
    for name, text in helps.items():
        p = bsub.add_parser(name, help=text)
        p.add_argument("config", help="TOML run config")
        p.add_argument("--run-dir", type=Path, default=None, help="where the runs go (default: runs/bench-NAME-TIME)")
        p.add_argument("--victim", default=None, help="island to kill (default: slowest downlink / last name)")
        p.set_defaults(accepts_overrides=True)


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = args.run_dir or Path("runs") / f"bench-{args.bench}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.bench == "recovery":
        return run_recovery_bench(args.config, args.overrides, run_dir, victim=args.victim)
    return run_fault_bench(args.config, args.overrides, run_dir, victim=args.victim)
