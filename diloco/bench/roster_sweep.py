"""`diloco bench roster-sweep`: `simulate` of one config under several roster scripts, and what each costs in loss.

The scripts (roster.events; docs/architecture.md, "Churn by script"), placed by the config's train.rounds R and its
configured islands (first and last):
  none     the configured islands every round (the reference)
  join     an admitted island, `joiner`, from round R/3 on
  retire   the last configured island retired at round R/2
  kill     the first configured island killed at round R/3 (back one round later, from its checkpoint)
  churn    all three: the join at R/3, the kill at R/2, the retirement at 2R/3
Each runs afresh in RUN_DIR/NAME. Reported (JSON), per script: its events, the final eval loss and its difference
from `none`'s, the parameter digest, and under data.sampling = "chunks" the sequences repeated and lost (0 and 0:
exactly once whoever joins and leaves).

Run: ``diloco bench roster-sweep CONFIG [--run-dir DIR] [key=value ...]``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from diloco.bench.errors import BenchError
from diloco.config import RunConfig
from diloco.run.roster_script import RosterConfig, RosterEvent
from diloco.simulator.simulate import run_simulation

JOINER = "joiner"
"""The admitted island's name in the scripts that join one."""


def scripts(cfg: RunConfig) -> dict[str, tuple[RosterEvent, ...]]:
    """The sweep's scripts for `cfg` (module docstring); those it cannot run (one island, too few rounds) left out."""
    rounds, names = cfg.train.rounds, cfg.islands.island_names
    first, last = names[0], names[-1]
    join = RosterEvent(round=rounds // 3, join=JOINER)
    out: dict[str, tuple[RosterEvent, ...]] = {"none": ()}
    if rounds < 4:
        return out
    out["join"] = (join,)
    if len(names) > 1:
        out["retire"] = (RosterEvent(round=rounds // 2, retire=last),)
    out["kill"] = (RosterEvent(round=rounds // 3, kill=first),)
    if len(names) > 1 and rounds >= 6:
        kill, retire = RosterEvent(round=rounds // 2, kill=first), RosterEvent(round=2 * rounds // 3, retire=last)
        out["churn"] = (join, kill, retire)
    return out


def run_roster_sweep(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    if run_dir.exists() and any(run_dir.iterdir()):
        raise BenchError(f"bench roster-sweep runs afresh: {run_dir} is not empty")
    islands = replace(cfg.islands, max=max(cfg.islands.max, cfg.islands.count + 1))
    results: dict[str, Any] = {}
    for name, events in scripts(cfg).items():
        try:
            run = replace(cfg, islands=islands, roster=RosterConfig(events=events))
        except ValueError as exc:
            raise BenchError(f"bench roster-sweep, script {name}: {exc}") from None
        summary = run_simulation(run, run_dir / name, show_progress=False)
        results[name] = {
            "events": [{"round": e.round, e.kind: e.island} for e in events],
            "final_eval_loss": summary["final_eval_loss"],
            "params_digest": summary["params_digest"],
            "sequences_repeated": summary["sequences_repeated"],
            "sequences_lost": summary["sequences_lost"],
            "islands_admitted": summary["islands_admitted"],
            "islands_retired": summary["islands_retired"],
        }
    reference = results["none"]["final_eval_loss"]
    for result in results.values():
        result["vs_none"] = round(result["final_eval_loss"] - reference, 6)
    return {"bench": "roster-sweep", "config": cfg.run.name, "rounds": cfg.train.rounds, "scripts": results}
