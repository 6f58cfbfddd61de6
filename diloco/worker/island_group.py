"""A multi-host island: N processes joined by jax.distributed into one JAX program over all their devices.

The leader (process 0, or the process that took the island over when process 0 was lost for good) runs the island's
worker (diloco/worker/island_worker.py) as a one-process island does: it alone talks to the coordinator, owns the run
directory and writes the metrics. The others, the followers, talk to no one:
they replay, in the same order, every call of the leader on the island's engine that runs a JAX computation (start,
restore a checkpoint, set_params, train, push, keep_residual, merge, save a checkpoint, stop). A computation over the
island's global mesh runs only when every process launches it, and its collectives match only when every process
launches the same ones in the same order, so one command channel from the leader keeps them in step:

    leader:   LeaderIsland.train(4)  ->  channel.send("train", n=4)  ->  Island.train(4)
    follower: follow(...)            ->  channel.receive()           ->  Island.train(4)

The channel is JAX's own `broadcast_one_to_all` (a collective over the island's devices: no socket of ours): a
length, a JSON header (the call, its small arguments, the names, dtypes and shapes of its arrays), then the arrays
in slabs. A process receives data only: JSON, and arrays of the dtypes it accepts, never code (no pickle).

Parameters split across the processes (islands.shard_params): each process forms, error-feeds and encodes Δ of its
own regions of such a leaf (islands/island.py, `Island.pieces_across`), and at the push each follower sends the
leader its encoded pieces over the channel (`Channel.gather`); the leader's one push carries every process's pieces,
which the coordinator assembles as it does any island's (docs/architecture.md, "Pieces").

Data: every process draws the same batch from the island's deterministic stream and puts only its own rows on its
devices (`Island.next_batch`), so the global batch is the one a one-process island with as many devices trains on.
Under data.sampling = "chunks" the leader alone leases, for the island, and tells the others the spans it was leased
(`read_chunks`, a command like the rest): every process reads the same leased sequences, each keeps its rows, and
the island's push claims them once, whatever the formation (the batch does not change with it).

Checkpoints: one orbax checkpoint of the island's global arrays in the island's run directory, which on several hosts
must be a filesystem all of them share (orbax saves from every process and commits from the leader, rank 0). Saves
run in the command order on the main thread, not on a background thread as a one-process island's do: orbax's save
itself synchronises the processes with collectives, which must never interleave with the training's.

Formation: which processes the island runs on, and which leads, is decided at each start before anyone joins
jax.distributed (diloco/worker/island_formation.py). Every process takes its own lock, RUN_DIR/process-I.lock, says
there that it is ready, and waits for a place (`run_process`): the process that takes RUN_DIR/run.lock leads (process
0 when it is there; see `elected`), waits up to islands.regroup_wait_s for the others and forms the island of those
present, itself first; the others join as their rank there, at the address the formation names.

Failures: a process that dies takes its island down. A surviving peer's collective fails at once (the dead socket)
or JAX's distributed runtime, missing its heartbeats for HEARTBEAT_S, aborts every process of the island; each
exits non-zero and its supervisor restarts it (diloco/worker/supervisor.py restarts a group on one host as a whole).
The island forms again, resumes from its checkpoint and rejoins the coordinator like any restarted island. A process
lost for good (its host gone) is not waited for beyond regroup_wait_s: the island goes on with those left, on fewer
devices and with the same batch (islands/mesh.py), from the same checkpoint and data cursor. When it comes back, it
says it is ready and waits; at the next round's end (its checkpoint written) the leader ends the island's processes
with supervisor.REGROUP, their supervisors start them again at once, and the island forms as a whole again. A process
of another release or config is refused in one line.

Process 0 lost for good: its followers' collectives fail, their supervisors start them again, and they find no
leader. After islands.regroup_wait_s the lowest of them started with the coordinator's address (--coordinator) takes
run.lock and the island over: it forms the island on the processes left, serves jax.distributed at its own
--island-coordinator, resumes from the island's checkpoint and data cursor and talks to the coordinator as the island
(its name and secret). A process 0 that comes back finds run.lock held and waits as any returning process does; at
the next round's end the island re-forms under it, whole. No follower waits for ever: after network.coordinator_wait_s
without a place it exits with one line naming what it waited for (exit 69), and its supervisor starts it again.

Streaming (stream.fragments > 1), asynchronous rounds, init.inner_state and post-training workloads are refused
with processes > 1 (`check_supported`): plain and time-budgeted DiLoCo rounds are what this replays.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from diloco.config import ConfigError, RunConfig
from diloco.deploy.tls import is_loopback, split_host
from diloco.harness.procs import devices_env
from diloco.run.checkpoint import CheckpointStore, restore_state, save_state
from diloco.run.rundir import RunDirLock
from diloco.run.setup import build_setup, make_island
from diloco.worker.island_formation import (
    Formation,
    FormationFiles,
    Leads,
    Patience,
    announce,
    lock_name,
    take_place,
)
from diloco.worker.stop_grace import StopGrace
from diloco.worker.supervisor import Member
from floor.codec import EncodedTensor
from floor.errors import UserError
from islands.chunks import Span
from islands.island import InnerRun, Island, IslandState, RoundPush
from pytrees.naming import PyTree, flatten_named, unflatten_named

log = logging.getLogger("diloco.worker.island_group")

HEARTBEAT_S = 10
"""jax.distributed's heartbeat timeout: a peer silent this long (dead host, SIGSTOP) is declared dead and every
process of the island aborts, so that each supervisor restarts its own. JAX's default (100 s) would leave the
island hung that long; shorter risks a false alarm on a loaded host."""
JOIN_S = 60
"""How long jax.distributed waits for every process of a formation to join (JAX's default: 300 s). They were all
ready when the leader formed the island, so one that does not come died meanwhile: the island fails, restarts, and
forms again without it."""
SHUTDOWN_S = 30
"""How long a process that exits waits at JAX's shutdown barrier for its peers (JAX's default: 300 s)."""
FOLLOWER_STOP_S = 20.0
"""A follower asked to stop (SIGTERM) waits this long for the leader's stop command, then exits anyway: the
leader stops at its next sync point (island_worker.STOP_GRACE_S) and tells its followers."""
ARRAY_DTYPES = ("float32", "int32", "uint8")
"""What a process accepts in a command's arrays: parameters, spans and encoded payloads."""
USER_ERROR = 2


@dataclass(frozen=True)
class Group:
    """This process's place in its island: `process_id` of `num_processes`, all joined at `coordinator`."""

    process_id: int = 0
    num_processes: int = 1
    coordinator: str = ""
    """HOST:PORT where this process serves jax.distributed's coordination service when it leads the island
    (--island-coordinator); followers join at the address their formation names."""

    @property
    def multiple(self) -> bool:
        return self.num_processes > 1


ONE_PROCESS = Group()
"""An island of one process (no jax.distributed)."""


def check_group(cfg: RunConfig, process_id: int | None, num_processes: int | None, coordinator: str | None) -> Group:
    """The island's group from `diloco island`'s flags (--num-processes defaults to islands.processes); a mistake is
    one line (ConfigError) naming the flag or key."""
    n = cfg.islands.processes if num_processes is None else num_processes
    if n < 1:
        raise ConfigError(f"--num-processes must be >= 1 (got {n})")
    pid = 0 if process_id is None else process_id
    if not 0 <= pid < n:
        raise ConfigError(f"--process-id must be in 0 .. {n - 1} for --num-processes {n} (got {pid})")
    if n == 1:
        return ONE_PROCESS
    if not coordinator:
        raise ConfigError(
            f"--num-processes {n}: --island-coordinator HOST:PORT is needed (where the leader serves "
            "jax.distributed to the island's processes)"
        )
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--island-coordinator must be HOST:PORT (got {coordinator!r})")
    check_supported(cfg, n)
    return Group(pid, n, coordinator)


def check_supported(cfg: RunConfig, processes: int) -> None:
    """Refuse in one line what a multi-process island does not replay (plain and time-budgeted rounds only, windows or
    chunks; parameters replicated across the processes or split across them)."""
    refused = [
        ("stream.fragments > 1 (streaming)", cfg.stream.fragments > 1 or cfg.stream.overlap_steps > 0),
        ("train.mode = 'async'", cfg.train.mode == "async"),
        ("init.inner_state = true", cfg.init.inner_state),
        ("a post-training workload (sft, dpo, rl)", cfg.workload.post_training(cfg.islands.island_names)),
    ]
    for what, bad in refused:
        if bad and processes > 1:
            raise ConfigError(
                f"{what} is not supported with islands.processes > 1 ({processes} processes): a "
                "multi-process island runs plain or time-budgeted DiLoCo rounds"
            )


def members(worker_argv: list[str], group: Group, devices: int) -> list[Member]:
    """Every process of the island on this host, for the supervisor: `worker_argv` with its --process-id, and
    `devices` CPU devices each (XLA_FLAGS; on GPUs and TPUs each process takes what it finds)."""
    env = devices_env(devices)
    return [Member([*worker_argv, "--process-id", str(i)], env, pid_name(i)) for i in range(group.num_processes)]


def pid_name(process_id: int) -> str:
    """Where a supervisor writes the worker's pid of process `process_id` (the leader's is the directory's own)."""
    return "worker.pid" if process_id == 0 else f"process-{process_id}.pid"


def join(group: Group, formation: Formation, rank: int) -> None:
    """Join the island's JAX program as process `rank` of `formation`'s (diloco/worker/island_formation.py): before
    anything asks JAX for a device. On CPU the processes' collectives run over gloo. The leader (rank 0) serves the
    coordination service at the formation's address, on loopback only when that address is loopback (the service has
    no authentication: beyond one host its port must be reachable from the island's hosts alone)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    service = formation.service or group.coordinator
    local = is_loopback(split_host(service))
    jax.distributed.initialize(
        coordinator_address=service,
        num_processes=len(formation.members),
        process_id=rank,
        initialization_timeout=JOIN_S,
        heartbeat_timeout_seconds=HEARTBEAT_S,
        shutdown_timeout_seconds=SHUTDOWN_S,
        coordinator_bind_address=service if local else None,
    )


# -- the channel -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One call of the leader (or one process's answer to it): its name, small JSON arguments, and named arrays."""

    op: str
    args: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def _padded(n: int) -> int:
    """Buffers come in a few sizes (powers of two), so the broadcast compiles a handful of times, not once per
    length."""
    return max(256, 1 << (n - 1).bit_length())


Keep = Callable[[str, np.ndarray], Any]
"""What a receiving process makes of each array of a command as soon as it is in (`Channel.receive`): put it on its
devices, or keep only its own regions, so that it never holds a whole model's arrays at once."""


class Channel:
    """Commands over `broadcast_one_to_all`; every process must take part in each.

    The leader sends (`send`), its followers receive (`receive`); at a push each follower answers with its own
    encoded pieces (`gather`). A command's arrays travel one after the other as one stream of int32 words in slabs
    of at most SLAB_WORDS, several small arrays to a slab and a large one over many, and each array is handed to the
    receiver's `Keep` as soon as its last word is in: no broadcast puts more than one slab on a device, and neither
    side copies the whole stream."""

    SLAB_WORDS = 1 << 24
    """Words (int32) one broadcast carries at most: 64 MiB on each device of the island while it runs."""

    def send(self, op: str, arrays: Mapping[str, Any] | None = None, **args: Any) -> None:
        self._broadcast(Command(op, args, {name: np.asarray(a) for name, a in (arrays or {}).items()}), source=0)

    def receive(self, keep: Mapping[str, Keep] | None = None) -> Command:
        """The leader's next command; `keep`: by command name, what to make of each of its arrays as it comes in
        (default: the host array itself)."""
        return self._broadcast(None, source=0, keep=keep or {})

    def gather(self, mine: Command | None) -> list[Command]:
        """Each follower's command to the leader, in process order: every process calls it, a follower with its own
        (`mine`), the leader with None, and only the leader gets the list (the others: [])."""
        me, got = jax.process_index(), []
        for source in range(1, jax.process_count()):
            cmd = self._broadcast(mine if me == source else None, source, wanted=me == 0)
            if me == 0:
                got.append(cmd)
        return got

    def _broadcast(
        self, cmd: Command | None, source: int, keep: Mapping[str, Keep] | None = None, wanted: bool = True
    ) -> Command:
        """`cmd` from process `source` (which passes it; the others pass None) to every process; `wanted`: this
        process keeps the arrays (else it only takes part in the broadcasts)."""
        sending = jax.process_index() == source
        header = b""
        if sending:
            assert cmd is not None
            spec = [[name, a.dtype.name, list(a.shape)] for name, a in cmd.arrays.items()]
            header = json.dumps({"op": cmd.op, "args": cmd.args, "arrays": spec}).encode()
        fields = json.loads(self._bytes(header, sending).tobytes())
        like: list[tuple[str, np.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in fields["arrays"]:
            if dtype not in ARRAY_DTYPES:
                raise RuntimeError(f"island channel: array {name!r} of dtype {dtype!r} refused")
            like.append((name, np.dtype(dtype), tuple(int(d) for d in shape)))
        if sending:
            assert cmd is not None
            self._arrays([_as_words(a) for a in cmd.arrays.values()], like)
            return cmd
        arrays = self._arrays(None, like, (keep or {}).get(fields["op"]), listen=wanted)
        return Command(fields["op"], fields["args"], arrays)

    def _arrays(
        self,
        words: list[np.ndarray] | None,
        like: list[tuple[str, np.dtype, tuple[int, ...]]],
        keep: Keep | None = None,
        listen: bool = True,
    ) -> dict[str, Any]:
        """The arrays `like` describes, from the sender (`words`: each as int32 words; None elsewhere) to every
        process, slab by slab. They travel as int32 bit patterns: the broadcast is a sum with zeros, which keeps
        integers exact and would turn a float -0.0 into +0.0. A receiver that `listen`s hands each array to `keep`
        once its last word is in (the others only take part)."""
        nbytes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in like]
        ends = np.cumsum([_round4(n) // 4 for n in nbytes], dtype=np.int64)
        starts = ends - np.array([_round4(n) // 4 for n in nbytes], np.int64)
        listen = listen and words is None
        out: dict[str, Any] = {}

        def hand(i: int, array: np.ndarray) -> None:
            name = like[i][0]
            out[name] = array if keep is None else keep(name, array)

        for i in range(len(like) if listen else 0):
            if not nbytes[i]:  # an array of no bytes takes no slab
                hand(i, np.zeros(like[i][2], like[i][1]))
        partial: dict[int, np.ndarray] = {}
        total = int(ends[-1]) if like else 0
        for s in range(0, total, self.SLAB_WORDS):
            e = min(s + self.SLAB_WORDS, total)
            slab = np.zeros(_padded(e - s), np.int32)
            first = int(np.searchsorted(ends, s, side="right"))
            overlap = [(i, max(s, int(starts[i])), min(e, int(ends[i]))) for i in range(first, len(like))]
            overlap = [(i, a, b) for i, a, b in overlap if a < b]
            if words is not None:
                for i, a, b in overlap:
                    slab[a - s : b - s] = words[i][a - starts[i] : b - starts[i]]
            got = np.asarray(multihost_utils.broadcast_one_to_all(slab, is_source=words is not None))
            for i, a, b in overlap if listen else ():
                buffer = partial.setdefault(i, np.zeros(int(ends[i] - starts[i]), np.int32))
                buffer[a - starts[i] : b - starts[i]] = got[a - s : b - s]
                if ends[i] <= e:
                    _, dtype, shape = like[i]
                    hand(i, partial.pop(i).view(np.uint8)[: nbytes[i]].view(dtype).reshape(shape))
        return out

    def _bytes(self, data: bytes, sending: bool) -> np.ndarray:
        """The sender's bytes (a command's JSON header) to every process: their length, then the bytes."""
        n = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int32), is_source=sending))
        spec = [("header", np.dtype(np.uint8), (n,))]
        if sending:
            self._arrays([_as_words(np.frombuffer(data, np.uint8))], spec)
            return np.frombuffer(data, np.uint8)
        return self._arrays(None, spec)["header"]


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


def _as_words(a: np.ndarray) -> np.ndarray:
    """`a`'s bytes as int32 words (a view when they are whole words, else a copy padded with zeros)."""
    raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    if raw.size % 4 == 0:
        return raw.view(np.int32)
    return np.concatenate([raw, np.zeros(_round4(raw.size) - raw.size, np.uint8)]).view(np.int32)


def pieces_command(encoded: Sequence[EncodedTensor]) -> Command:
    """A follower's encoded pieces for the leader's push: their metadata as JSON, their payloads as arrays."""
    metas = [[t.name, t.codec, t.dtype, list(t.shape), t.block_size, t.zstd_level, list(t.offset)] for t in encoded]
    return Command(
        "pieces", {"tensors": metas}, {str(i): np.frombuffer(t.payload, np.uint8) for i, t in enumerate(encoded)}
    )


def pieces_of(cmd: Command, names: frozenset[str]) -> list[EncodedTensor]:
    """The encoded pieces a follower sent (`pieces_command`); a piece of a leaf the island does not split across its
    processes is refused (the coordinator validates every tensor again, as from any island)."""
    if cmd.op != "pieces":
        raise RuntimeError(f"island channel: expected a follower's pieces, got {cmd.op!r}")
    out = []
    for i, (name, codec, dtype, shape, block, zstd, offset) in enumerate(cmd.args["tensors"]):
        if name not in names or not offset:
            raise RuntimeError(
                f"island channel: a follower sent {name!r}, not a piece of a leaf split across processes"
            )
        payload = cmd.arrays[str(i)].tobytes()
        out.append(EncodedTensor(name, codec, dtype, tuple(shape), int(block), int(zstd), payload, tuple(offset)))
    return out


# -- checkpoints (the same calls on every process) ---------------------------------------------------------------


def save_checkpoint(store: CheckpointStore, island: Island, round_: int) -> None:
    """IslandState with the round it belongs to, saved now (orbax finishes writing in its own background)."""
    assert island.state is not None
    # A copy of the device arrays: the next inner step donates them to XLA (islands/inner.py), deleting them. The
    # residual stays on the host as it is (replaced, never changed in place): orbax saves host arrays from rank 0,
    # where a copy on one process's device would be an array of that process alone, which it refuses.
    copy = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, island.state)
    save_state(store, round_, copy, {"round": round_})


def restore_checkpoint(store: CheckpointStore, island: Island, step: int) -> tuple[IslandState, dict[str, Any]]:
    """Continue `island` (started) from checkpoint `step`; returns the state read and its metadata."""
    assert island.state is not None
    state, meta = restore_state(store, step, island.state)
    island.restore(state)
    return state, meta


# -- the leader ---------------------------------------------------------------------------------------------------


class LeaderIsland:
    """The leader's Island: each call that runs a JAX computation is first told to the followers, then made here.

    It has the methods of `Island` that the worker calls (and delegates every other attribute: state, mesh, name),
    plus the checkpoint calls, which a one-process worker makes on the store directly."""

    def __init__(self, island: Island, channel: Channel) -> None:
        self.island, self.channel = island, channel
        self._last_push: RoundPush | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.island, name)

    def start(self, params: PyTree, opt_state: PyTree | None = None) -> None:
        """Start from the model's θ_0 (`like`), which every process builds itself (a warm inner state is refused)."""
        assert opt_state is None, "init.inner_state is refused with islands.processes > 1 (check_group)"
        self.channel.send("start")
        self.island.start(params)

    def read_chunks(self, plan: Sequence[Span]) -> None:
        """The spans the leader leased for the island: every process reads them, each keeping its rows of a batch."""
        self.channel.send("read_chunks", {"spans": np.array([s.as_list() for s in plan], np.int32).reshape(-1, 3)})
        self.island.read_chunks(plan)

    def set_params(self, params: PyTree) -> None:
        self.channel.send("set_params", flatten_named(params))
        self.island.set_params(params)

    def train(self, n_steps: int) -> InnerRun:
        self.channel.send("train", n=n_steps)
        return self.island.train(n_steps)

    def train_for(self, budget_s: float, max_steps: int) -> InnerRun:
        """Island.train_for's chunks, each one a `train` told to the followers: the leader's clock alone decides
        how many steps fit the budget, so every process trains exactly as many."""
        return Island.train_for(self, budget_s, max_steps)  # type: ignore[arg-type]  # it calls self.train only

    def encode_delta(self, run: InnerRun, reference: dict[str, PyTree]) -> RoundPush:
        """The island's push: the leader's Δ, with each leaf split across the processes (`Island.pieces_across`) made
        of every process's encoded pieces, which the followers send it (`Channel.gather`)."""
        self.channel.send("encode_delta", reference)
        push = self.island.encode_delta(run, reference).for_the_wire()
        across = self.island.pieces_across()
        if across:
            theirs = [t for cmd in self.channel.gather(None) for t in pieces_of(cmd, across)]
            every = sorted([*push.sent.encoded, *theirs], key=lambda t: (t.name, t.offset))
            push = replace(push, sent=replace(push.sent, encoded=every))
        self._last_push = push
        return push

    def keep_residual(self, push: RoundPush) -> None:
        # Plain rounds have one push in flight: the followers keep their own copy of it (the same bytes).
        assert push is self._last_push, "only the newest push's residual can be kept (no streaming here)"
        self.channel.send("keep_residual")
        self.island.keep_residual(push)

    def merge(
        self, global_fragment: dict[str, PyTree], alpha: float = 0.0, on_mesh: dict[str, PyTree] | None = None
    ) -> None:
        self.channel.send("merge", global_fragment, alpha=alpha)  # the followers place their own copy
        self.island.merge(global_fragment, alpha, on_mesh)

    def save_checkpoint(self, store: CheckpointStore, round_: int) -> None:
        self.channel.send("save", round=round_)
        save_checkpoint(store, self.island, round_)

    def restore_checkpoint(self, store: CheckpointStore, step: int) -> tuple[IslandState, dict[str, Any]]:
        self.channel.send("restore", step=step)
        return restore_checkpoint(store, self.island, step)

    def stop(self, code: int) -> None:
        """The followers' last command: exit with `code` (the leader's: 0 done or stopped, 2 a user error, 1 a
        crash). Best effort: when a peer is already gone, JAX's runtime takes the island down anyway."""
        try:
            self.channel.send("stop", code=code)
        except Exception as exc:  # a dead peer fails the broadcast; the island is going down anyway
            log.warning("could not tell the island's other processes to stop: %s", exc)


def exit_code(exc: BaseException | None) -> int:
    """What the leader's end means for its followers' exit codes (the supervisor's reading: 2 is not retried)."""
    if exc is None or isinstance(exc, SystemExit | KeyboardInterrupt):
        return 0
    return exc.exit_code if isinstance(exc, UserError) else 1


# -- the followers ------------------------------------------------------------------------------------------------


def follow(island: Island, like: PyTree, store: CheckpointStore | None, channel: Channel) -> int:
    """Replay the leader's calls until it says stop; returns the exit code it gave.

    A user error that a call raises here (a divergence: every process sees the same NaN) is raised on the leader
    too, which then says stop with code 2; so the follower keeps listening rather than leave its peers hanging."""
    last_run: InnerRun | None = None
    last_push: RoundPush | None = None
    # Each leaf of a new θ goes onto the devices as it arrives, and of a push's reference each process keeps its
    # own regions: a follower never holds a whole θ on its host.
    keep = {"set_params": island.place_leaf, "merge": island.place_leaf, "encode_delta": island.own_reference}
    while True:
        cmd = channel.receive(keep)
        try:
            if cmd.op == "stop":
                return int(cmd.args.get("code", 0))
            if cmd.op == "start":
                island.start(like)
            elif cmd.op == "read_chunks":
                island.read_chunks([Span(*(int(x) for x in row)) for row in cmd.arrays["spans"]])
            elif cmd.op == "set_params":
                island.set_params(unflatten_named(cmd.arrays, like))
            elif cmd.op == "train":
                last_run = island.train(int(cmd.args["n"]))
            elif cmd.op == "encode_delta":
                run = last_run or InnerRun(np.zeros(0, np.float32), 0, 0.0, 0)
                last_push = island.encode_delta(run, cmd.arrays).for_the_wire()
                if across := island.pieces_across():
                    channel.gather(pieces_command([t for t in last_push.sent.encoded if t.name in across]))
            elif cmd.op == "keep_residual":
                assert last_push is not None
                island.keep_residual(last_push)
            elif cmd.op == "merge":
                alpha = float(cmd.args["alpha"])
                island.merge(cmd.arrays, alpha, on_mesh=cmd.arrays if alpha == 0.0 else None)
            elif cmd.op == "save":
                assert store is not None
                save_checkpoint(store, island, int(cmd.args["round"]))
            elif cmd.op == "restore":
                assert store is not None
                restore_checkpoint(store, island, int(cmd.args["step"]))
            else:
                raise RuntimeError(f"island channel: unknown command {cmd.op!r}")
        except UserError as exc:
            log.warning("%s (the leader stops the island)", exc)


def run_process(
    cfg: RunConfig, name: str, run_dir: Path, group: Group, lead: Callable[[RunDirLock], int] | None
) -> int:
    """`diloco island --process-id I --no-supervise` of a multi-process island: take a place in the island's next
    formation, then lead it (`lead`, given run.lock; None: this process cannot lead, it has no coordinator address)
    or join the island, build the same engine as the leader and follow it; returns the exit code.

    The process takes a lock of its own in the island's run directory (RUN_DIR/process-I.lock: two processes with
    the same id on one directory are refused) and says there that it is ready (diloco/worker/island_formation.py).
    As a follower it leaves the rest of the directory to the leader (run.lock, metrics, config, formation.json),
    except the checkpoints, which every process saves and restores together."""
    me, n = group.process_id, group.num_processes
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir, role=f"island {name} process {me}", name=lock_name(me))
    store = None
    try:
        nonce = announce(lock, me, n, cfg, leads=lead is not None)
        patience = Patience(cfg.islands.regroup_wait_s, cfg.network.coordinator_wait_s)
        place = take_place(FormationFiles(run_dir, n), lock, nonce, name, me, patience, able=lead is not None)
        if isinstance(place, Leads):
            assert lead is not None
            log.info("island %s process %d leads: %s", name, me, place.why)
            try:
                return lead(place.lock)
            finally:
                place.lock.release()
        log.info("island %s process %d joins formation %d as rank %d", name, me, place.formation.epoch, place.rank)
        join(group, place.formation, place.rank)
        setup = build_setup(cfg, islands=[name], theta=False)  # the leader's θ comes to it over the channel
        island = make_island(cfg, name, setup.model_of(name), setup.streams[name], len(jax.devices()))
        store = CheckpointStore(run_dir / "checkpoints") if cfg.train.checkpoint_every else None
        _stop_later_on_signal()
        return follow(island, setup.init_params, store, Channel())
    finally:
        if store is not None:
            store.close()
        lock.release()


def _stop_later_on_signal() -> None:
    """SIGTERM / Ctrl+C: the leader, signalled too (launch, a supervisor), stops at its next sync point and tells
    us; exiting now would abort the island mid-collective. Exit anyway if its word does not come."""
    StopGrace(FOLLOWER_STOP_S, on_request=lambda name: None)
