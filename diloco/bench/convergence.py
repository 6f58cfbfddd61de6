"""`diloco bench convergence`: DiLoCo against one island and the synchronous baseline, at equal steps.

Three methods on one config, each with the same inner steps per island:
  L1  one island alone (the whole training corpus),
  LM  DiLoCo with M islands (IID shards of the corpus), one sync every H steps,
  Ls  the synchronous data-parallel baseline on the union of the M islands' batches, one sync every step.
Reported: LM / Ls and the share of the data-parallel gain that DiLoCo keeps, (L1 - LM) / (L1 - Ls), with the
number of syncs each needed.

The papers' protocols, as options:
  --grid METHOD:section.key=v1,v2,...   each method at its own best: a method runs every point of the cartesian
        product of its grids and is represented by its lowest final eval loss (the scaling-laws paper, arXiv
        2503.09799, tunes DP and DiLoCo separately). METHOD is L1, LM (the DiLoCo run, whatever M), Ls or all.
        Every point is reported, so a reader sees how flat or sharp each optimum is.
  --vectorize   the DiLoCo runs step their islands as one program (`train.vectorize`): the same results to float
        rounding, in a fraction of the time on small models.
  --warm-start STEPS   pretrain one island with the inner optimizer alone (the sync baseline on one island: no
        outer optimizer) for STEPS inner steps, then run every method from that checkpoint (`init.from`) for the rest
        of the step budget (DiLoCo, arXiv 2311.08105, and Async Local-SGD, arXiv 2401.09135, start from such a model).
  --warm-protocol restart|continue   what the methods take from the pretraining. restart (the default): its θ only;
        each method starts a fresh inner optimizer and a schedule of its own over the steps left. continue (the
        papers': training goes on): the pretraining runs the first STEPS steps of a schedule of the whole budget
        (inner.schedule_steps), and every island of every method starts with its θ, its inner optimizer state and so
        its schedule's position (`init.inner_state`, `init.inner_state_island = "sync"`), so that its first step is
        the pretraining's next one. A --grid over inner.* keys changes them from there on; the pretraining runs the
        config's values.

Each run keeps its own run directory (metrics.jsonl has the loss curves: `diloco plot` draws them), and a finished
run is not recomputed when the command is repeated with the same --run-dir (simulate resumes it: nothing is left).
The published curves (BENCHMARKS.md) are those metrics.jsonl files, kept as benchmarks/convergence/KEY.metrics.jsonl.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.config import ConfigError, RunConfig, apply_overrides, from_dict, to_dict
from diloco.simulator.simulate import run_simulation

METHODS = ("L1", "LM", "Ls")
WARM_PROTOCOLS = ("restart", "continue")


@dataclass(frozen=True)
class Point:
    """One run of a method: its overrides (empty for the config as given) and where it goes."""

    method: str
    overrides: tuple[str, ...]

    @property
    def key(self) -> str:
        """The run directory's name under its method: `default`, or the overrides joined (`inner.lr=0.006,...`)."""
        return ",".join(self.overrides) or "default"


def parse_grids(specs: list[str]) -> dict[str, list[tuple[str, list[str]]]]:
    """`["LM:inner.lr=3e-3,6e-3", "all:outer.lr=0.7"]` -> {method: [(key, [values...]), ...]} per method.

    Values stay text: each point's overrides go through the config's own parser, which validates them."""
    grids: dict[str, list[tuple[str, list[str]]]] = {m: [] for m in METHODS}
    for spec in specs:
        method, sep, rest = spec.partition(":")
        key, eq, values = rest.partition("=")
        if not sep or not eq or not key or method not in (*METHODS, "all"):
            raise BenchError(
                f"--grid {spec!r} must look like METHOD:section.key=v1,v2 with METHOD one of {', '.join(METHODS)}, all"
            )
        choices = [v for v in values.split(",") if v]
        if not choices:
            raise BenchError(f"--grid {spec!r} lists no values")
        for m in METHODS if method == "all" else (method,):
            grids[m].append((key, choices))
    return grids


def grid_points(method: str, axes: list[tuple[str, list[str]]]) -> list[Point]:
    """Every combination of `axes` (the cartesian product, in the order given); one empty point without axes."""
    keys = [key for key, _ in axes]
    return [
        Point(method, tuple(f"{k}={v}" for k, v in zip(keys, combo, strict=True)))
        for combo in itertools.product(*(values for _, values in axes))
    ]


def config_variant(cfg: RunConfig, overrides: tuple[str, ...] = (), **sections: dict[str, Any]) -> RunConfig:
    """`cfg` with whole sections' keys replaced (`islands={"count": 1}`), then `section.key=value` overrides applied
    by the config's own parser; a bad value is a BenchError naming the key."""
    data = to_dict(cfg)
    for section, values in sections.items():
        data[section].update(values)
    try:
        return from_dict(RunConfig, apply_overrides(data, overrides))
    except ConfigError as exc:
        raise BenchError(f"bench convergence: {exc}") from None


def _method_config(cfg: RunConfig, method: str, islands: int, vectorize: bool) -> dict[str, dict[str, Any]]:
    """The sections that make `cfg` into a method's run (`vectorize`: the DiLoCo run's islands step as one program,
    islands/vectorized.py; the other two have one model each)."""
    names = list(cfg.islands.names[:islands]) if len(cfg.islands.names) >= islands else []
    return {
        "L1": {"islands": {"count": 1, "names": []}, "train": {"mode": "diloco"}},
        "LM": {"islands": {"count": islands, "names": names}, "train": {"mode": "diloco", "vectorize": vectorize}},
        "Ls": {"islands": {"count": islands, "names": names}, "train": {"mode": "sync"}},
    }[method]


def warm_start(cfg: RunConfig, steps: int, run_dir: Path, protocol: str) -> tuple[RunConfig, dict[str, Any]]:
    """Pretrain one island with the inner optimizer alone for `steps` inner steps (resumed if already there); returns
    the config every method runs from it (init.from, the rounds left and, to continue, the inner state and the
    schedule of the whole budget) and what the result says of it."""
    H, rounds = cfg.train.inner_steps, cfg.train.rounds
    if steps <= 0 or steps % H or steps >= rounds * H:
        raise BenchError(
            f"bench convergence: --warm-start must be a positive multiple of train.inner_steps ({H}) below the run's "
            f"{rounds * H} inner steps (got {steps})"
        )
    if protocol not in WARM_PROTOCOLS:
        raise BenchError(
            f"bench convergence: --warm-protocol must be one of {', '.join(WARM_PROTOCOLS)} (got {protocol!r})"
        )
    # Continuing: one schedule over the whole budget, of which the pretraining runs the first `steps` steps.
    inner = {"schedule_steps": cfg.inner.schedule_steps or cfg.total_inner_steps} if protocol == "continue" else {}
    pre = config_variant(
        cfg, islands={"count": 1, "names": []}, train={"mode": "sync", "rounds": steps // H}, inner=inner
    )
    run_simulation(pre, run_dir, show_progress=False)
    init: dict[str, Any] = {"from": str(run_dir)}
    if protocol == "continue":
        init.update(inner_state=True, inner_state_island="sync")
    base = config_variant(cfg, train={"rounds": rounds - steps // H}, init=init, inner=inner)
    method = f"one island, inner.kind = {cfg.inner.kind!r} alone (sync mode)"
    return base, {"steps": steps, "protocol": protocol, "run_dir": str(run_dir), "method": method}


def run_convergence_bench(
    cfg: RunConfig,
    run_dir: Path,
    islands: int = 4,
    grids: list[str] | None = None,
    warm_steps: int = 0,
    vectorize: bool = False,
    warm_protocol: str = "restart",
    methods: tuple[str, ...] = METHODS,
) -> dict[str, Any]:
    """Every method's runs (resumed when already there in `run_dir`), each method's best, and the ratios of the
    bests. Without grids each method is one run of the config as given, in `run_dir/KEY` as before. `methods` may
    leave out L1 (the scaling bench compares LM with Ls only): the share of the gain is then None."""
    if not {"LM", "Ls"} <= set(methods) <= set(METHODS):
        raise BenchError(f"bench convergence: the methods must include LM and Ls, among {', '.join(METHODS)}")
    if islands < 2:
        raise BenchError(f"bench convergence: --islands must be >= 2 to compare with one island (got {islands})")
    axes = parse_grids(grids or [])
    base, warm = cfg, None
    if warm_steps:
        base, warm = warm_start(cfg, warm_steps, run_dir / "warm", warm_protocol)
    keys = {"L1": "L1", "LM": f"L{islands}", "Ls": "Ls"}
    table: dict[str, list[dict[str, Any]]] = {}
    for method in (m for m in METHODS if m in methods):
        points = grid_points(method, axes[method])
        rows = table[keys[method]] = []
        for point in points:
            variant = config_variant(base, point.overrides, **_method_config(base, method, islands, vectorize))
            # A point without overrides is a method without a grid: its run keeps the bench's original place.
            where = run_dir / keys[method] / point.key if point.overrides else run_dir / keys[method]
            result = run_simulation(variant, where, show_progress=False)
            rows.append(
                {
                    "overrides": list(point.overrides),
                    "final_eval_loss": round(result["final_eval_loss"], 4),
                    "syncs": result["syncs"],
                    "wall_s": result["wall_s"],
                    "run_dir": str(where),
                }
            )
    best = {key: min(rows, key=lambda row: row["final_eval_loss"]) for key, rows in table.items()}
    lm, ls = best[keys["LM"]]["final_eval_loss"], best["Ls"]["final_eval_loss"]
    l1 = best["L1"]["final_eval_loss"] if "L1" in best else None
    return {
        "bench": "convergence",
        "islands": islands,
        "inner_steps_per_island": base.total_inner_steps,
        "H": cfg.train.inner_steps,
        "warm_start": warm,
        "vectorized": vectorize,
        "outer": to_dict(cfg.outer),
        "inner_lr": cfg.inner.lr,
        **{key: row["final_eval_loss"] for key, row in best.items()},
        "best": {key: row["overrides"] for key, row in best.items()},
        "ratio_LM_over_Ls": round(lm / ls, 4),
        "share_of_dp_gain": round((l1 - lm) / (l1 - ls), 4) if l1 is not None and l1 != ls else None,
        "syncs": {key: row["syncs"] for key, row in best.items()},
        "sync_reduction_vs_baseline": best["Ls"]["syncs"] / max(best[keys["LM"]]["syncs"], 1),
        "wall_s": {key: row["wall_s"] for key, row in best.items()},
        "run_dirs": {key: row["run_dir"] for key, row in best.items()},
        "grid": table,
    }
