"""`diloco bench byzantine`: final eval loss with one Byzantine island among M, per aggregation rule and attack.

Validation (transport/validate.py) refuses malformed and non-finite pushes, but an island that authenticates can
still push a finite Δ of its choosing, and DiLoCo's token-weighted mean lets any single input move θ arbitrarily
far (Blanchard et al., NeurIPS 2017). This measures what the robust rules of outer_optimizer/aggregate.py buy
against such an island, and what they cost when every island is honest.

In one process, with the same code as `simulate` (`build_setup`, `make_island`, `Island.train`,
`Island.encode_delta`, `OuterLoop`), M islands (4 by default) train the config's rounds; the last of islands.names
trains honestly but its pushed Δ is replaced by the attack:

    scale      Δ × 1000 (a push that moves θ 1000 times as far)
    signflip   -Δ (gradient ascent at honest size: no norm bound sees it)
    random     Gaussian noise of the same global norm as Δ
    maxfinite  ±float32 max in every coordinate, with Δ's signs (finite, so validation passes it; the mean's outer
               step overflows)

Each rule also runs fault-free. Reported per (rule, attack): the final eval loss of the global model, its ratio to
the same rule fault-free, whether θ stayed finite, and how much of the Byzantine (and the honest) islands' Δ the
rule kept; per rule, the fault-free loss relative to "mean" (what robustness costs honest training), and whether
the rule's fault-free digest equals the mean's (norm_clip is bit-identical to the mean while no island is clipped).
All runs start from the same θ_0 and see the same batches, so they differ only by the rule and the attack.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from diloco.bench.errors import BenchError
from diloco.config import RunConfig, from_dict, to_dict
from diloco.run.rounds import OuterLoop
from diloco.run.setup import Evaluator, Setup, build_setup, make_island
from floor.codec import CodecError
from floor.errors import UserError
from islands.island import Island
from outer_optimizer.config import OuterConfig
from outer_optimizer.optimizers import aggregator, build_optimizer
from pytrees.naming import PyTree, flatten_named

F32_MAX = float(np.finfo(np.float32).max)
SCALE = 1000.0
"""The `scale` attack's factor."""


def _scale(delta: PyTree, rng: np.random.Generator) -> PyTree:
    return jax.tree.map(lambda x: np.asarray(x, np.float32) * np.float32(SCALE), delta)


def _signflip(delta: PyTree, rng: np.random.Generator) -> PyTree:
    return jax.tree.map(lambda x: -np.asarray(x, np.float32), delta)


def _random(delta: PyTree, rng: np.random.Generator) -> PyTree:
    noise = jax.tree.map(lambda x: rng.standard_normal(np.shape(x)), delta)
    ratio = _norm(delta) / max(_norm(noise), 1e-30)
    return jax.tree.map(lambda z: (z * ratio).astype(np.float32), noise)


def _maxfinite(delta: PyTree, rng: np.random.Generator) -> PyTree:
    return jax.tree.map(lambda x: np.where(np.asarray(x) < 0, -F32_MAX, F32_MAX).astype(np.float32), delta)


ATTACKS: dict[str, Callable[[PyTree, np.random.Generator], PyTree]] = {
    "scale": _scale,
    "signflip": _signflip,
    "random": _random,
    "maxfinite": _maxfinite,
}


def _norm(tree: PyTree) -> float:
    """Global L2 norm in float64 (host)."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(tree)))


@dataclass(frozen=True)
class Outcome:
    """One run: its final eval loss (None when θ stopped being finite), and what the rule kept per round."""

    final_eval_loss: float | None
    finite: bool
    """θ, every Δ and every update stayed finite and no island diverged (else the run stops at that round)."""
    rounds: int
    """Rounds committed (fewer than planned when θ or a Δ stopped being finite)."""
    kept_byzantine: float
    """Mean over rounds of the share of the Byzantine island's Δ the rule kept (1 under mean)."""
    kept_honest_min: float
    """The least share of an honest island's Δ kept in any round (1.0: honest islands never clipped/trimmed)."""
    digest: str


def _with_islands(cfg: RunConfig, count: int) -> RunConfig:
    data = to_dict(cfg)
    names = list(cfg.islands.names[:count]) if len(cfg.islands.names) >= count else []
    data["islands"].update(count=count, names=names)
    data["train"].update(mode="diloco")
    return from_dict(RunConfig, data)


def _run(
    cfg: RunConfig,
    outer: OuterConfig,
    setup: Setup,
    islands: list[Island],
    evaluate: Evaluator,
    attack: str | None,
) -> Outcome:
    """One DiLoCo run in the order of diloco/simulator/simulate.py's `_run_diloco`, the last island Byzantine."""
    loop = OuterLoop.fresh(setup.init_params, build_optimizer(outer), cfg.codec.spec("downlink"), aggregator(outer))
    for island in islands:
        island.start(loop.params)
    rng = np.random.default_rng(cfg.run.seed)
    byzantine = islands[-1].name
    kept_byz: list[float] = []
    kept_honest = 1.0
    for r in range(cfg.train.rounds):
        try:
            for island in islands:
                run = island.train(cfg.train.inner_steps)
                push = island.encode_delta(run, flatten_named(loop.params, to_numpy=False))
                island.keep_residual(push)
                delta = push.sent.decoded
                if attack is not None and island.name == byzantine:
                    delta = ATTACKS[attack](delta, rng)
                loop.submit(island.name, r, delta, push.run.tokens)
            commit = loop.commit()
        except (CodecError, UserError):  # a non-finite Δ or update, or an island diverged from a broken θ: lost
            return Outcome(None, False, r, _mean(kept_byz), kept_honest, "")
        kept = dict(zip(commit.islands, commit.kept, strict=True))
        kept_byz.append(kept.pop(byzantine))
        kept_honest = min(kept_honest, *kept.values())
        for island in islands:
            island.set_params(loop.params)
    loss = evaluate(loop.params)
    finite = math.isfinite(loss)
    return Outcome(loss if finite else None, finite, cfg.train.rounds, _mean(kept_byz), kept_honest, commit.digest)


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 1.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def run_byzantine_bench(
    cfg: RunConfig, attacks: Sequence[str], rules: Sequence[str], islands: int = 4, show: bool = True
) -> dict[str, Any]:
    """Every rule fault-free and under every attack; the table described in the module docstring."""
    if islands < 3:
        raise BenchError(f"bench byzantine: --islands must be >= 3 for honest islands to outnumber one (got {islands})")
    cfg = _with_islands(cfg, islands)
    t0 = time.monotonic()
    setup = build_setup(cfg)
    names = cfg.islands.island_names
    members = [make_island(cfg, name, setup.model, setup.streams[name]) for name in names]
    evaluate = Evaluator(setup.model, setup.eval_stack)
    runs: dict[str, dict[str, Outcome]] = {}
    for rule in rules:
        outer = replace(cfg.outer, aggregate=rule)
        runs[rule] = {}
        for attack in (None, *attacks):
            runs[rule][attack or "none"] = _run(cfg, outer, setup, members, evaluate, attack)
            if show:
                o = runs[rule][attack or "none"]
                print(f"byzantine: {rule:>12} {attack or 'none':>9} loss {o.final_eval_loss}", file=sys.stderr)
    return _table(cfg, runs, names[-1], evaluate(setup.init_params), time.monotonic() - t0)


def _table(
    cfg: RunConfig, runs: dict[str, dict[str, Outcome]], byzantine: str, initial: float, wall_s: float
) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    for rule, by_attack in runs.items():
        free = by_attack["none"].final_eval_loss
        results[rule] = {
            attack: {
                "final_eval_loss": None if o.final_eval_loss is None else round(o.final_eval_loss, 4),
                "ratio_to_fault_free": _ratio(o.final_eval_loss, free),
                "finite": o.finite,
                "rounds": o.rounds,
                "kept_byzantine": round(o.kept_byzantine, 4),
                "kept_honest_min": round(o.kept_honest_min, 4),
            }
            for attack, o in by_attack.items()
        }
    mean_free = runs.get("mean", {}).get("none")
    return {
        "bench": "byzantine",
        "islands": cfg.islands.count,
        "byzantine": byzantine,
        "rounds": cfg.train.rounds,
        "H": cfg.train.inner_steps,
        "outer": to_dict(cfg.outer),
        "initial_eval_loss": round(initial, 4),
        "results": results,
        "fault_free_vs_mean": {
            rule: _ratio(r["none"].final_eval_loss, mean_free.final_eval_loss if mean_free else None)
            for rule, r in runs.items()
        },
        "fault_free_digest_equals_mean": {
            rule: r["none"].digest == mean_free.digest if mean_free else None for rule, r in runs.items()
        },
        "worst_ratio_under_attack": {rule: _worst(r) for rule, r in results.items()},
        "wall_s": round(wall_s, 1),
    }


def _worst(by_attack: dict[str, dict[str, Any]]) -> float | str | None:
    """The largest loss ratio to fault-free over the attacks; "diverged" if one lost θ; None without attacks."""
    attacked = [a for k, a in by_attack.items() if k != "none"]
    if not attacked:
        return None
    if any(a["ratio_to_fault_free"] is None for a in attacked):
        return "diverged"
    return max(a["ratio_to_fault_free"] for a in attacked)
