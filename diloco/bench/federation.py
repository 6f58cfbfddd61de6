"""Federation benchmarks under faults: recovery time of a killed island, and convergence with an island lost.

Both start a real federation (coordinator + island processes over gRPC, diloco.harness.procs.Federation) and act on it
with SIGKILL, the fault docs/architecture.md's fault model promises to survive ("island process killed mid-round" and
"island comes back").

* `run_recovery_bench` — time to rejoin. Islands run with the config's WAN link profile (network.links, the
  user-space shaper). After `kill_after` committed rounds one island (by default the one with the slowest
  downlink: ap-south, 50 Mbit/s, in configs/links/wan3.toml) is SIGKILLed; once the coordinator has committed a
  round without it (so it is behind and must pull the full θ, the expensive path), it is started again with
  the same command line. The figure is the wall time from that restart to its first `train_start` event:
  process start, imports, restoring its own checkpoint, join, pulling θ_r over its link, digest check.
  Acceptance bound: parameter bytes (fp32 params × 4) / the link's down bandwidth + 10 s.

  The run is sized to what it measures (`plan_recovery`), so that the survivors cannot finish it while the
  victim restarts, however fast this machine trains: the victim stays a member while it is down (quorum.lease_s
  and reconnect_grace_s are raised to outlast its absence: its broken presence call is forgiven), so every round
  without it closes at the deadline, never sooner than quorum.min_deadline_s; and train.rounds is set to
  kill_after + 2 (the round open at the kill, to which the victim may already have pushed, and the first round
  committed without it) + the rounds that can close during a restart of up to RESTART_ROOM × the bound
  (floor(window / min_deadline_s) + 1) + RECOVERY_MARGIN_ROUNDS (the victim trains with the others again). A
  restart slower than that window fails the benchmark with one line.
* `run_failover_bench` — how long the survivors stall when an island dies. The victim runs under its supervisor
  (as `launch` starts islands) and `factor` times slower (islands.slowdown), so the others have pushed the open
  round and wait for it when it dies, `how` (`FAILURES`): its worker SIGKILLed (the supervisor lives and sends a
  Leave), its host lost (supervisor and worker SIGKILLed: their kernel closes the connections, and the presence
  call breaks) or its host frozen (both SIGSTOPped: nothing answers, nothing is closed; the coordinator's keepalive
  pings go unanswered: transport.keepalive_s, off by default, must be on). Leases and deadlines are set far longer
  than the figure (FAILOVER_LEASE_S), so what closes the round is the failure being noticed, not a timeout.
  Figures, wall seconds from the failure: `detected_s` (the coordinator's `island_left` or `island_lost`, whose
  reason is `detected_by`) and `survivors_stalled_s`, the last survivor's next `train_start` (the round closed, it
  pulled the commit and trains again); the round's `islands` and `reason` show what closed it. The issue's bound
  is 5 s; the peer's 4.9 s.
* `run_fault_bench` — convergence under faults (DiLoCo, arXiv 2311.08105, claims robustness to islands that
  drop out). Two runs of one config and seed: fault-free, and one where an island is SIGKILLed at round ≈ R/3
  and restarted at ≈ 2R/3 (it resumes its inner state and data cursor from its own checkpoint and pulls θ).
  Acceptance: final eval losses within 3% of each other.

Run: ``diloco bench recovery configs/local.toml [--run-dir DIR] [--victim NAME] [--kill-after N] [key=value ...]``
``diloco bench failover configs/local.toml [--run-dir DIR] [--victim NAME] [--kill-after N] [--factor F] [--how
worker|host|freeze] [key=value ...]`` and ``diloco bench faults configs/faults.toml [--run-dir DIR] [--victim
NAME] [key=value ...]``; each prints JSON.
A federation that fails (a process crashes, a wait times out) ends the benchmark with a BenchError naming the
log directory, not a traceback.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.config import RunConfig, load_config
from diloco.harness.procs import Federation, FederationError, Wrap
from transport.shaper import load_link_profiles, profile_for

RECOVERY_SLACK_S = 10.0
"""The recovery bound's allowance for starting a process, importing JAX and restoring a checkpoint."""

RESTART_ROOM = 2.0
"""The recovery run has room for a restart this many times its bound; a slower one fails the benchmark."""

RECOVERY_MARGIN_ROUNDS = 2
"""Rounds after the victim's return, so that the result shows it training with the others again."""

FAILOVER_LEASE_S = 120.0
"""quorum.lease_s, min_deadline_s and max_deadline_s of the failover run: only a noticed failure can close the round
the victim dies in before this, so a figure near it means the failure was not noticed."""
FAILURES = {
    "worker": "its worker SIGKILLed (the supervisor lives)",
    "host": "supervisor and worker SIGKILLed (a host lost)",
    "freeze": "supervisor and worker SIGSTOPped (a host or link gone silent)",
}
"""How the failover bench's victim dies (`run_failover_bench`'s ``how``)."""
FAILOVER_BOUND_S = 5.0
"""The issue's bound on the survivors' stall (the peer, torchft with 3 replica groups here, measured 4.9 s)."""

FAULT_TOLERANCE = 0.03
"""Largest accepted relative difference between the final eval losses with and without the fault."""


def full_theta_bytes(cfg: RunConfig) -> int:
    """Bytes of the full fp32 θ a rejoining island pulls: the model's parameter count × 4 (shapes only, no data)."""
    from islands.models.registry import parameter_count

    return 4 * parameter_count(cfg.model)


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


def _check_can_lose_one(cfg: RunConfig, restarts: bool = True) -> None:
    """The run goes on without one island (and, when it `restarts`, the island can resume from its checkpoint)."""
    if cfg.islands.count < 2 or cfg.quorum.min_islands > cfg.islands.count - 1:
        raise BenchError(
            "the run must go on without one island: need islands.count >= 2 and "
            f"quorum.min_islands <= islands.count - 1 (got {cfg.quorum.min_islands})"
        )
    if restarts and cfg.train.checkpoint_every != 1:
        raise BenchError("train.checkpoint_every must be 1: the restarted island resumes from its own checkpoint")


def _rounds_with(fed: Federation, name: str, after_round: int = -1) -> list[int]:
    return [r["round"] for r in fed.rounds() if r["round"] > after_round and name in r.get("islands", [])]


@contextlib.contextmanager
def _federation(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    wrap: Wrap | None = None,
    pause_at: Sequence[str] = (),
    jax_cache: Path | None = None,
) -> Iterator[Federation]:
    """A Federation whose failure ends the benchmark as one BenchError line; the details stay in its logs.
    `wrap` prefixes every process's command (`diloco.harness.netns.Namespace.wrap`: the federation in a shaped
    namespace); `pause_at` names where its processes wait for the benchmark (diloco/faults.py); `jax_cache` is a
    compilation cache its processes share (a restarted one loads its compiled steps)."""
    try:
        with Federation(config_path, overrides, run_dir, wrap=wrap, pause_at=pause_at, jax_cache=jax_cache) as fed:
            yield fed
    except FederationError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BenchError(f"{first} (logs: {run_dir / 'logs'})") from None


@contextlib.contextmanager
def finished_run(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    rounds: int,
    slack_s: float = 120.0,
    wrap: Wrap | None = None,
    coordinator_env: Mapping[str, str] | None = None,
    island_env: Mapping[str, str] | None = None,
    jax_cache: Path | None = None,
) -> Iterator[tuple[RunConfig, Federation, dict[str, Any]]]:
    """A federation of the config run to its end with `train.rounds = rounds`: the resolved config, the federation
    (its events readable until the block ends) and summary.json's contents. `wrap` and `jax_cache` as for
    `_federation`; `coordinator_env` and `island_env` as for `Federation.start`. Every island holds its first push
    until all have joined: a round does not wait for an island that has not joined, and on a busy machine one
    island's start could otherwise outlast the whole run."""
    overrides = [*overrides, f"train.rounds={rounds}"]
    cfg = load_config(config_path, overrides)
    names = cfg.islands.island_names
    held = [f"{name}:before_push:0" for name in names]
    with _federation(config_path, overrides, run_dir, wrap, pause_at=held, jax_cache=jax_cache) as fed:
        fed.start(coordinator_env=coordinator_env, island_env=island_env)
        fed.wait_for(
            lambda: set(names) <= {e["island"] for e in fed.events("island_joined")}, slack_s, "every island to join"
        )
        for entry in held:
            fed.release(entry)
        yield cfg, fed, fed.wait_done(timeout_s=slack_s + 60.0 * rounds)


# -- recovery ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryPlan:
    """How long the recovery run is, and why (see the module docstring)."""

    rounds: int
    """train.rounds of the run."""
    lease_s: float
    """quorum.lease_s and reconnect_grace_s of the run: longer than the victim's absence, so it is never dropped."""
    restart_window_s: float
    """The longest restart the run has room to measure."""

    def overrides(self) -> list[str]:
        return [
            f"train.rounds={self.rounds}",
            f"quorum.lease_s={self.lease_s}",
            f"quorum.reconnect_grace_s={self.lease_s}",
        ]


def plan_recovery(cfg: RunConfig, kill_after: int, bound_s: float) -> RecoveryPlan:
    """Size the recovery run from the bench's own parameters so that it cannot end before the victim is back.

    While the victim is a member that has not pushed, a round closes only at the deadline, which is never shorter
    than quorum.min_deadline_s: at most floor(window / min_deadline_s) + 1 rounds close during a restart window.
    The victim is away for at most two rounds before its restart (each at most quorum.max_deadline_s) plus the
    window, and the lease must outlast that.
    """
    q = cfg.quorum
    window = RESTART_ROOM * bound_s
    during_restart = math.floor(window / q.min_deadline_s) + 1
    rounds = kill_after + 2 + during_restart + RECOVERY_MARGIN_ROUNDS
    lease_s = max(q.lease_s, math.ceil(2 * q.max_deadline_s + window))
    return RecoveryPlan(rounds=rounds, lease_s=float(lease_s), restart_window_s=window)


def run_recovery_bench(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    victim: str | None = None,
    kill_after: int = 3,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Kill one island after `kill_after` rounds, restart it once the run went on without it, time its return."""
    cfg = load_config(config_path, overrides)
    if not cfg.network.links:
        raise BenchError("network.links is empty: the recovery bound needs the island's link profile")
    _check_can_lose_one(cfg)
    if kill_after < 1:
        raise BenchError(f"kill_after must be >= 1 (got {kill_after})")
    victim = _pick_victim(cfg, victim, by_link=True)
    down_mbps = profile_for(load_link_profiles(cfg.network.links), victim).down_mbps
    param_bytes = full_theta_bytes(cfg)
    transfer_s = param_bytes * 8 / (down_mbps * 1e6) if down_mbps > 0 else 0.0
    bound_s = transfer_s + RECOVERY_SLACK_S
    plan = plan_recovery(cfg, kill_after, bound_s)
    run_overrides = [*overrides, *plan.overrides()]
    t0 = time.monotonic()
    with _federation(config_path, run_overrides, run_dir) as fed:
        fed.start()
        fed.wait_rounds(kill_after, timeout_s)
        fed.kill(victim)
        killed_round = len(fed.rounds())  # the round that was open when it died
        # Restart once the federation has moved on without it, so the island must pull the full θ.
        fed.wait_for(
            lambda: True if [r for r in fed.rounds() if victim not in r.get("islands", [])] else None,
            timeout_s,
            f"a round committed without {victim}",
        )
        restarted_round = len(fed.rounds())
        t_restart, first_seen, after = _restart_and_time(fed, victim, timeout_s, plan, bound_s, run_dir)
        summary = fed.wait_done(timeout_s)
        rejoined_rounds = _rounds_with(fed, victim, after_round=restarted_round - 1)
    figure_s = first_seen["train_start"] - t_restart
    synced = next((e for e in after if e["event"] == "synced"), None)
    return {
        "bench": "recovery",
        "config": str(config_path),
        "overrides": run_overrides,
        "run_dir": str(run_dir),
        "victim": victim,
        "kill_after": kill_after,
        "rounds_planned": plan.rounds,
        "lease_s": plan.lease_s,
        "restart_window_s": round(plan.restart_window_s, 3),
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


def _restart_and_time(
    fed: Federation, victim: str, timeout_s: float, plan: RecoveryPlan, bound_s: float, run_dir: Path
) -> tuple[float, dict[str, float], list[dict[str, Any]]]:
    """Restart the victim and watch its events until it trains again: when it restarted, when each of its events
    was first seen, and the events since the restart."""
    seen = len(fed.events(island=victim))
    first_seen: dict[str, float] = {}

    def new_event_times() -> dict[str, float] | None:
        now = time.monotonic()
        for e in fed.events(island=victim)[seen:]:
            first_seen.setdefault(e["event"], now)
        return first_seen if "train_start" in first_seen else None

    t_restart = time.monotonic()
    fed.start_island(victim)
    try:
        fed.wait_for(new_event_times, timeout_s, f"{victim}'s first train_start after its restart", poll_s=0.02)
    except FederationError:
        if fed.coordinator is not None and fed.coordinator.poll() == 0:  # the run ended without it
            raise BenchError(
                f"{victim} did not train again within the run's {plan.rounds} rounds, which leave room for a "
                f"restart of {plan.restart_window_s:.1f} s ({RESTART_ROOM:g} x the bound {bound_s:.1f} s): "
                f"it took longer (logs: {run_dir / 'logs'})"
            ) from None
        raise
    return t_restart, first_seen, fed.events(island=victim)[seen:]


# -- failover -----------------------------------------------------------------------------------------------------


def run_failover_bench(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    victim: str | None = None,
    kill_after: int = 2,
    factor: float = 3.0,
    how: str = "worker",
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Kill or freeze a supervised, slower island (`FAILURES`) while the others wait for it; time their stall
    (docstring)."""
    cfg = load_config(config_path, overrides)
    _check_failover(cfg, kill_after, factor, how)
    victim = _pick_victim(cfg, victim, by_link=False)
    survivors = [n for n in cfg.islands.island_names if n != victim]
    run_overrides = [
        *overrides,
        f"train.rounds={kill_after + 3}",
        f'islands.slowdown=["{victim}={factor:g}"]',
        *(f"quorum.{key}={FAILOVER_LEASE_S}" for key in ("lease_s", "min_deadline_s", "max_deadline_s")),
    ]
    # The survivors hold their first push until the victim has joined: a round does not wait for an island that has
    # not joined, and a supervised JAX process can be the last to start; it takes part from round 0.
    held = [f"{name}:before_push:0" for name in survivors]
    t0 = time.monotonic()
    with _federation(config_path, run_overrides, run_dir, pause_at=held) as fed:
        fed.start_coordinator()
        fed.start_island(victim, supervised=True)
        for name in survivors:
            fed.start_island(name)
        fed.wait_for(
            lambda: any(e["island"] == victim for e in fed.events("island_joined")), timeout_s, f"{victim} to join"
        )
        for entry in held:
            fed.release(entry)
        fed.wait_rounds(kill_after, timeout_s)
        open_round = kill_after

        def pushed(name: str) -> bool:
            return any(e["round"] == open_round and e["island"] == name for e in fed.events("push"))

        fed.wait_for(
            lambda: all(pushed(n) for n in survivors) or None,
            timeout_s,
            f"the survivors' pushes of round {open_round}",
            poll_s=0.01,
        )
        if pushed(victim):
            raise BenchError(f"{victim} pushed round {open_round} before the others: raise --factor (got {factor:g})")
        _strike(fed, victim, how)
        killed = time.monotonic()
        seen: dict[str, float] = {}

        def gone() -> list[dict[str, Any]]:
            return [e for e in fed.events() if e["event"] in ("island_left", "island_lost") and e["island"] == victim]

        def noticed() -> dict[str, float] | None:
            now = time.monotonic()
            if gone():
                seen.setdefault("detected", now)
            for name in survivors:
                if any(e["round"] == open_round + 1 for e in fed.events("train_start", island=name)):
                    seen.setdefault(name, now)
            return seen if len(seen) == 1 + len(survivors) else None

        fed.wait_for(noticed, FAILOVER_LEASE_S, "the survivors training again after the kill", poll_s=0.01)
        closed = fed.wait_rounds(open_round + 1, timeout_s)[open_round]  # recorded after its evaluation
        left = gone()[0]
        if how == "freeze":  # a stopped process would sit out the federation's SIGTERM grace at the end
            os.killpg(fed.islands[victim].pid, signal.SIGKILL)
    stalled = {name: round(seen[name] - killed, 3) for name in survivors}
    return {
        "bench": "failover",
        "config": str(config_path),
        "overrides": run_overrides,
        "run_dir": str(run_dir),
        "victim": victim,
        "how": FAILURES[how],
        "killed_in_round": open_round,
        "detected_s": round(seen["detected"] - killed, 3),
        "detected_by": f"{left['event']}: {left.get('reason')}",
        "round_islands": closed.get("islands"),
        "round_reason": closed.get("reason"),
        "survivors_stalled_s": max(stalled.values()),
        "stalled_s_per_survivor": stalled,
        "bound_s": FAILOVER_BOUND_S,
        "pass": max(stalled.values()) <= FAILOVER_BOUND_S,
        "lease_s": FAILOVER_LEASE_S,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _check_failover(cfg: RunConfig, kill_after: int, factor: float, how: str) -> None:
    """The failover bench's arguments, and a config that can lose its victim, or one BenchError line."""
    if kill_after < 1 or factor < 1.0:
        raise BenchError(f"--kill-after must be >= 1 and --factor >= 1 (got {kill_after}, {factor})")
    if how not in FAILURES:
        raise BenchError(f"--how must be one of {', '.join(FAILURES)} (got {how!r})")
    if how == "freeze" and not cfg.transport.keepalive_s:
        raise BenchError(
            "--how freeze needs transport.keepalive_s > 0: only the coordinator's keepalive pings "
            "notice a frozen host before its lease (off by default; e.g. transport.keepalive_s=1)"
        )
    _check_can_lose_one(cfg, restarts=False)


def _strike(fed: Federation, victim: str, how: str) -> None:
    """The failure `how` names: SIGKILL of the worker, SIGKILL or SIGSTOP of the whole island."""
    if how == "worker":
        os.kill(int((fed.island_dir(victim) / "worker.pid").read_text()), signal.SIGKILL)
    else:  # the supervisor leads the victim's process group (a session of its own), its worker is in it
        os.killpg(fed.islands[victim].pid, signal.SIGKILL if how == "host" else signal.SIGSTOP)
        fed.killed.add(victim)


# -- convergence under faults ------------------------------------------------------------------------------------


def _one_run(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    fault: tuple[str, int, int] | None,
    timeout_s: float,
) -> dict[str, Any]:
    t0 = time.monotonic()
    with _federation(config_path, overrides, run_dir) as fed:
        fed.start()
        if fault is not None:
            victim, kill_at, restart_at = fault
            fed.wait_rounds(kill_at, timeout_s)
            fed.kill(victim)
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
        victim, kill_at, restart_at = fault
        out["rounds_without_victim"] = [r["round"] for r in rounds if victim not in r.get("islands", [])]
        # Whether the restarted island contributed again before the run ended (it had R - 2R/3 rounds to).
        out["rounds_with_victim_after_restart"] = [
            r["round"] for r in rounds if r["round"] >= restart_at and victim in r.get("islands", [])
        ]
    return out


def run_fault_bench(
    config_path: str | Path,
    overrides: Sequence[str],
    run_dir: Path,
    victim: str | None = None,
    timeout_s: float = 1200.0,
) -> dict[str, Any]:
    """The config's run twice, fault-free and with one island killed at R/3 and back at 2R/3; compare losses."""
    cfg = load_config(config_path, overrides)
    R = cfg.train.rounds
    if R < 6:
        raise BenchError(f"train.rounds must be >= 6 to kill at R/3 and restart at 2R/3 (got {R})")
    _check_can_lose_one(cfg)
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
