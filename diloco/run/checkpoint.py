"""Checkpoints with orbax: one directory per owner (the coordinator, each island), one writer each.

orbax writes each step into a temporary directory and renames it when complete, so a process killed mid-save
leaves the previous step restorable; the next store opened on the directory removes that temporary one.
`latest_common_step` finds the newest step that every owner finished, which is where a run that checkpoints several
owners per round resumes.

States are saved as the pytrees they are (`save_state` / `restore_state`): `GlobalState` (diloco/run/rounds.py) and
`IslandState` (islands/island.py) are registered dataclasses whose array fields go to orbax and whose static
fields (host ints: round, step, data cursor) go to the JSON metadata beside them. A restore reads into a freshly
built state of the same run (`like`), which fixes structure, dtypes and shardings. So adding a field to either
state touches only the dataclass; this module needs no change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import shutil
import uuid
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from diloco.run.rundir import DiskFullError
from pytrees.naming import PyTree

State = TypeVar("State")
_HOST = "state_host_fields"
_TRASH = ".replaced-"  # not a step name to orbax (hidden, not a number)


SPACE_MARGIN = 1.5
"""A step takes about its arrays' bytes on disk (OCDBT stores them raw) plus metadata; the margin covers the
metadata, the JSON and a state whose arrays grow (a residual appearing), so a save that passes the check fits."""
SPACE_SLACK = 1 << 20
"""Bytes every save needs beyond its arrays (orbax's metadata files, the manifest, the JSON)."""

WRITE_WINDOW = 256 * 10**6
"""The bytes orbax may be writing at once (its `save_concurrent_gb`), raised to the state's largest array where that
is larger (orbax refuses an array larger than its window). With orbax's default (96 GB: the whole state at once) its
write buffers held about 0.8 of a state made of many arrays of a few MB, beside the state and, in an island, the copy
of it saved while the island trains on (BENCHMARKS.md, "Bigger on one host")."""

_STORES: weakref.WeakSet[CheckpointStore] = weakref.WeakSet()
"""Every open store of this process: their saves in flight count against the free space of the next one."""


def state_nbytes(state: PyTree) -> int:
    """The bytes of a state's arrays (host or device): what a checkpoint of it writes, before metadata."""
    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(state))


def is_out_of_space(exc: BaseException) -> bool:
    """orbax reports a full disk as ValueError("RESOURCE_EXHAUSTED: ... No space left on device ...") from its write
    threads; plain writes raise OSError(ENOSPC)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    return "No space left on device" in str(exc) or "os_error_code='28'" in str(exc)


class CheckpointStore:
    def __init__(self, directory: Path, max_to_keep: int = 3) -> None:
        self.directory = directory.absolute()
        self._pending_bytes, self._pending_step = 0, -1
        self._discards = 0
        """Steps replaced so far: names the barrier of the next one (each barrier name is used once)."""
        """What the save in flight (if any) will have written, reserved against the free space, and its step."""
        for leftover in self.directory.glob(f"{_TRASH}*"):  # a replaced step whose removal a kill interrupted
            shutil.rmtree(leftover, ignore_errors=True)
        self._max_to_keep = max_to_keep
        self._window = WRITE_WINDOW
        self._manager = self._open(self._window)
        _STORES.add(self)

    def _open(self, window: int) -> ocp.CheckpointManager:
        """orbax's manager of this directory, writing at most `window` bytes at once (`WRITE_WINDOW`; a MiB more,
        as orbax takes the window in GB, a float, and refuses an array of exactly its bytes)."""
        return ocp.CheckpointManager(
            self.directory,
            # A process killed mid-save leaves its step's temporary directory: removed here, or a run whose islands
            # are killed and restarted fills its disk with them (BENCHMARKS.md, "Churn soak").
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self._max_to_keep, create=True, cleanup_tmp_directories=True
            ),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(save_concurrent_gb=(window + (1 << 20)) / 10**9),  # type: ignore[arg-type]
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def _fit_window(self, state: PyTree) -> None:
        """Widen the write window to the state's largest array (once the saves in flight are done)."""
        window = max(WRITE_WINDOW, max((state_nbytes(leaf) for leaf in jax.tree.leaves(state)), default=0))
        if window > self._window:
            self.wait()
            self._manager.close()
            self._window, self._manager = window, self._open(window)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: PyTree, meta: dict[str, Any]) -> None:
        """Start saving (asynchronously after the device-to-host copy); `wait()` before relying on it.

        A step saved before is replaced: orbax would silently keep the old one, and an owner saves a step again
        only when it went back (an island resynced behind a restarted coordinator, a resumed run), so the old one
        holds a state that no longer exists. The old step leaves by one rename (orbax's delete is a recursive
        removal: a kill in the middle of it leaves a step with its arrays and no metadata), so a kill at
        any point leaves either the old step whole or none of it, and the older steps."""
        if step in self._manager.all_steps():
            self.wait()
            self._discard(step)
        self._fit_window(state)
        need = int(state_nbytes(state) * SPACE_MARGIN) + SPACE_SLACK
        self._check_space(step, need)
        self._pending_bytes, self._pending_step = need, step
        with self._disk_errors(step):
            self._manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            )

    def _check_space(self, step: int, need: int) -> None:
        """Refuse, before writing anything, a save that would not fit beside the saves still in flight (so that a
        full disk never leaves orbax's write threads failing one tensor after another)."""
        in_flight = sum(s._pending_bytes for s in list(_STORES) if s._manager.is_saving_in_progress())
        self.directory.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.directory).free
        if free < need + in_flight:
            raise DiskFullError(self._full(step, f"needs about {_mb(need + in_flight)}, {_mb(free)} free there"))

    def _full(self, step: int, how_much: str) -> str:
        return (
            f"no disk space for checkpoint {step} in {self.directory} ({how_much}); free some space or use a "
            "--run-dir on a larger disk, then run the same command again: it resumes from the last complete checkpoint"
        )

    @contextlib.contextmanager
    def _disk_errors(self, step: int) -> Iterator[None]:
        """A write that failed for want of space (another process filled the disk meanwhile) is the same one line."""
        try:
            yield
        except Exception as exc:
            if not is_out_of_space(exc):
                raise
            raise DiskFullError(self._full(step, "the disk filled up while it was written")) from None

    def _discard(self, step: int) -> None:
        old = self.directory / str(step)
        trash = self.directory / f"{_TRASH}{step}-{uuid.uuid4().hex}"
        if jax.process_index() == 0:  # a multi-process island's checkpoint is one directory: its process 0 renames
            old.rename(trash)  # atomic: from here orbax no longer sees the step
        if jax.process_count() > 1:  # the others reload once the rename is done (JAX's coordination barrier)
            ocp.multihost.sync_global_processes(f"diloco_discard_{step}_{self._discards}")
            self._discards += 1
        self._manager.reload()
        shutil.rmtree(trash, ignore_errors=True)

    def restore(self, step: int, like: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Restore `step` into the structure, dtypes and shardings of `like`."""
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like), meta=ocp.args.JsonRestore())
        )
        return restored.state, dict(restored.meta)

    def wait(self) -> None:
        with self._disk_errors(self._pending_step):
            self._manager.wait_until_finished()
        self._pending_bytes = 0

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()
            _STORES.discard(self)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


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
