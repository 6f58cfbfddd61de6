"""Will a step fit in memory? Sized before it runs, from what XLA compiled, so that a batch or a model too big for the
machine is one line naming the knobs (exit code 2), not a RESOURCE_EXHAUSTED traceback once the setup is done, nor a
host that swaps itself to a halt.

    need  = what the compiled program uses on each device (`Compiled.memory_analysis()`): its arguments (the state it
            is given and the batch), its outputs not written over its donated inputs, its temporaries (activations,
            gradients) and its code; times the devices that share one memory (on CPU every device of the mesh
            is the host's memory; a GPU or TPU has its own)
    room  = what is free now: a GPU's or TPU's `memory_stats()` bytes_limit minus bytes_in_use (the least of the
            mesh's devices); on CPU the host's MemAvailable (/proc/meminfo), bounded by the cgroup's limit where one is
            set, else the host's physical memory

"Free now" counts what is already held: in `simulate` the other islands' states and the global model are allocated
when an island first trains, so islands that coexist in one process are charged for each other without knowing how
many there are. Where XLA or the device cannot say (a backend without memory analysis, a device without
memory_stats), there is no check: never a refusal on a guess.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from floor.errors import UserError

GB = 10**9


class OutOfMemoryError(UserError):
    """One step would not fit in the device's (or on CPU the host's) memory: a setting to change, so a user error
    (one line, exit code 2, never restarted by the island supervisor)."""


@dataclass(frozen=True)
class Footprint:
    """The bytes one compiled program uses on each of its devices (XLA's `CompiledMemoryStats`)."""

    arguments: int
    outputs: int
    aliased: int
    """Output bytes written over donated arguments: counted once, as arguments."""
    temp: int
    code: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temp + self.code

    @classmethod
    def of(cls, compiled: Any) -> Footprint | None:
        """From a `jax.stages.Compiled`; None when the backend does not analyse memory."""
        try:
            stats = compiled.memory_analysis()
        except Exception:  # not implemented on this backend (it raises, or returns None): no check
            return None
        if stats is None:
            return None
        try:
            return cls(
                arguments=int(stats.argument_size_in_bytes),
                outputs=int(stats.output_size_in_bytes),
                aliased=int(stats.alias_size_in_bytes),
                temp=int(stats.temp_size_in_bytes),
                code=int(stats.generated_code_size_in_bytes),
            )
        except (AttributeError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Room:
    """The memory a program's devices can still use."""

    free: int
    """Bytes free in the one memory (the host's, or the fullest device's)."""
    text: str
    """How the message says it, e.g. "the host has 21.3 GB available"."""
    sharers: int = 1
    """Devices of the program whose memory is this one (on CPU all of the mesh's: they are the host's threads)."""


def format_bytes(n: float) -> str:
    """Decimal units, about 3 significant digits: "312 GB", "21.3 GB", "850 MB", "4.20 kB"."""
    for unit, size in (("TB", 10**12), ("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            value = n / size
            return f"{value:.{0 if value >= 100 else 1 if value >= 10 else 2}f} {unit}"
    return f"{int(n)} bytes"


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_free(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None where no limit is set."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def host_room(sharers: int = 1) -> Room | None:
    """The host's free memory, as a CPU program sees it."""
    available = _meminfo_available()
    cgroup = _cgroup_free()
    if cgroup is not None and (available is None or cgroup < available):
        return Room(cgroup, f"the container has {format_bytes(cgroup)} free (cgroup memory.max)", sharers)
    if available is not None:
        return Room(available, f"the host has {format_bytes(available)} available", sharers)
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return Room(total, f"the host has {format_bytes(total)} of memory", sharers)


def device_room(devices: Sequence[Any]) -> Room | None:
    """What the program's devices have free: the host's on CPU, else the fullest device's bytes_limit - bytes_in_use
    (None when a device does not report them). Only this process's devices count: a multi-process mesh has others."""
    if not devices:
        return None
    if all(d.platform == "cpu" for d in devices):
        return host_room(sharers=len(devices))
    worst: tuple[int, int, Any] | None = None
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise rather than return None
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        limit = int(stats["bytes_limit"])
        free = limit - int(stats.get("bytes_in_use", 0))
        if worst is None or free < worst[0]:
            worst = (free, limit, device)
    assert worst is not None
    free, limit, device = worst
    return Room(free, f"device {device} has {format_bytes(free)} free of {format_bytes(limit)}")


def verdict(what: str, need: Footprint | None, room: Room | None, detail: str, advice: str) -> str | None:
    """The one-line refusal when `need` (per device) does not fit `room`, else None (also when either is unknown).

    what: who needs it ("island us-east"); detail: for what ("one train step (batch 16 x 33 tokens)");
    advice: the settings that help."""
    if need is None or room is None:
        return None
    total = need.total * room.sharers
    if total <= room.free:
        return None
    return f"{what} needs about {format_bytes(total)} for {detail}, {room.text}; {advice}"


def step_advice(
    batch_size: int, microbatch: int, passes: int, n_devices: int, shard_params: bool, remat: bool | None
) -> str:
    """The settings that shrink a train step, given what is set already (remat None: the model has no such knob)."""
    knobs = [f"lower train.batch_size ({batch_size})"]
    if passes == 1 or not microbatch:
        knobs.append("set train.microbatch (sequences per device per pass; gradients are accumulated)")
    elif microbatch > 1:
        knobs.append(f"lower train.microbatch ({microbatch})")
    if not shard_params:
        more = "" if n_devices > 1 else " over islands.devices > 1"
        knobs.append(f"shard parameters{more} (islands.shard_params)")
    if remat is False:
        knobs.append("turn on model.remat")
    return ", ".join(knobs[:-1]) + f" or {knobs[-1]}" if len(knobs) > 1 else knobs[0]


def eval_advice(rows: int) -> str:
    """The settings that shrink an evaluation, which runs `rows` sequences at a time (diloco/run/setup.py,
    eval_chunks)."""
    return (
        f"lower train.batch_size, or set (or lower) train.microbatch: evaluation runs {rows} sequences at a time, "
        "train.microbatch when set, else train.batch_size"
    )
