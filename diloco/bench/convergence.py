"""`diloco bench convergence`: DiLoCo against one island and the synchronous baseline, at equal steps.

Three runs of one config, each with the same inner steps per island:
  L1  one island alone (the whole training corpus),
  LM  DiLoCo with M islands (IID shards of the corpus), one sync every H steps,
  Ls  the synchronous data-parallel baseline on the union of the M islands' batches, one sync every step.
Reported: LM / Ls and the share of the data-parallel gain that DiLoCo keeps, (L1 - LM) / (L1 - Ls), with the
number of syncs each needed. Each run keeps its own run directory (metrics.jsonl has the loss curves), and a
finished run is not recomputed when the command is repeated with the same --run-dir.
The published curves (BENCHMARKS.md) are those metrics.jsonl files, kept as benchmarks/convergence/KEY.metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.config import RunConfig, from_dict, to_dict
from diloco.simulate import run_simulation


def _variant(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    data = to_dict(cfg)
    for section, values in sections.items():
        data[section].update(values)
    return from_dict(RunConfig, data)


def run_convergence_bench(cfg: RunConfig, run_dir: Path, islands: int = 4) -> dict[str, Any]:
    """The three runs (resumed when already there in `run_dir`) and the ratios that compare them."""
    if islands < 2:
        raise BenchError(f"bench convergence: --islands must be >= 2 to compare with one island (got {islands})")
    names = list(cfg.islands.names[:islands]) if len(cfg.islands.names) >= islands else []
    runs = {
        "L1": _variant(cfg, islands={"count": 1, "names": []}, train={"mode": "diloco"}),
        f"L{islands}": _variant(cfg, islands={"count": islands, "names": names}, train={"mode": "diloco"}),
        "Ls": _variant(cfg, islands={"count": islands, "names": names}, train={"mode": "sync"}),
    }
    results = {key: run_simulation(variant, run_dir / key, show_progress=False) for key, variant in runs.items()}
    l1, lm, ls = (results[k]["final_eval_loss"] for k in runs)
    return {
        "bench": "convergence",
        "islands": islands,
        "inner_steps_per_island": cfg.total_inner_steps,
        "H": cfg.train.inner_steps,
        "outer": to_dict(cfg.outer),
        "inner_lr": cfg.inner.lr,
        "L1": round(l1, 4),
        f"L{islands}": round(lm, 4),
        "Ls": round(ls, 4),
        "ratio_LM_over_Ls": round(lm / ls, 4),
        "share_of_dp_gain": round((l1 - lm) / (l1 - ls), 4) if l1 != ls else None,
        "syncs": {k: r["syncs"] for k, r in results.items()},
        "sync_reduction_vs_baseline": results["Ls"]["syncs"] / max(results[f"L{islands}"]["syncs"], 1),
        "wall_s": {k: r["wall_s"] for k, r in results.items()},
        "run_dirs": {k: str(run_dir / k) for k in runs},
    }
