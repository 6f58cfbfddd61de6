"""Where a commit lands on a curve's x axis, in inner steps per island (diloco/ops/plot.py's module docstring).

Commit s = round·P + fragment lands at (s + 1)·H/P (P = stream.fragments); in train.mode "async" a round is one
island's update, so update u lands at (u + 1)·H/islands.count. Shared by `diloco plot` and the TensorBoard observer
(diloco/ops/tensorboard.py), so that a curve has the same x in a PNG and in TensorBoard; read from the run directory's
events, below both of them and below the run directory itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diloco.config import RunConfig


def steps_per_commit(cfg: RunConfig) -> float:
    """Inner steps per island from one commit to the next: H / P, or in async mode H / islands.count."""
    return cfg.train.inner_steps / (cfg.islands.count if cfg.train.mode == "async" else cfg.stream.fragments)


def commit_position(event: str, fields: Mapping[str, Any], fragments: int) -> int:
    """The sync position s = round·P + fragment of a `round`, `sync` or `push` event; a `round` event without a
    `fragment` is its round's last commit, any other event without one has fragment 0 (P = 1 logs none)."""
    last_fragment = fragments - 1 if event == "round" else 0
    return int(fields["round"]) * fragments + int(fields.get("fragment", last_fragment))
