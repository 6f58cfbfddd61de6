"""Checkpoints with orbax: one directory per owner (the coordinator, each island), one writer each.

orbax writes each step into a temporary directory and renames it when complete, so a process killed mid-save
leaves the previous step restorable. `latest_common_step` finds the newest step that every owner finished,
which is where a run that checkpoints several owners per round resumes.

States are saved as the pytrees they are (`save_state` / `restore_state`): `GlobalState` (diloco/rounds.py) and
`IslandState` (islands/island.py) are registered dataclasses whose array fields go to orbax and whose static
fields (host ints: round, step, data cursor) go to the JSON metadata beside them. A restore reads into a freshly
built state of the same run (`like`), which fixes structure, dtypes and shardings. So adding a field to either
state touches only the dataclass; this module needs no change.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import orbax.checkpoint as ocp

from transport.codecs import PyTree

State = TypeVar("State")
_HOST = "state_host_fields"
_TRASH = ".replaced-"  # not a step name to orbax (hidden, not a number)


class CheckpointStore:
    def __init__(self, directory: Path, max_to_keep: int = 3) -> None:
        self.directory = directory.absolute()
        for leftover in self.directory.glob(f"{_TRASH}*"):  # a replaced step whose removal a kill interrupted
            shutil.rmtree(leftover, ignore_errors=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: PyTree, meta: dict[str, Any]) -> None:
        """Start saving (asynchronously after the device-to-host copy); `wait()` before relying on it.

        A step saved before is replaced: orbax would silently keep the old one, and an owner saves a step again
        only when it went back (an island resynced behind a restarted coordinator, a resumed run), so the old one
        holds a state that no longer exists. The old step leaves by one rename (orbax's delete is a recursive
        removal: a kill in the middle of it left a step with its arrays and no metadata, seen in CI), so a kill at
        any point leaves either the old step whole or none of it, and the older steps."""
        if step in self._manager.all_steps():
            self._manager.wait_until_finished()
            self._discard(step)
        self._manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )

    def _discard(self, step: int) -> None:
        old = self.directory / str(step)
        trash = self.directory / f"{_TRASH}{step}-{uuid.uuid4().hex}"
        old.rename(trash)  # atomic: from here orbax no longer sees the step
        self._manager.reload()
        shutil.rmtree(trash, ignore_errors=True)

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


def _is_static(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("static"))


def save_state(store: CheckpointStore, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Save a registered-dataclass state: arrays through orbax, host fields with `meta` (fields that are None, such
    as a lossless codec's residual, are absent: a restore of the same run expects them absent too)."""
    fields = dataclasses.fields(state)
    host = {f.name: getattr(state, f.name) for f in fields if _is_static(f)}
    arrays = {f.name: getattr(state, f.name) for f in fields if not _is_static(f)}
    store.save(step, {k: v for k, v in arrays.items() if v is not None}, {**meta, _HOST: host})


def restore_state(store: CheckpointStore, step: int, like: State) -> tuple[State, dict[str, Any]]:
    """The state saved at `step`, read into the structure and layouts of `like`, and the caller's metadata."""
    template = {f.name: getattr(like, f.name) for f in dataclasses.fields(like) if not _is_static(f)}
    arrays, meta = store.restore(step, {k: v for k, v in template.items() if v is not None})
    host = meta.pop(_HOST)
    return dataclasses.replace(like, **{**template, **arrays, **host}), meta  # type: ignore[type-var]
