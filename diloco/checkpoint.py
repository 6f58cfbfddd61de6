"""Checkpoints with orbax: one directory per owner (the coordinator, each island), one writer each.

orbax writes each step into a temporary directory and renames it when complete, so a process killed mid-save
leaves the previous step restorable. `latest_common_step` finds the newest step that every owner finished,
which is where a run that checkpoints several owners per round resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

PyTree = Any


class CheckpointStore:
    def __init__(self, directory: Path, max_to_keep: int = 3) -> None:
        self.directory = directory.absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: PyTree, meta: dict[str, Any]) -> None:
        """Start saving (asynchronously after the device-to-host copy); `wait()` before relying on it."""
        self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )

    def restore(self, step: int, like: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Restore `step` into the structure, dtypes and shardings of `like`."""
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like), meta=ocp.args.JsonRestore())
        )
        return restored.state, dict(restored.meta)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def latest_common_step(stores: Sequence[CheckpointStore]) -> int | None:
    common = set(stores[0].steps())
    for store in stores[1:]:
        common &= set(store.steps())
    return max(common) if common else None
