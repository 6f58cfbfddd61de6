"""A run's totals and its summary.json: one type and one writer for `simulate` and the coordinator.

`Totals` is what a run counts as it goes (tokens, bytes, compute time, islands joined and lost, ...). It lives in
the checkpoint's metadata, so a resumed run keeps counting. `summary` turns it into summary.json, whose keys are
exactly `SUMMARY_KEYS` in either mode (README's run-directory contract lists them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco.config import RunConfig
from diloco.run.chunk_ledger import CONSUMPTION_KEYS, Consumption

SUMMARY_KEYS: tuple[str, ...] = (
    "mode",
    "rounds",
    "rounds_planned",
    "inner_steps_per_island",
    "syncs",
    "initial_eval_loss",
    "final_eval_loss",
    "workload",
    "initial_scores",
    "final_scores",
    "tokens",
    "bytes_up",
    "bytes_down",
    "wall_s",
    "compute_utilization",
    "islands_joined",
    "islands_lost",
    "islands_admitted",
    "islands_retired",
    "rejected",
    "param_count",
    "params_digest",
    *CONSUMPTION_KEYS,
    "sequences_by_source",
)


@dataclass
class Totals:
    """Counters of a run; plain JSON values, stored with every checkpoint."""

    rounds: int = 0
    """Rounds committed."""
    syncs: int = 0
    """Synchronisations over the network: one per round for DiLoCo, one per inner step for the sync baseline."""
    tokens: int = 0
    """Tokens trained on, all islands together."""
    bytes_up: int = 0
    """Encoded bytes islands pushed (pseudo-gradients), or a gradient all-reduce's for the sync baseline."""
    bytes_down: int = 0
    """Encoded bytes islands pulled (updates or full parameters)."""
    compute_s: float = 0.0
    """Island seconds spent inside inner steps."""
    island_wall_s: float = 0.0
    """Island wall seconds of the same cycles (train, push, wait for the round, pull, checkpoint)."""
    islands_joined: int = 0
    islands_lost: int = 0
    islands_admitted: int = 0
    """Islands an operator admitted while the run went on (`diloco admit`)."""
    islands_retired: int = 0
    """Islands retired (`diloco retire`, an island's own retirement, or `islands.retire_after_s`)."""
    rejected: int = 0
    """Messages the coordinator refused (bad credentials, config, round, tensors ...)."""
    initial_eval_loss: float | None = None
    final_eval_loss: float | None = None
    initial_scores: dict[str, float] | None = None
    """The post-training workloads' held-out figures of θ_0 (diloco/run/setup.py, `Evaluator.measure`)."""
    final_scores: dict[str, float] | None = None
    """... and of the last committed θ."""

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Totals:
        """Totals stored by `to_meta` (keys a newer diloco added take their defaults)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in meta.items() if k in known})

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compute_utilization(totals: Totals) -> float:
    """Island time inside inner steps / island wall time (docs/architecture.md, "Cost model": H·t_step / T_round).

    The coordinator adds each island's whole cycles as its pushes report them; `simulate`, where the islands take
    turns in one process, adds each island's steps and each round's wall time. 0 before any cycle ended.
    """
    return round(totals.compute_s / totals.island_wall_s, 4) if totals.island_wall_s > 0 else 0.0


def summary(
    cfg: RunConfig,
    totals: Totals,
    *,
    wall_s: float,
    param_count: int,
    params_digest: str,
    consumption: Consumption | None = None,
    by_source: Mapping[str, Consumption] | None = None,
) -> dict[str, Any]:
    """summary.json's contents: exactly SUMMARY_KEYS.

    `consumption` (data.sampling = "chunks"): what the run's `chunks_consumed` records add up to (the sequences
    consumed, repeated, lost and unread, and the epochs) over every source, and `by_source` the same per source
    (`sequences_by_source`: the corpus, data.paths[i], own:<sha256>); None (windows) leaves those keys null: nothing
    is tracked.

    inner_steps_per_island: rounds × H; in the asynchronous mode, where a round is one island's H steps, their mean
    over the islands (a fast island trains more of them than a slow one)."""
    steps = totals.rounds * cfg.train.inner_steps
    out = {
        "mode": cfg.train.mode,
        "rounds": totals.rounds,
        "rounds_planned": cfg.train.rounds,
        "inner_steps_per_island": steps // cfg.islands.count if cfg.train.mode == "async" else steps,
        "syncs": totals.syncs,
        "initial_eval_loss": totals.initial_eval_loss,
        "final_eval_loss": totals.final_eval_loss,
        "workload": cfg.workload.kind,
        "initial_scores": totals.initial_scores,
        "final_scores": totals.final_scores,
        "tokens": totals.tokens,
        "bytes_up": totals.bytes_up,
        "bytes_down": totals.bytes_down,
        "wall_s": round(wall_s, 3),
        "compute_utilization": compute_utilization(totals),
        "islands_joined": totals.islands_joined,
        "islands_lost": totals.islands_lost,
        "islands_admitted": totals.islands_admitted,
        "islands_retired": totals.islands_retired,
        "rejected": totals.rejected,
        "param_count": param_count,
        "params_digest": params_digest,
        **(consumption.summary() if consumption is not None else dict.fromkeys(CONSUMPTION_KEYS)),
        "sequences_by_source": (
            {key: part.summary() for key, part in by_source.items()} if by_source is not None else None
        ),
    }
    assert tuple(out) == SUMMARY_KEYS
    return out
