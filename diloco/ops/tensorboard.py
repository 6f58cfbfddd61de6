"""TensorBoard curves of a run (`run.tensorboard = true`): RUN_DIR/tensorboard/, fed from metrics.jsonl's events.

The writer is one of `RunDir.observers`, so every scalar it writes is a field of an event that metrics.jsonl holds
too: the two can never disagree, and no training code knows TensorBoard exists. Each process writes its own run
directory's curves: `simulate` and the coordinator the global model's (and, in `simulate`, every island's inner
loss), an island process its own inner loss (`diloco launch` puts those in RUN/islands/NAME/tensorboard/, so
`tensorboard --logdir RUN` shows them all).

    event          tag                              x
    eval           global/eval_loss                 0 (θ_0)
    round, sync    global/{eval_loss, loss, tokens, bytes_up, bytes_down, seconds}
                                                    the commit's inner steps per island
    eval, round    scores/FIGURE                    as above: post-training's held-out figures (`scores`: sft_ce,
                                                    dpo_accuracy, rl_reward, ...)
    inner          island/NAME/{loss, reward, kl,   the island's inner step
                   accuracy}                        (the last three: a post-training workload's, where it has them)
    push           island/NAME/{compute_s, wall_s}  the inner steps per island of the commit it joins

x is one unit everywhere, inner steps per island, so the global and the island curves share an axis: commit
s = round·P + fragment lands at (s + 1)·H/P (`diloco.run.positions.steps_per_commit`, as `diloco plot --x steps` draws
it); in train.mode "async" update u counts as (u + 1)·H/islands.count, rounded to a whole step. NAME is one of the
config's islands.names (or "sync", the data-parallel baseline's one model): a name an event carries that the
config does not know is skipped, never turned into a tag.

A resumed process reruns what its checkpoint did not hold; its new event file starts with a purge marker at the
first step it reruns, so TensorBoard hides the old points from there on instead of drawing both (exact for
synchronous runs; in async mode the islands' own step counts interleave with the updates, so there it is close).

tensorboardX is an optional dependency (the `tensorboard` extra): it is imported when a run asks for curves, and
its absence is one line at startup, not a traceback half-way through a run.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diloco.config import RunConfig
from diloco.run.positions import commit_position, steps_per_commit
from floor.errors import UserError
from islands.workloads.config import STEP_FIGURE_NAMES

INSTALL_HINT = "run.tensorboard = true needs tensorboardX, which is not installed: pip install 'diloco[tensorboard]'"
GLOBAL_FIELDS = ("eval_loss", "loss", "tokens", "bytes_up", "bytes_down", "seconds")
"""The fields of a `round` or `sync` event written as global/FIELD."""
PUSH_FIELDS = ("compute_s", "wall_s")
"""The fields of a `push` event written as island/NAME/FIELD."""
SYNC_BASELINE = "sync"
"""The island name of train.mode = "sync"'s `inner` events: the baseline's one model, not one of islands.names."""


class TensorBoardError(UserError):
    """run.tensorboard is on but tensorboardX is missing: one line naming the extra, exit code 2."""


class TensorBoardWriter:
    """An observer of one RunDir's events that writes their scalars to event files under `logdir`.

    The SummaryWriter is opened at the first scalar, not here: a `resumed` event comes before any scalar of a
    resumed process, and the purge marker it calls for is written when the event file is opened. Observers are
    called from several threads (an island's wire thread, the coordinator's settle thread), hence the lock.
    """

    def __init__(self, cfg: RunConfig, logdir: Path) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise TensorBoardError(INSTALL_HINT) from None
        self._summary_writer = SummaryWriter
        self.logdir = logdir
        self.names = frozenset(cfg.islands.island_names) | ({SYNC_BASELINE} if cfg.train.mode == "sync" else set())
        self.fragments = cfg.stream.fragments
        self.per_commit = steps_per_commit(cfg)
        self._writer: Any = None
        self._purge_step: int | None = None
        self._closed = False
        self._lock = threading.Lock()

    def observe(self, event: str, fields: dict[str, Any]) -> None:
        """`RunDir.observers`' signature: write the scalars of one event (most events have none)."""
        if event == "resumed":
            self._resumed(fields)
            return
        scalars = self.scalars(event, fields)
        if not scalars:
            return
        with self._lock:
            if self._closed:  # a straggling thread's event after close: tensorboardX would open a new file for it
                return
            writer = self._open()
            for tag, value, step in scalars:
                writer.add_scalar(tag, value, global_step=step)

    def scalars(self, event: str, fields: Mapping[str, Any]) -> list[tuple[str, float, int]]:
        """(tag, value, step) of every scalar `event` carries: the module docstring's table, in pure form."""
        if event == "eval":
            step = _whole(fields.get("step", 0))
            return _numbers("global", fields, ("eval_loss",), step) + _scores(fields, step)
        if event in ("round", "sync") and _whole(fields.get("round")) is not None:
            step = self.commit_step(event, fields)
            return _numbers("global", fields, GLOBAL_FIELDS, step) + _scores(fields, step)
        island = fields.get("island")
        if island not in self.names:
            return []
        if event == "inner":
            return _numbers(f"island/{island}", fields, ("loss", *STEP_FIGURE_NAMES), _whole(fields.get("step")))
        if event == "push" and _whole(fields.get("round")) is not None:
            return _numbers(f"island/{island}", fields, PUSH_FIELDS, self.commit_step(event, fields))
        return []

    def commit_step(self, event: str, fields: Mapping[str, Any]) -> int:
        """The x of a commit (or a push into one): inner steps per island when it lands."""
        return _round_half_up((commit_position(event, fields, self.fragments) + 1) * self.per_commit)

    def _resumed(self, fields: Mapping[str, Any]) -> None:
        """Purge from the first step the resumed process reruns: after an island's checkpointed `step`, or after
        the last commit of the `round`s the coordinator's checkpoint holds."""
        step, rounds = _whole(fields.get("step")), _whole(fields.get("round"))
        if step is not None:
            first = step + 1
        elif rounds is not None:
            first = _round_half_up(rounds * self.fragments * self.per_commit) + 1
        else:
            return
        with self._lock:
            if self._writer is not None:  # not expected (scalars before `resumed`), but then a new file it is
                self._writer.close()
                self._writer = None
            self._purge_step = first

    def _open(self) -> Any:
        if self._writer is None:
            self._writer = self._summary_writer(str(self.logdir), purge_step=self._purge_step, flush_secs=10)
        return self._writer

    def close(self) -> None:
        """Flush and close the event file (RunDir.close): a finished run's curves are complete on disk."""
        with self._lock:
            self._closed = True
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def open_tensorboard(cfg: RunConfig, run_dir: Path) -> TensorBoardWriter | None:
    """RUN_DIR/tensorboard's writer when run.tensorboard is on, else None; TensorBoardError without tensorboardX."""
    return TensorBoardWriter(cfg, run_dir / "tensorboard") if cfg.run.tensorboard else None


def _numbers(
    prefix: str, fields: Mapping[str, Any], keys: tuple[str, ...], step: int | None
) -> list[tuple[str, float, int]]:
    """PREFIX/KEY scalars of the `keys` that hold numbers (a null loss, a missing field: no point), at `step`."""
    if step is None:
        return []
    out = []
    for key in keys:
        value = fields.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out.append((f"{prefix}/{key}", float(value), step))
    return out


def _scores(fields: Mapping[str, Any], step: int | None) -> list[tuple[str, float, int]]:
    """scores/FIGURE scalars of an event's `scores` (post-training's held-out figures), if it has them."""
    scores = fields.get("scores")
    return _numbers("scores", scores, tuple(sorted(scores)), step) if isinstance(scores, Mapping) else []


def _whole(value: Any) -> int | None:
    """An int field as an int (a bool, a float or a string is not a step or a round)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _round_half_up(x: float) -> int:
    """Nearest whole step, halves up: monotone and, unlike round()'s halves-to-even, never maps x and x + 1 to one
    step, so commits at least one step apart stay apart."""
    return int(math.floor(x + 0.5))
