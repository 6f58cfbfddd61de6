"""`diloco bench heterogeneous`: one island slower than the rest; plain rounds vs time-budgeted rounds vs asynchronous
DiLoCo, for the same span of one virtual time axis.

Three `simulate` runs of one config with M = --islands islands (default 3), the last of them s_max = --factor times
slower (default 2, through islands.slowdown), H and the model as the config has them. The plain run's R = --rounds
rounds last T = R·H·s_max time units; the other two are given the same T:
  plain      train.mode = "diloco": every round waits for the slow island; R rounds
  budgeted   train.round_seconds = B, a budget of 1.1·H units: each island trains the steps that fit it (at most H),
             token-weighted; ceil(T / 1.1·H) rounds
  async      train.mode = "async", outer.kind = "delayed_nesterov", outer.momentum_every = M: every push due by T,
             Σ_i floor(T / (H·s_i)) updates of one island's H steps each (diloco/simulator/async_sim.py)

Time axis, the same rule for the three: virtual time in units of one inner step of a full-speed island; an island
with factor s takes s units per step (async_sim's clock).
  plain, budgeted  a round lasts until its last island is done: max_i n_i·s_i, n_i being the steps island i trained
                   in that round (counted from the run's `inner` events, logged at every step): H·s_max a round for
                   plain, at most about the budget for budgeted. Round r's eval loss is placed at the sum up to r.
  async            each update's eval loss is placed at its push's virtual time (its `round` event's vtime).
So a fast island that idles while a round waits costs plain time, as it would on real hardware. The axis counts inner
steps only (no link, commit or evaluation time). It is not what a multi-process run (`diloco launch`) would measure,
and neither are the wall seconds reported beside it: in one process the islands take turns, so a run's wall time is
the sum of every island's (the slowdown's sleeping included).

In seconds, B = 1.1 × H × the step time of a full-speed island measured just before the budgeted run (after a warm-up
compile), so a full-speed island fits its H steps and the slow one about 1.1·H/s_max. Its step counts, unlike the
other runs', depend on the machine's load: when the load falls after the measurement the slow island trains more
than that (and its rounds last longer on the axis), when it rises the fast islands fall short of H. The JSON gives
the steps each island trained per round on average. A finished run is not recomputed when the command is repeated
with the same --run-dir (the budgeted run keeps the budget it was given).

Reported (JSON): target = plain's final eval loss × --target (default 1.02); each run's virtual time to first reach it
(null: never) and plain's time over each other's; each run's eval loss at the plain run's tokens (the last commit
within them) and at the earliest of the runs' virtual ends (T for plain), with ratios to plain; final eval
losses, tokens, virtual end times and wall seconds.

Run: ``diloco bench heterogeneous [CONFIG] [--rounds 8] [--islands 3] [--factor 2] [--target 1.02] [--run-dir DIR]
[key=value ...]`` (CONFIG defaults to configs/convergence.toml). At the default the three runs train about 6,400
full-speed step equivalents, minutes on 2 CPU cores (BENCHMARKS.md); --rounds scales it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from diloco.bench.convergence import config_variant
from diloco.bench.errors import BenchError
from diloco.config import RunConfig, load_config, to_dict
from diloco.run.rundir import read_events
from diloco.run.setup import build_setup, make_island
from diloco.simulator.simulate import run_simulation

BUDGET_MARGIN = 1.1
"""The budget in units of H full-speed steps: room for the step time to vary a little without a fast island falling
short."""
CALIBRATION_STEPS = 20
"""Timed steps of the full-speed island that sizes the budget."""

ASYNC_OUTER_KEYS = ("kind", "lr", "momentum", "momentum_every", "staleness_exponent")
"""The async run's outer settings the JSON repeats."""

Point = tuple[float, int, float]
"""(virtual time, cumulative tokens, eval loss) after one commit."""


def steps_per_round(metrics: Path) -> list[dict[str, int]]:
    """Inner steps each island trained in each round, counted from `inner` events (the run must log every step)."""
    counts: Counter[tuple[int, str]] = Counter((e["round"], e["island"]) for e in read_events(metrics, "inner"))
    rounds = 1 + max((r for r, _ in counts), default=-1)
    out: list[dict[str, int]] = [{} for _ in range(rounds)]
    for (r, island), n in counts.items():
        out[r][island] = n
    return out


def round_end_times(steps: Sequence[Mapping[str, int]], factors: Mapping[str, float]) -> list[float]:
    """Virtual end time of each round: the running sum of max_i n_i·s_i (a round ends when its last island does)."""
    times, t = [], 0.0
    for per_island in steps:
        t += max(n * factors.get(island, 1.0) for island, n in per_island.items())
        times.append(t)
    return times


def round_curve(metrics: Path, factors: Mapping[str, float]) -> list[Point]:
    """(virtual time, tokens, eval loss) after each round of a plain or time-budgeted run."""
    rounds = read_events(metrics, "round")
    times = round_end_times(steps_per_round(metrics), factors)
    return [(times[e["round"]], e["tokens"], e["eval_loss"]) for e in rounds]


def async_curve(metrics: Path) -> list[Point]:
    """(virtual time, tokens, eval loss) after each update of an asynchronous run."""
    return [(e["vtime"], e["tokens"], e["eval_loss"]) for e in read_events(metrics, "round")]


def first_time_at_or_below(points: Sequence[Point], target: float) -> float | None:
    """The virtual time of the first point whose eval loss is <= target, or None."""
    return next((t for t, _, loss in points if loss <= target), None)


def loss_at(points: Sequence[Point], limit: float, axis: int) -> float | None:
    """The eval loss of the last point whose coordinate `axis` (0: virtual time, 1: tokens) is <= limit, or None."""
    within = [p[2] for p in points if p[axis] <= limit]
    return within[-1] if within else None


def full_speed_step_seconds(cfg: RunConfig, name: str, steps: int = CALIBRATION_STEPS) -> float:
    """Seconds per inner step of island `name` (a full-speed one) of `cfg`, after its warm-up compile."""
    setup = build_setup(cfg, islands=[name])
    island = make_island(cfg, name, setup.model, setup.streams[name])
    island.start(setup.init_params)
    island.train(2)  # compiles (outside the timing) and settles the first steps
    return island.train(steps).seconds / steps


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _rounded(losses: Mapping[str, float | None]) -> dict[str, float | None]:
    return {key: None if v is None else round(v, 4) for key, v in losses.items()}


def _check_args(rounds: int, islands: int, factor: float, target: float) -> None:
    if rounds < 1 or islands < 2 or not factor >= 1 or not target >= 1:
        raise BenchError(
            "bench heterogeneous: --rounds must be >= 1, --islands >= 2, --factor >= 1 and --target >= 1 "
            f"(got {rounds}, {islands}, {factor}, {target})"
        )


def run_heterogeneous_bench(
    cfg: RunConfig, run_dir: Path, rounds: int, islands: int = 3, factor: float = 2.0, target: float = 1.02
) -> dict[str, Any]:
    """The three runs (resumed when already in `run_dir`) and the figures that compare them (module docstring)."""
    _check_args(rounds, islands, factor, target)
    names = list(cfg.islands.names[:islands]) if len(cfg.islands.names) >= islands else []
    base = config_variant(
        cfg,
        islands={"count": islands, "names": names, "slowdown": []},
        train={"mode": "diloco", "rounds": rounds, "round_seconds": 0.0, "log_every": 1},
    )
    fast, slow = base.islands.island_names[0], base.islands.island_names[-1]
    plain = config_variant(base, islands={"slowdown": [f"{slow}={factor}"]})
    factors = {name: plain.islands.slowdowns().get(name, 1.0) for name in plain.islands.island_names}
    H = plain.train.inner_steps
    # Exact rationals, as async_sim's clock: a push due exactly at the span's end is in it.
    span = rounds * H * Fraction(max(factors.values()))
    budgeted_rounds = math.ceil(span / (Fraction(BUDGET_MARGIN) * H))
    async_updates = sum(math.floor(span / (H * Fraction(s))) for s in factors.values())

    results = {"plain": run_simulation(plain, run_dir / "plain", show_progress=False)}
    done_budget = run_dir / "budgeted" / "config.toml"
    step_s = None if done_budget.exists() else full_speed_step_seconds(plain, fast)
    budget_s = load_config(done_budget).train.round_seconds if step_s is None else BUDGET_MARGIN * H * step_s
    variants = {
        "budgeted": config_variant(plain, train={"round_seconds": budget_s, "rounds": budgeted_rounds}),
        "async": config_variant(
            plain,
            train={"mode": "async", "rounds": async_updates},
            outer={"kind": "delayed_nesterov", "momentum_every": islands},
        ),
    }
    for key, variant in variants.items():
        results[key] = run_simulation(variant, run_dir / key, show_progress=False)

    metrics = {key: run_dir / key / "metrics.jsonl" for key in results}
    curves = {
        "plain": round_curve(metrics["plain"], factors),
        "budgeted": round_curve(metrics["budgeted"], factors),
        "async": async_curve(metrics["async"]),
    }
    goal = results["plain"]["final_eval_loss"] * target
    reach = {key: first_time_at_or_below(points, goal) for key, points in curves.items()}
    equal_tokens = results["plain"]["tokens"]
    equal_time = min(points[-1][0] for points in curves.values())
    at_tokens = {key: loss_at(points, equal_tokens, axis=1) for key, points in curves.items()}
    at_time = {key: loss_at(points, equal_time, axis=0) for key, points in curves.items()}
    budget_steps = steps_per_round(metrics["budgeted"])
    return {
        "bench": "heterogeneous",
        "islands": islands,
        "slow_island": slow,
        "slowdown": factor,
        "H": H,
        "time_span": float(span),
        "rounds": {"plain": rounds, "budgeted": budgeted_rounds, "async": async_updates},
        "async_outer": {k: v for k, v in to_dict(variants["async"].outer).items() if k in ASYNC_OUTER_KEYS},
        "time_unit": "one inner step of a full-speed island (virtual)",
        "budget_s": round(budget_s, 4),
        "full_speed_step_s": round(step_s, 5) if step_s is not None else None,
        "budgeted_steps_per_round": {
            name: round(sum(r.get(name, 0) for r in budget_steps) / max(len(budget_steps), 1), 2) for name in factors
        },
        "target": f"plain final eval loss x {target}",
        "target_eval_loss": round(goal, 4),
        "time_to_target": reach,
        "plain_time_over": {key: _ratio(reach["plain"], reach[key]) for key in ("budgeted", "async")},
        "final_eval_loss": {key: round(r["final_eval_loss"], 4) for key, r in results.items()},
        "tokens": {key: r["tokens"] for key, r in results.items()},
        "time_end": {key: points[-1][0] for key, points in curves.items()},
        "eval_loss_at_equal_tokens": {"tokens": equal_tokens, **_rounded(at_tokens)},
        "ratio_at_equal_tokens_over_plain": {key: _ratio(at_tokens[key], at_tokens["plain"]) for key in variants},
        "eval_loss_at_equal_time": {"time": equal_time, **_rounded(at_time)},
        "ratio_at_equal_time_over_plain": {key: _ratio(at_time[key], at_time["plain"]) for key in variants},
        "wall_s": {key: r["wall_s"] for key, r in results.items()},
        "run_dirs": {key: str(run_dir / key) for key in results},
    }
