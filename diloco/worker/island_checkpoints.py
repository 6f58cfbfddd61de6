"""An island's own checkpoints: its state at the global copy's round boundaries, saved in the background, one save
after the other, and the newest restored when the island starts again.

What is saved is the island's `IslandState` with the round it belongs to. Without streaming its params are the global
ones; with streaming they mix fragments, so a resumed streaming island restarts from the full θ (it keeps its inner
optimizer state, residual and data cursor). A kill mid-save leaves the previous step restorable
(diloco/run/checkpoint.py). A multi-process island saves in step with its followers, on the training thread
(diloco/worker/island_group.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from diloco.run.checkpoint import CheckpointStore, save_state
from diloco.worker.island_group import LeaderIsland, restore_checkpoint
from floor.errors import WaitedTooLong
from islands.island import Island, IslandState

SAVE_WAIT_S = 300.0
"""The longest a leaving island waits for its last save (`close`): one that takes longer is stuck (a hung disk), and
the island exits with one line rather than hang; the checkpoint before it is intact."""


class IslandCheckpoints:
    """The checkpoints of one island's state in `store` (None: the run keeps none)."""

    def __init__(self, store: CheckpointStore | None, island: Island | LeaderIsland) -> None:
        self.store, self.island = store, island
        self._saves = ThreadPoolExecutor(max_workers=1, thread_name_prefix="save")
        """Saves run here, in order: orbax's blocking part would otherwise stall the next round. Not a daemon: the
        island waits for its last save before it leaves anyway (`close`)."""
        self._saving: Future[None] | None = None
        """The newest save submitted."""

    def latest(self) -> int | None:
        """The newest checkpoint's step, or None when there is none."""
        steps = self.store.steps() if self.store else []
        return steps[-1] if steps else None

    def restore(self, step: int) -> tuple[IslandState, dict[str, Any]]:
        """Continue the (started) island from checkpoint `step`; returns the state read and its metadata."""
        assert self.store is not None
        if isinstance(self.island, LeaderIsland):
            return self.island.restore_checkpoint(self.store, step)
        return restore_checkpoint(self.store, self.island, step)

    def save(self, round_: int, **meta: Any) -> None:
        """The island's state now, as the checkpoint of `round_` (with `meta` beside it: data.sampling = "chunks"
        saves the chunk spans the island read). A save that failed before (disk full, permissions) stops the island
        here, with its error."""
        self._raise_failed()
        if self.store is not None and isinstance(self.island, LeaderIsland):
            # In step with the followers (diloco/worker/island_group.py).
            self.island.save_checkpoint(self.store, round_)
        elif self.store is not None:
            # A copy: the next inner step donates the state's buffers to XLA (islands/inner.py), deleting them.
            state = jax.tree.map(jnp.copy, self.island.state)
            self._saving = self._saves.submit(partial(save_state, self.store, round_, state, {"round": round_, **meta}))

    def close(self) -> None:
        """Let the last save finish (its error, if any, is raised by `check`; at most SAVE_WAIT_S), then close the
        store."""
        if self._saving is not None:
            try:
                self._saving.exception(timeout=SAVE_WAIT_S)
            except FutureTimeout:
                raise WaitedTooLong(f"the island's last checkpoint was not written within {SAVE_WAIT_S:g} s") from None
        self._saves.shutdown(wait=True)
        if self.store is not None:
            self.store.close()

    def check(self) -> None:
        """Raise the error of the last save, if it failed."""
        if self._saving is not None:
            self._saving.result()

    def _raise_failed(self) -> None:
        if self._saving is not None and self._saving.done():
            self._saving.result()
