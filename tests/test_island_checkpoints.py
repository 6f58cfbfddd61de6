"""An island's own checkpoints (diloco/worker/island_checkpoints.py), against a store in memory: saved in order, in the
background, and a failed save stops the island at its next save or its end."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import jax.numpy as jnp
import pytest

from diloco.worker.island_checkpoints import IslandCheckpoints
from islands.island import IslandState


class Store:
    """What IslandCheckpoints asks of a CheckpointStore; `fail_at`: the step whose save raises."""

    def __init__(self, steps: list[int] | None = None, fail_at: int | None = None) -> None:
        self.saved: list[tuple[int, dict, str]] = []
        self.existing, self.fail_at, self.closed = list(steps or []), fail_at, False

    def save(self, step: int, arrays: dict, meta: dict[str, Any]) -> None:
        if step == self.fail_at:
            raise OSError("disk full")
        self.saved.append((step, meta, threading.current_thread().name))

    def steps(self) -> list[int]:
        return self.existing

    def close(self) -> None:
        self.closed = True


def island() -> Any:
    state = IslandState(params={"w": jnp.ones(2)}, inner_opt_state={"m": jnp.zeros(2)}, step=7, data_cursor=3)
    return SimpleNamespace(state=state)


def test_saves_run_in_order_off_the_training_thread_and_the_end_waits_for_them() -> None:
    store = Store()
    checkpoints = IslandCheckpoints(store, island())  # type: ignore[arg-type]
    for r in range(4):
        checkpoints.save(r)
    checkpoints.close()
    checkpoints.check()
    assert [(step, meta["round"]) for step, meta, _ in store.saved] == [(r, r) for r in range(4)]
    assert all(thread.startswith("save") for _, _, thread in store.saved)
    assert store.closed


def test_a_failed_save_stops_the_island_at_its_next_save_or_at_its_end() -> None:
    store = Store(fail_at=1)
    checkpoints = IslandCheckpoints(store, island())  # type: ignore[arg-type]
    checkpoints.save(0)
    checkpoints.save(1)
    checkpoints._saving.exception(timeout=30)  # type: ignore[union-attr]  # the failed save is done
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(2)
    checkpoints.close()
    with pytest.raises(OSError, match="disk full"):
        checkpoints.check()


@pytest.mark.parametrize(("store", "latest"), [(None, None), (Store(), None), (Store([2, 5]), 5)])
def test_the_newest_checkpoint(store: Store | None, latest: int | None) -> None:
    checkpoints = IslandCheckpoints(store, island())  # type: ignore[arg-type]
    assert checkpoints.latest() == latest
    checkpoints.save(0)  # without a store: nothing to save
    checkpoints.close()
    assert store is None or len(store.saved) == 1
