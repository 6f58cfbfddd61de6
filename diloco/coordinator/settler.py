"""The settler: what follows a commit, off the islands' path (docs/architecture.md, "Commits off the critical path").

The coordinator serves θ_{s+1} as soon as the outer step made it. Its evaluation, its `round` event and its
checkpoint follow here, on one thread, in commit order: evaluate (without the lock), keep or undo (with the lock,
through the coordinator's ``keep`` callback), save when due (without the lock). An undone commit undoes every later
one, so those are skipped (`undone` bumps the generation they were queued in).

Before evaluating, the settler yields to the commit's islands (`EVAL_YIELD_S` at most): the evaluation is the
coordinator's lowest-priority work, nobody waits for it while every contributor waits for its commit, and on a host
whose cores the islands share it would take the CPU from the pulls it overlaps.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diloco import faults
from diloco.run.global_run import GlobalRun, Settling
from diloco.run.rundir import DiskFullError
from floor.errors import WaitedTooLong

EVAL_YIELD_S = 2.0
"""The longest a commit's evaluation waits for the islands that contributed to it to be done with it: long enough
for a pull of a large model over a slow link to be out of the way, short enough that an island that died before
pulling delays the evaluation (and the checkpoint behind it) only a little."""

SETTLE_WAIT_S = 300.0
"""The longest a stopping coordinator waits for its commits to be evaluated and checkpointed (`flush`, `close`):
a save that takes longer is stuck (a hung disk), and the coordinator exits with one line rather than hang; its
last complete checkpoint is intact."""


@dataclass(frozen=True)
class Job:
    """A commit to settle, with what its undoing restores (``restore``: the admission's snapshot)."""

    generation: int
    pending: Settling
    restore: Any


Keep = Callable[[Job, float], "dict | None"]
"""``keep(job, eval_loss)``, called with the lock held: record the commit and return its checkpoint metadata when a
save is due (else None); or undo it (calling `Settler.undone`) and return None."""


class Settler:
    """Settles commits on a thread of its own, in order; counts what is unsettled for `settled` and `flush`."""

    def __init__(
        self, cond: threading.Condition, world: GlobalRun, keep: Keep, islands_done: Callable[[Settling], bool]
    ) -> None:
        """``islands_done(pending)`` (called with the lock held): every island of the commit is done with it."""
        self.cond = cond
        self.world = world
        self.keep = keep
        self.islands_done = islands_done
        self.generation = 0
        """Bumped by an undo: commits queued before it were undone and are not settled."""
        self.stopping = False
        """Set by `hurry`: commits are settled at once, without yielding to their islands."""
        self.unsettled = 0
        self.failure: DiskFullError | None = None
        """Set when a checkpoint could not be written (no disk space): `serve` stops the run with it."""
        self.unsaved: tuple[Settling, dict] | None = None
        """The last kept commit that closed a round, with its checkpoint metadata, while its save was not due
        (train.checkpoint_every > 1): what `flush` saves on a graceful stop."""
        self._queue: queue.Queue[Job | None] = queue.Queue()
        threading.Thread(target=self._run, name="settle", daemon=True).start()

    def enqueue(self, pending: Settling, restore: Any) -> None:
        """A commit to settle (called with the lock held)."""
        self._queue.put(Job(self.generation, pending, restore))
        self.unsettled += 1

    def undone(self) -> None:
        """The commit being kept was undone, with every later one (called by ``keep``, lock held)."""
        self.generation += 1
        self.unsaved = None  # an older round's state: its own save (if due) happened when it was kept

    def hurry(self) -> None:
        """Stopping: settle every commit now, without waiting for its islands."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def settled(self, timeout_s: float | None = None) -> bool:
        """Wait until every commit so far is evaluated, logged and checkpointed (or undone); False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: self.unsettled == 0, timeout=timeout_s)

    def flush(self) -> None:
        """A graceful stop: once every commit is settled, checkpoint the last committed round if its save was not
        due, so that a restart resumes exactly where this process stopped."""
        self._settle_all()
        if self.unsaved is not None and self.world.store is not None:
            self.world.save(*self.unsaved)
            self.unsaved = None

    def close(self) -> None:
        self._queue.put(None)  # the thread ends after the commits queued before
        self._settle_all()

    def _settle_all(self) -> None:
        """Settle every commit queued now, without waiting for its islands; at most SETTLE_WAIT_S."""
        self.hurry()
        if not self.settled(SETTLE_WAIT_S):
            raise WaitedTooLong(
                f"{self.unsettled} commit(s) were not evaluated and checkpointed within {SETTLE_WAIT_S:g} s "
                "(a stuck checkpoint write?); the last complete checkpoint is intact"
            )

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._settle(job)
            except DiskFullError as exc:  # the run cannot go on durably: `serve` stops with this one line
                self.failure = exc
            finally:
                with self.cond:
                    self.unsettled -= 1
                    self.cond.notify_all()

    def _settle(self, job: Job) -> None:
        faults.at(faults.COORDINATOR, "after_commit", job.pending.commit.round)
        current = job.generation == self.generation
        if current:
            self._yield_to_islands(job.pending)
        eval_loss = self.world.evaluate_commit(job.pending) if current else math.nan
        with self.cond:
            if job.generation != self.generation:
                return
            meta = self.keep(job, eval_loss)
            if job.generation == self.generation and job.pending.round_closed:  # kept: saved now, or by `flush`
                self.unsaved = None if meta is not None else (job.pending, self.world.checkpoint_meta())
        if meta is not None:
            self.world.save(job.pending, meta)

    def _yield_to_islands(self, pending: Settling) -> None:
        """Wait, at most EVAL_YIELD_S, until every island of the commit is done with it, unless a later commit is
        queued (the settler must not fall behind), the commit is the run's last (its islands stop), or the
        coordinator is stopping."""

        def ready() -> bool:
            if self.stopping or self.world.done or not self._queue.empty():
                return True
            return self.islands_done(pending)

        with self.cond:
            self.cond.wait_for(ready, timeout=EVAL_YIELD_S)
