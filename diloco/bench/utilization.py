"""`diloco bench utilization`: how much of a round the islands spend training, plain DiLoCo vs Streaming DiLoCo with
overlap, over the config's WAN links, against the cost model.

Two real federations of one config (`diloco.procs.Federation`, as `launch` starts them), one after the other:
plain rounds (P = 1, τ = 0), then Streaming DiLoCo (`--fragments` P, `--overlap` τ). Utilization is what the
islands report with each push, as in summary.json but without round 0 (process start, join, first compiles):
Σ compute_s / Σ wall_s, where wall_s is the time since the island's previous push.

The cost model of a plain round (docs/architecture.md, "Cost model"), from the run's own measured parts:

    period = max_i (down_i + c_i + up_i) + close            utilization = mean_i c_i / period

  c_i      island i's compute seconds of that round's H steps (its push's compute_s); the model is evaluated
           for every round after the first, then averaged
  up_i     `transport.shaper.transfer_time_s` of its median push bytes on its uplink (latency + bytes / bandwidth)
  down_i   one pull: the request's one-way latency up, then the update's bytes on its downlink
  close    the coordinator's median commit (aggregate, outer step, downlink encode): all an island waits for;
           the evaluation and the checkpoint follow off the islands' path (docs/architecture.md)

The slowest island's push closes the round, so one island's slow link or step sets everyone's period. The model
leaves out encode/decode and apply on the islands and the islands' own checkpoints; what it misses shows as the
gap `model_points` (measured minus model, in percentage points). "wire_share" is the model's share of a round
that is link time: choose the model size and H (key=value overrides) to make it about one half.

Run: ``diloco bench utilization configs/local.toml [--rounds 6] [--fragments 5] [--overlap 2] [key=value ...]``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.bench.federation import finished_run
from diloco.config import RunConfig
from diloco.procs import Federation
from transport.shaper import UNSHAPED, LinkProfile, load_link_profiles, profile_for, transfer_time_s


def measured_utilization(pushes: list[dict[str, Any]]) -> float:
    """Σ compute_s / Σ wall_s of the coordinator's `push` events after round 0 (whose pushes hold the processes'
    start, the join and, with streaming, every fragment's first encode and commit compiling)."""
    later = [e for e in pushes if e["round"] >= 1]
    wall = sum(e["wall_s"] for e in later)
    if wall <= 0:
        raise BenchError("bench utilization: no push after round 0; raise --rounds")
    return sum(e["compute_s"] for e in later) / wall


def plain_round_model(
    compute_s: dict[str, float], up: dict[str, float], down: dict[str, float], close_s: float
) -> dict[str, float]:
    """One plain round's period and utilization from its parts (module docstring); pure, so table-tested.
    `compute_s`: each island's H steps in that round (the slowest one's push closes it)."""
    period = max(down[n] + compute_s[n] + up[n] for n in compute_s) + close_s
    compute = statistics.fmean(compute_s.values())
    wire = max(down[n] + up[n] for n in compute_s)
    return {"period_s": period, "utilization": compute / period, "wire_share": wire / period}


def _links(cfg: RunConfig) -> dict[str, LinkProfile]:
    profiles = load_link_profiles(cfg.network.links) if cfg.network.links else {}
    return {n: profile_for(profiles, n) if profiles else UNSHAPED for n in cfg.islands.island_names}


def _plain_model(cfg: RunConfig, fed: Federation) -> dict[str, Any]:
    """The model of every round after the first (each from that round's own compute times), averaged."""
    pushes = fed.events("push")
    names = cfg.islands.island_names
    up_bytes = {n: statistics.median(e["bytes_up"] for e in pushes if e["island"] == n) for n in names}
    # Every island pulls each round's update once: the coordinator's downlink bytes grow by n updates a round.
    totals = [e["bytes_down"] for e in fed.events("round")]
    per_pull = statistics.median(b - a for a, b in zip(totals, totals[1:], strict=False)) / len(names)
    links = _links(cfg)
    chunk = cfg.transport.chunk_bytes
    up = {n: transfer_time_s(links[n], int(up_bytes[n]), "up", chunk) for n in names}
    down = {n: links[n].latency_ms / 1e3 + transfer_time_s(links[n], int(per_pull), "down", chunk) for n in names}
    close = statistics.median(e["close_s"]["commit"] for e in fed.events("round")[1:])
    per_round = []
    for r in range(1, cfg.train.rounds):
        compute = {e["island"]: e["compute_s"] for e in pushes if e["round"] == r}
        if set(compute) == set(names):
            per_round.append(plain_round_model(compute, up, down, close))
    if not per_round:
        raise BenchError("bench utilization: no round after the first held every island; raise --rounds")
    model = {k: statistics.fmean(m[k] for m in per_round) for k in per_round[0]}
    return {
        **{k: round(v, 4) for k, v in model.items()},
        "parts_s": {
            "compute_median": round(statistics.median(e["compute_s"] for e in pushes), 4),
            "up": {n: round(v, 4) for n, v in up.items()},
            "down": {n: round(v, 4) for n, v in down.items()},
            "close": round(close, 4),
        },
        "bytes": {"push_median": int(statistics.median(up_bytes.values())), "pull": int(per_pull)},
    }


def _run(config: str | Path, overrides: list[str], run_dir: Path, rounds: int) -> tuple[RunConfig, dict, Any]:
    with finished_run(config, overrides, run_dir, rounds, slack_s=180.0) as (cfg, fed, summary):
        result = {
            "utilization": round(measured_utilization(fed.events("push")), 4),
            "summary_utilization": summary["compute_utilization"],
            "final_eval_loss": summary["final_eval_loss"],
            "wall_s": summary["wall_s"],
            "bytes_up": summary["bytes_up"],
        }
        model = _plain_model(cfg, fed) if not cfg.stream.streaming else None
    return cfg, result, model


def run_utilization_bench(
    config: str | Path, overrides: list[str], run_dir: Path, rounds: int, fragments: int, overlap: int
) -> dict[str, Any]:
    if rounds < 3:
        raise BenchError(f"bench utilization: --rounds must be >= 3 (the first push is left out; got {rounds})")
    plain = ["stream.fragments=1", "stream.overlap_steps=0"]
    stream = [f"stream.fragments={fragments}", f"stream.overlap_steps={overlap}"]
    cfg, plain_run, model = _run(config, [*overrides, *plain], run_dir / "plain", rounds)
    _, stream_run, _ = _run(config, [*overrides, *stream], run_dir / "streaming", rounds)
    assert model is not None
    return {
        "bench": "utilization",
        "islands": cfg.islands.count,
        "H": cfg.train.inner_steps,
        "rounds": rounds,
        "links": cfg.network.links or None,
        "codec": {"uplink": cfg.codec.uplink, "downlink": cfg.codec.downlink},
        "plain": {
            **plain_run,
            "model": model,
            "model_points": round(100 * (plain_run["utilization"] - model["utilization"]), 1),
        },
        "streaming": {"fragments": fragments, "overlap_steps": overlap, **stream_run},
        "streaming_over_plain": round(stream_run["utilization"] / plain_run["utilization"], 3),
        "run_dir": str(run_dir),
    }
