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

One step is not the whole process, though: `simulate` holds every island and the coordinator in one memory, and an
island's first step comes long before the first commit. `ProcessPlan` is the cost model of the whole process, checked
once before any island's state exists (diloco/run/memory_plan.py), in bytes, with P the bytes of θ in float32:

    an island       θ (P), its inner optimizer state (AdamW: 2P, its moments), the uplink residual (P; none when the
                    codec is lossless), and in a federation's island process its copy of the global θ (P)
    the coordinator θ (P), the outer optimizer state (Nesterov: P, its momentum), the downlink residual (P, lossy)
    the reference   rl islands' frozen θ_ref (P; workload.reference), one copy that a process's islands share; a dpo
                    island's reference is read only to score its examples before any state exists, and dropped
    held            N islands + the coordinator + the reference: the state the run keeps from its first step to its
                    last. θ_0, which the setup built before the check, is held already (the room is measured after it)
    at its peak, the held state plus the largest of these, which never overlap (`Lockstep` runs them in turn):
      a first step  one island's θ and inner state copied for the warm-up step (donated, so its own are spared), and
                    XLA's figure for a step beyond its arguments (temporaries: activations, gradients; its code)
      a sync        each island's push: its decoded Δ (P) and its encoding (P / compression), then the commit: the
                    aggregate (P), the update u on the device and on the host (2P), the new θ (P), the new outer
                    state, and for a lossy downlink u + e, û and the new residual (3P) and û's encoding; the order
                    statistics (trimmed_mean, median) add their stack of N of the largest leaf and its sort
      an evaluation XLA's figure for the evaluation (θ placed, the batches, the logits), beside the pushes and the
                    commit's new state (the old one is kept until the evaluation decides to keep the new)
      a checkpoint  a copy of one owner's state (the largest), written before the next owner's save starts

The islands of a `simulate` train one after another (`train.vectorize` steps them in one program: N steps' worth of
temporaries at once). What the model of `simulate` leaves out is the runtime itself (the interpreter, JAX and XLA, a
few hundred MB already held when the room is measured) and the allocator's slack; BENCHMARKS.md ("Memory") has the
measured peaks against it.

`diloco launch` runs the same terms in separate processes (`launch_plans`, diloco/run/memory_plan.py), and each of
them holds its own runtime besides (`RUNTIME`: the interpreter, JAX, XLA and gRPC, the run's data, its compiled
programs). Their syncs and checkpoints are their own, so their phases differ from `simulate`'s:

    an island process   its island (above) and its copy of the global θ (P, what Δ is taken from); at its peak its
                        first step (above) or one of
      a push            Δ taken on the host (P); a lossy codec adds Δ̂ and the new residual (2P) and the bytes
      a pull            the push's bytes (kept until its commit comes back), the commit's bytes, û decoded (P) and
                        the new global θ (P)
      a checkpoint      the island's state copied (θ, inner state, residual: the next step donates them), orbax's
                        write buffers while it is written (`CHECKPOINT_WRITE` of it) and XLA's figure for a step
                        beyond its arguments: the next steps run while it is written
    the coordinator's   the global model (above) and, from the first sync on, the receive buffers of the last two
    process             pushes and the last commit's bytes twice (its own, and the serialized copy its pulls share:
                        `wire_kept`); at its peak a sync or an evaluation (above, with its N islands' pushes) or
      a checkpoint      written while the commit settles: the state before the commit and the pushes (kept for a
                        rollback until the evaluation keeps it), orbax's copies of the host arrays it saves (θ, the
                        residual) and its write buffers

An island process lets go of what it does not read: θ_0 once it has started from it, the Δ̂ its push's encoding
made (only `simulate`'s coordinator reads it), a full θ's receive buffer once its global copy has moved on.
BENCHMARKS.md ("Bigger on one host") has a launch's measured peaks against this model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from floor.errors import UserError

GB = 10**9

CHECKPOINT_WRITE = 0.8
"""The bytes orbax (tensorstore) holds while it writes a checkpoint, per byte of the state it writes, where nothing
bounds them: its write buffers, beside the state itself (BENCHMARKS.md, "Bigger on one host": 416 MiB for a 512 MiB
state of 32 arrays of random float32). The checkpoints of this project bound them by a write window
(`ProcessPlan.write_window`)."""

RUNTIME = 600 * 10**6
"""The resident bytes of a process that runs a model of negligible size: the interpreter, JAX, XLA and gRPC, the
run's data and its compiled programs (BENCHMARKS.md, "Bigger on one host": 581 to 592 MiB an island process, 415 MiB
the coordinator's, at the smoke size). A launch's plan counts it once per process; `simulate`'s room is measured with
it already held."""


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


@dataclass(frozen=True)
class ProcessPlan:
    """The cost model of one process that holds `islands` islands and (`coordinator`) the global model, in bytes
    (module docstring). Pure: the caller measures the parts (`jax.eval_shape`, XLA's `memory_analysis`).

    `simulate` is one process of N islands and the coordinator. `diloco launch` starts one process per island (1
    island, no coordinator) and the coordinator's (0 islands, the pushes of N `pushers`)."""

    islands: int
    params: int
    """P: θ's bytes in float32."""
    largest_leaf: int
    """θ's largest tensor's bytes (the order statistics work a tensor at a time)."""
    inner_state: int
    """One island's inner optimizer state."""
    step: Footprint | None
    """One island's train step, per device (None: XLA cannot say; the plan then counts none)."""
    step_sharers: int = 1
    """Devices of an island's mesh whose memory is this one (on CPU, all of them)."""
    evaluation: Footprint | None = None
    coordinator: bool = True
    outer_state: int = 0
    uplink_ratio: float = 1.0
    """Encoded bytes of a push per byte of Δ (fp32: 1, int8: about 1/4)."""
    downlink_ratio: float = 1.0
    uplink_lossy: bool = False
    downlink_lossy: bool = False
    order_statistic: bool = False
    """outer.aggregate is trimmed_mean or median."""
    stepped_together: bool = False
    """train.vectorize: every island's step runs at once."""
    reference: int = 0
    """The bytes of rl's frozen reference θ held beside the islands (one per process), 0 without rl."""
    global_copy: bool = False
    """Each island keeps its own host copy of the global θ (P), what its Δ is taken from: an island process of a
    federation (diloco/worker/global_copy.py); in `simulate` the islands share the coordinator's."""
    pushers: int | None = None
    """The islands whose pushes the coordinator holds at a sync: its own (`islands`) unless given (a federation's
    coordinator holds its islands' pushes and none of their states)."""
    write_window: int | None = None
    """The most bytes orbax writes at once (diloco/run/checkpoint.py, `WRITE_WINDOW` or the largest array): its
    write buffers stay within it. None: unbounded (`CHECKPOINT_WRITE` of the state)."""
    runtime: int = 0
    """The process's own runtime (`RUNTIME`), held from its start: counted for each process of a launch, 0 in
    `simulate` (whose room is measured with it already held)."""

    @property
    def saved_state(self) -> int:
        """One island's state as its checkpoint saves it: θ, the inner state and the residual."""
        return self.params + self.inner_state + (self.params if self.uplink_lossy else 0)

    @property
    def island_state(self) -> int:
        return self.saved_state + (self.params if self.global_copy else 0)  # and the copy of the global θ

    @property
    def coordinator_state(self) -> int:
        if not self.coordinator:
            return 0
        return self.params + self.outer_state + (self.params if self.downlink_lossy else 0)

    @property
    def wire_kept(self) -> int:
        """A federation's coordinator's bytes kept from one sync to the next: the receive buffers of its last two
        pushes (the transport's pool, transport/chunking.py) and the last commit's bytes with the serialized copy its
        pulls share (diloco/coordinator/commit_window.py). 0 for any other process."""
        if not self.coordinator or self.pushers is None:
            return 0
        return min(self.pushers, 2) * int(self.params * self.uplink_ratio) + 2 * int(self.params * self.downlink_ratio)

    @property
    def held(self) -> int:
        """What the run keeps from its first step to its last."""
        state = self.islands * self.island_state + self.coordinator_state + self.reference
        return self.runtime + state + self.wire_kept

    def phases(self) -> dict[str, int]:
        """The transient bytes of each phase beyond `held`, by name; the phases never overlap."""
        P = self.params
        step = 0
        if self.step is not None:
            extra = self.step.total - self.step.arguments  # the arguments are the state, counted as held
            step = extra * self.step_sharers * (self.islands if self.stepped_together else 1)
        phases = {"a first step": P + self.inner_state + step} if self.islands else {}
        if self.global_copy:
            phases.update(self.island_process_phases(step))
            return phases
        if self.coordinator:
            pushers = self.islands if self.pushers is None else self.pushers
            pushes = pushers * int(P * (1 + self.uplink_ratio))
            down = 3 * P + int(P * self.downlink_ratio) if self.downlink_lossy else 0
            stack = 2 * pushers * self.largest_leaf if self.order_statistic else 0
            commit = 4 * P + self.outer_state + down + stack
            phases["a sync"] = pushes + commit
            if self.evaluation is not None:
                new_state = P + self.outer_state + (P if self.downlink_lossy else 0)
                phases["an evaluation"] = pushes + new_state + self.evaluation.total
            if self.pushers is None:
                phases["a checkpoint"] = max(self.island_state if self.islands else 0, self.coordinator_state)
            else:  # a federation's coordinator saves while the commit settles, its rollback still kept
                state = self.coordinator_state
                host = P + (P if self.downlink_lossy else 0)  # θ and the residual, host arrays that orbax copies
                phases["a checkpoint"] = state + pushers * P + host + self.write_buffers(state)
        else:
            phases["a checkpoint"] = self.island_state
        return phases

    def island_process_phases(self, step: int) -> dict[str, int]:
        """The phases of an island process of a federation beyond its first step (`step`: XLA's temporaries of one
        step), each beside its held state (module docstring, "an island process"). Its commits come from another
        process, so its sync is its own push and pull, and its checkpoint is written while it trains on."""
        P = self.params
        up, down = int(P * self.uplink_ratio), int(P * self.downlink_ratio)
        # Δ taken on the host; a lossy codec adds Δ̂ and the new residual beside it and the bytes to send
        push = P + (2 * P + up if self.uplink_lossy else 0)
        # the push's bytes (held until the commit comes back), the commit's bytes, û decoded and the new global θ
        pull = up + down + 2 * P
        # the state's copy, orbax's buffers while it is written, and the next steps, which run meanwhile
        copy = self.saved_state
        checkpoint = copy + self.write_buffers(copy) + step
        return {"a push": push, "a pull": pull, "a checkpoint": checkpoint}

    def write_buffers(self, state: int) -> int:
        """What orbax holds while it writes a state of `state` bytes, beside it."""
        unbounded = int(state * CHECKPOINT_WRITE)
        return unbounded if self.write_window is None else min(unbounded, self.write_window)

    @property
    def peak(self) -> int:
        return self.held + max(self.phases().values())

    def describe(self) -> str:
        """The parts, for the one-line refusal: "2 islands of 1.99 GB each, the coordinator 1.49 GB, a sync 4.98 GB"."""
        phase, extra = max(self.phases().items(), key=lambda kv: kv[1])
        each = "" if self.islands == 1 else " each"
        plural = "s" if self.islands > 1 else ""
        parts = [f"the runtime {format_bytes(self.runtime)}"] if self.runtime else []
        if self.islands:
            parts.append(f"{self.islands} island{plural} of {format_bytes(self.island_state)}{each}")
        if self.coordinator:
            parts.append(f"the coordinator {format_bytes(self.coordinator_state + self.wire_kept)}")
        if self.reference:
            parts.append(f"the reference {format_bytes(self.reference)}")
        return f"{', '.join(parts)} and at the peak {phase} {format_bytes(extra)}"


def process_advice(islands: int, step_advice: str) -> str:
    """The settings that shrink a whole process: fewer islands in it, a smaller model, or a smaller step."""
    fewer = f"lower islands.count ({islands}) or run the islands as processes (diloco launch), " if islands > 1 else ""
    return f"{fewer}shrink the model (model.n_layers, model.d_model, model.vocab_size), or {step_advice}"


def format_bytes(n: float) -> str:
    """Decimal units, about 3 significant digits: "312 GB", "21.3 GB", "850 MB", "4.20 kB"."""
    for unit, size in (("TB", 10**12), ("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            value = n / size
            return f"{value:.{0 if value >= 100 else 1 if value >= 10 else 2}f} {unit}"
    return f"{int(n)} bytes"


def peak_resident(pid: int | str = "self") -> int | None:
    """A process's peak resident memory in bytes (VmHWM of /proc/PID/status: the high-water mark of its own pages,
    which ru_maxrss is not across a fork and exec), or None where the kernel does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


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
