"""`diloco bench sync`: what one sync costs the islands of a real federation, and where the time goes.

Starts the config's coordinator and islands as processes (`diloco.harness.procs.Federation`, as `launch` does), runs
`--rounds` rounds and reads back, per island, `sync_s` of its `train_start` events: the seconds from the end of its
H-th inner step to the start of its next (encode, push, the wait for the round to close, pull, apply, checkpoint).
The first round of each process is left out (it compiles). From the coordinator's events it reports what the close
of a round costs on the islands' path: the commit (aggregate, outer step, downlink encode), the evaluation, and the
checkpoint save (all three happen before any island can pull θ_{r+1}).

Every island's sync_s includes its wait for the others to finish their steps (on a shared host their compute
differs by up to a second a round). The *critical path* is the sync of each round's last island to push, which
waits for nobody: what one sync itself costs. It is reported apart (`critical_sync_s`), with its parts
(`critical_parts_median_s`, from the island's `train_start` and `pushed` events, docs/metrics.md): encode (take Δ and
encode it), push (the call; the last push's includes the commit, which runs in it), pull (the rest of the wait:
pull and transfer of the committed update), adopt (decode, apply, digest check), and the rest (merge into the
local θ, the checkpoint copy, the loop).

Reported (JSON): median, p90 and max of sync_s over all islands and rounds, the same per island, the critical
path and its parts, the median of each close part, the median inner-step time, param count and codec. Run:
``diloco bench sync CONFIG [--rounds 8] [--run-dir DIR] [key=value ...]``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.bench.federation import finished_run


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None, "max": None}
    ordered = sorted(values)
    return {
        "median": round(statistics.median(ordered), 4),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4),
        "max": round(ordered[-1], 4),
    }


CRITICAL_PARTS = ("encode", "push", "pull", "adopt", "rest")


def critical_path(
    pushes: list[dict[str, Any]], starts: dict[str, list[dict[str, Any]]], pushed: dict[str, list[dict[str, Any]]]
) -> list[dict[str, float]]:
    """Per round r after the first: the sync of round r's last island to push (coordinator `push` events, in
    arrival order), read from its `train_start` of round r + 1 and its `pushed` event of round r, split into
    CRITICAL_PARTS. Rounds whose events are missing (a push refused, the run's last round) are left out."""
    last: dict[int, str] = {}
    for e in pushes:
        last[e["round"]] = e["island"]
    out = []
    for r, island in sorted(last.items()):
        start = next((e for e in starts.get(island, []) if e["round"] == r + 1 and "sync_s" in e), None)
        push = next((e for e in pushed.get(island, []) if e["round"] == r and "push_s" in e), None)
        if r == 0 or start is None or push is None:
            continue
        parts = {
            "encode": start["encode_s"],
            "push": push["push_s"],
            "pull": start["waited_s"] - push["push_s"],
            "adopt": start["adopt_s"],
        }
        parts["rest"] = start["sync_s"] - sum(parts.values())
        out.append({"round": r, "island": island, "sync_s": start["sync_s"], **parts})
    return out


def run_sync_bench(config: str | Path, overrides: list[str], run_dir: Path, rounds: int) -> dict[str, Any]:
    if rounds < 3:
        raise BenchError(f"bench sync: --rounds must be >= 3 (the first round compiles; got {rounds})")
    with finished_run(config, overrides, run_dir, rounds) as (cfg, fed, summary):
        per_island = {
            name: [e["sync_s"] for e in fed.events("train_start", island=name) if "sync_s" in e][1:]
            for name in fed.names
        }
        steps = [e["compute_s"] / cfg.train.inner_steps for e in fed.events("push") if e.get("compute_s")]
        closes = fed.rounds()[1:]
        checkpoints = [e["seconds"] for e in fed.events("checkpoint")][1:]
        critical = critical_path(
            fed.events("push"),
            {name: fed.events("train_start", island=name) for name in fed.names},
            {name: fed.events("pushed", island=name) for name in fed.names},
        )
    every = [s for values in per_island.values() for s in values]
    return {
        "bench": "sync",
        "param_count": summary["param_count"],
        "islands": cfg.islands.count,
        "H": cfg.train.inner_steps,
        "codec": {"uplink": cfg.codec.uplink, "downlink": cfg.codec.downlink},
        "links": cfg.network.links or None,
        "rounds": rounds,
        "sync_s": _summary(every),
        "sync_s_per_island": {name: _summary(values) for name, values in per_island.items()},
        "critical_sync_s": _summary([c["sync_s"] for c in critical]),
        "critical_parts_median_s": {k: _summary([c[k] for c in critical])["median"] for k in CRITICAL_PARTS},
        "close_median_s": {
            "commit": _summary([e["close_s"]["commit"] for e in closes if "close_s" in e])["median"],
            "eval": _summary([e["close_s"]["eval"] for e in closes if "close_s" in e])["median"],
            "checkpoint": _summary(checkpoints)["median"],
        },
        "inner_step_median_s": _summary(steps)["median"],
        "compute_utilization": summary["compute_utilization"],
        "run_dir": str(run_dir),
    }
