"""`diloco bench scaling`: DiLoCo's gap to data-parallel against model size (issue 26, part 5).

The comparison of `diloco bench convergence` (LM: DiLoCo with M islands; Ls: the synchronous data-parallel
baseline on the union of their batches, each at its own best point of its grid) repeated at several model sizes,
as the scaling-laws paper (arXiv 2503.09799) draws it: LM / Ls against parameters. One island alone (L1) is left
out: the ratio needs only LM and Ls, and leaving it out saves a quarter of the compute.

    --size NAME:section.key=v[,section.key=v...]   a model size: overrides of the config (model.* keys, usually);
        repeat, smallest first. The parameters of each size are counted from its model's abstract init.
    --grid [NAME@]METHOD:section.key=v1,v2         a method's grid (bench convergence's form); with `NAME@` it
        applies to that size only, so each size is tuned where its optimum lies (the best learning rate falls as a
        model grows).

Every run keeps its run directory under RUN_DIR/NAME/ (resumed when repeated), the result lists every point of
every grid, and `--plot FILE` draws LM / Ls against parameters (log scale), one point per size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.bench.convergence import config_variant, run_convergence_bench
from diloco.bench.errors import BenchError
from diloco.bench.variants import parse_variants
from diloco.config import RunConfig
from islands.models.registry import parameter_count


def grids_for(size: str, specs: list[str], sizes: list[str]) -> list[str]:
    """The --grid specs that apply to `size`: those without a size prefix and those prefixed `size@`."""
    chosen = []
    for spec in specs:
        prefix, at, rest = spec.partition("@")
        if not at:
            chosen.append(spec)
            continue
        if prefix not in sizes:
            raise BenchError(f"--grid {spec!r} names size {prefix!r}, not one of the --size names {sizes}")
        if prefix == size:
            chosen.append(rest)
    return chosen


def run_scaling_bench(
    cfg: RunConfig,
    run_dir: Path,
    size_specs: list[str],
    islands: int = 4,
    grids: list[str] | None = None,
    vectorize: bool = False,
    plot: Path | None = None,
) -> dict[str, Any]:
    """bench convergence's LM / Ls at every size (smallest first, as given); one row per size."""
    sizes = parse_variants(size_specs, "--size")
    names = [s.name for s in sizes]
    if len(sizes) < 2:
        raise BenchError(f"bench scaling: give at least two --size (got {names})")
    variants = {s.name: config_variant(cfg, s.overrides) for s in sizes}
    per_size = {s.name: grids_for(s.name, grids or [], names) for s in sizes}  # every spec checked before any run
    rows = []
    for size in sizes:
        variant = variants[size.name]
        result = run_convergence_bench(
            variant, run_dir / size.name, islands, per_size[size.name], vectorize=vectorize, methods=("LM", "Ls")
        )
        lm_key = f"L{islands}"
        rows.append(
            {
                "size": size.name,
                "overrides": list(size.overrides),
                "parameters": parameter_count(variant.model),
                "LM": result[lm_key],
                "Ls": result["Ls"],
                "ratio_LM_over_Ls": result["ratio_LM_over_Ls"],
                "best": result["best"],
                "grid": result["grid"],
            }
        )
    out = {
        "bench": "scaling",
        "islands": islands,
        "H": cfg.train.inner_steps,
        "inner_steps_per_island": cfg.total_inner_steps,
        "vectorized": vectorize,
        "outer": {"kind": cfg.outer.kind, "lr": cfg.outer.lr, "aggregate": cfg.outer.aggregate},
        "parameter_span": round(rows[-1]["parameters"] / rows[0]["parameters"], 2),
        "sizes": rows,
    }
    if plot is not None:
        from diloco.ops.plot import draw_ratio_against_size

        out["plot"] = str(draw_ratio_against_size(rows, plot, islands, cfg.train.inner_steps))
    return out
