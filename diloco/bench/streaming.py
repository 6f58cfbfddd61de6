"""`diloco bench streaming`: Streaming DiLoCo against plain DiLoCo at the same H, on one config, side by side.

Two `simulate` runs with the same islands, data, H and inner steps per island:
  plain      stream.fragments = 1, stream.overlap_steps = 0 (every H steps, all of θ)
  streaming  stream.fragments = P, stream.overlap_steps = τ, stream.merge_alpha = α (one fragment every H/P steps)

Reported (JSON): each run's final eval loss and their ratio (the acceptance: streaming within 1% of plain), syncs,
and the bytes on the uplink per sync as measured from the run's own `sync`/`round` events (each event carries the
run's cumulative bytes_up; the difference between two is what one sync moved): the peak per sync and the mean, and
plain's peak over streaming's peak (about P when the fragments are even). Each run keeps its run directory, and a
finished run is not recomputed when the command is repeated with the same --run-dir.

Run: ``diloco bench streaming CONFIG [--fragments 4] [--overlap 1] [--alpha 0] [--run-dir DIR] [key=value ...]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.bench.convergence import config_variant
from diloco.bench.errors import BenchError
from diloco.config import RunConfig
from diloco.run.rundir import read_events
from diloco.simulator.simulate import run_simulation


def bytes_per_sync(metrics: Path) -> list[int]:
    """Uplink bytes of each sync, from the cumulative bytes_up of a run's `sync` and `round` events."""
    totals = [e["bytes_up"] for e in read_events(metrics) if e["event"] in ("sync", "round")]
    return [b - a for a, b in zip([0, *totals], totals, strict=False)]


def run_streaming_bench(cfg: RunConfig, run_dir: Path, fragments: int, overlap: int, alpha: float) -> dict[str, Any]:
    if fragments < 2:
        raise BenchError(f"bench streaming: --fragments must be >= 2 to compare with plain DiLoCo (got {fragments})")
    stream = {"fragments": fragments, "overlap_steps": overlap, "merge_alpha": alpha}
    runs = {
        "plain": config_variant(cfg, stream={"fragments": 1, "overlap_steps": 0, "merge_alpha": 0.0}),
        "streaming": config_variant(cfg, stream=stream),
    }
    results = {key: run_simulation(variant, run_dir / key, show_progress=False) for key, variant in runs.items()}
    syncs = {key: bytes_per_sync(run_dir / key / "metrics.jsonl") for key in runs}
    plain, streaming = (results[k]["final_eval_loss"] for k in runs)
    return {
        "bench": "streaming",
        "H": cfg.train.inner_steps,
        "islands": cfg.islands.count,
        "inner_steps_per_island": cfg.total_inner_steps,
        "stream": stream,
        "final_eval_loss": {k: round(r["final_eval_loss"], 4) for k, r in results.items()},
        "ratio_streaming_over_plain": round(streaming / plain, 4),
        "syncs": {k: r["syncs"] for k, r in results.items()},
        "peak_bytes_up_per_sync": {k: max(v) for k, v in syncs.items()},
        "mean_bytes_up_per_sync": {k: round(sum(v) / len(v)) for k, v in syncs.items()},
        "peak_reduction": round(max(syncs["plain"]) / max(syncs["streaming"]), 3),
        "bytes_up": {k: r["bytes_up"] for k, r in results.items()},
        "wall_s": {k: r["wall_s"] for k, r in results.items()},
        "run_dirs": {k: str(run_dir / k) for k in runs},
    }
