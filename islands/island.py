"""One island: its state, its mesh, and the H inner steps it runs between synchronisations.

The island owns `IslandState(step, params, inner_opt_state, residual, data_cursor)`. Between rounds it keeps its
inner AdamW state (DiLoCo keeps inner optimizer state across rounds) and replaces only its parameters with the
global ones. The same class runs inside `diloco simulate` (many islands in one process) and inside an island
process of `diloco launch`, and both drive it through the same steps (docs/architecture.md, "The round"):

    train(n) / train_for(s, n)   -> n inner steps (or as many as fit s seconds), between two events of the schedule
    encode_delta(run, θ_global)  -> Δ = θ_global - θ_local over those leaves, encode(Δ + e) -> RoundPush
    keep_residual(push)          -> the push reached the round: carry what its codec dropped into the next one
    merge(θ_p,global, α)         -> the committed leaves into the local θ (plain DiLoCo: all of θ, α = 0)

Plain DiLoCo is one sync a round over all of θ; Streaming DiLoCo (outer_optimizer/fragments.py) syncs one
fragment's leaves at a time (Δ_p = θ_p,global - θ_p,local) and merges the committed fragment τ steps later.

After its H steps an island checks that every loss and every parameter is finite, and stops with `DivergedError`
(a user error: exit code 2, never restarted) naming the island, the first bad step and the settings to change,
instead of sending a NaN pseudo-gradient that the codec and the coordinator would refuse round after round.

Before any step, an island compiles its step ahead of time and checks that one step fits in the memory its devices
(on CPU, the host) have free (`check_memory`, islands/memory.py): a batch or a model too big is `OutOfMemoryError`,
one line naming the settings that shrink it, instead of a RESOURCE_EXHAUSTED traceback. `make_island` checks it from
the shapes alone, before any state exists; the first `train` checks again, its state and its neighbours' now held, and
runs the executable so compiled (jit's cache keeps it: the step is compiled once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from floor.codec import CodecSpec, piece_decodes_as_whole
from floor.errors import UserError
from islands.chunks import ChunkStream, Span
from islands.config import InnerConfig
from islands.inner import draws, island_key, make_train_step, place_tree
from islands.memory import Footprint, OutOfMemoryError, device_room, step_advice, verdict
from islands.mesh import Layout, accumulation_steps, batch_sharding, build_mesh, data_width
from islands.models.base import Model
from outer_optimizer.aggregate import pseudo_gradient
from pytrees.feedback import Compressed, Residual, compress_tree, zero_residual
from pytrees.naming import PyTree, flatten_named, held_in_part, to_host, unflatten_named
from pytrees.pieces import Split, values_at


class DivergedError(UserError):
    """Training blew up (NaN/Inf, or an exploded loss): a setting to change, not a crash to retry.

    A user error, so the CLI prints one line and exits with code 2, which neither the island supervisor nor
    `launch` restarts: the same settings would diverge again, at the same step.
    """


def divergence_advice(inner: InnerConfig | None = None) -> str:
    """Which settings to look at, with their values when known (the usual causes, most likely first)."""
    if inner is None:
        return "lower inner.lr, keep inner.clip_norm > 0 (0 turns clipping off) or raise inner.warmup_steps"
    clip = (
        "set inner.clip_norm > 0 (it is 0: no clipping)"
        if inner.clip_norm == 0
        else f"lower inner.clip_norm ({inner.clip_norm:g})"
    )
    return f"lower inner.lr ({inner.lr:g}), {clip} or raise inner.warmup_steps ({inner.warmup_steps})"


@jax.jit
def _all_finite(tree: PyTree) -> jax.Array:
    """One device reduction over every leaf: the host reads back a single bool, not the parameters."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class Batches(Protocol):
    """Where an island's batches come from: `islands.data.BatchStream`, the sync baseline's union of streams, or a
    post-training workload's examples (islands/workloads/batches.py)."""

    batch_size: int
    seq_len: int
    cursor: int
    """Index of the next batch (host int, checkpointed): batch k is a pure function of k (of k and the parameters,
    for `PolicyBatches`)."""

    def next(self) -> PyTree:
        """int32 [batch_size, seq_len + 1] (a post-training workload's: a dict of arrays, each [batch_size, ...]),
        then advance the cursor."""
        ...


@runtime_checkable
class PolicyBatches(Protocol):
    """Batches that depend on the parameters being trained (rl: answers sampled from the island's current policy,
    islands/workloads/rollouts.py): the island hands its θ over before every step."""

    def next_for(self, params: PyTree) -> PyTree:
        """The next batch, drawn with the policy `params` (read before the step donates them); cursor advanced."""
        ...


def empty_batch(stream: Batches) -> PyTree:
    """A batch of no rows with the shapes and dtypes of the stream's: its `empty()` (a post-training stream's dict
    of arrays), else token windows, int32 [0, seq_len + 1]."""
    empty = getattr(stream, "empty", None)
    return empty() if empty is not None else np.zeros((0, stream.seq_len + 1), np.int32)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class IslandState:
    params: PyTree
    inner_opt_state: PyTree
    residual: Residual = None
    """What the uplink codec dropped so far (error feedback): zeros at the start for a lossy codec, None for a
    lossless one, so the state's structure is fixed for the whole run."""
    step: int = field(default=0, metadata={"static": True})
    """Inner steps taken so far (host int)."""
    data_cursor: int = field(default=0, metadata={"static": True})
    """Index of the next batch in the island's stream (host int): resuming neither repeats nor skips."""


@dataclass(frozen=True)
class InnerRun:
    """What H inner steps produced: per-step losses, tokens trained, and seconds spent in the steps."""

    losses: np.ndarray
    tokens: int
    seconds: float
    first_step: int
    figures: Mapping[str, np.ndarray] = field(default_factory=dict)
    """The model's `step_figures`, each a float32 array with one value per step (like `losses`)."""

    @classmethod
    def joined(cls, runs: list[InnerRun]) -> InnerRun:
        """Consecutive runs as one (the steps between two syncs, trained in pieces around merges)."""
        return cls(
            losses=np.concatenate([r.losses for r in runs]) if runs else np.zeros(0, np.float32),
            tokens=sum(r.tokens for r in runs),
            seconds=sum(r.seconds for r in runs),
            first_step=runs[0].first_step if runs else 0,
            figures={k: np.concatenate([r.figures[k] for r in runs]) for k in (runs[0].figures if runs else {})},
        )


@dataclass(frozen=True)
class RoundPush:
    """One round of an island: its H inner steps and the compressed pseudo-gradient they produced."""

    run: InnerRun
    sent: Compressed
    """encode(Δ + e): the bytes to push, the Δ the coordinator will decode, and the residual to keep if it is
    accepted."""

    def for_the_wire(self) -> RoundPush:
        """The push as an island process keeps it until its commit comes back: its bytes and the residual, without
        the Δ the coordinator will decode (`simulate`'s coordinator reads that; in an island process it is one more
        θ held through the wait, the pull and the checkpoint)."""
        return self if self.sent.decoded is None else replace(self, sent=replace(self.sent, decoded=None))


def own_shards(x: jax.Array) -> list[Any]:
    """The shards through which this process holds each of its values of `x` once (the lowest replica of each
    region it holds): all of `x` when the process holds all of it, its own pieces when `x` is split across processes
    (`held_in_part`)."""
    by_region: dict[tuple[int, ...], Any] = {}
    for shard in sorted(x.addressable_shards, key=lambda s: s.replica_id):
        by_region.setdefault(_offset(shard.index, x.shape), shard)
    return list(by_region.values())


def _offset(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i.indices(n)[0]) for i, n in zip(index, shape, strict=True))


def _piece_shape(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*i.indices(n))) for i, n in zip(index, shape, strict=True))


def travels_in_pieces(x: Any, spec: CodecSpec) -> bool:
    """`x` (a leaf of θ_local) is split over devices, and its Δ travels as one piece a shard: each shard's piece
    decodes to exactly what the whole leaf's encoding gives under `spec` (`floor.codec.piece_decodes_as_whole`) and,
    for a leaf split across processes, each region is held by one process. Decided from the layout alone, so every
    process of an island decides the same."""
    if not isinstance(x, jax.Array) or not (x.is_fully_addressable or held_in_part(x)):
        return False
    shape = tuple(int(d) for d in x.shape)
    holders: dict[tuple[int, ...], set[int]] = {}
    pieces: dict[tuple[int, ...], tuple[int, ...]] = {}
    for device, index in x.sharding.devices_indices_map(shape).items():
        offset = _offset(index, shape)
        holders.setdefault(offset, set()).add(device.process_index)
        pieces[offset] = _piece_shape(index, shape)
    return (
        len(pieces) > 1
        and all(len(p) == 1 for p in holders.values())
        and all(piece_decodes_as_whole(spec.kind, spec.block_size, shape, o, p) for o, p in pieces.items())
    )


def travels_across(x: Any, spec: CodecSpec) -> bool:
    """`x` is split across the processes of a multi-process island and travels in pieces: each process forms, feeds
    back and encodes its own (`Island.pieces_across`)."""
    return held_in_part(x) and travels_in_pieces(x, spec)


def _places(x: jax.Array) -> tuple[tuple[tuple[int, ...], tuple[slice, ...]], ...]:
    """Each region of `x` this process holds once (`own_shards`): its offset and its place as slices."""
    return tuple((_offset(s.index, x.shape), s.index) for s in own_shards(x))


def own_pieces(x: jax.Array) -> Split:
    """This process's values of `x`, one piece a region (`own_shards`), each copied to the host."""
    shape = tuple(int(d) for d in x.shape)
    return Split(shape, tuple((_offset(s.index, shape), np.asarray(s.data)) for s in own_shards(x)))


def delta_of(reference: Any, local: Any, spec: CodecSpec) -> np.ndarray | Split:
    """Δ = `pseudo_gradient(reference, local)` for one leaf, on the host: by shard, a `Split` whose pieces follow
    `local`'s shards (pytrees/pieces.py), when `travels_in_pieces`, else whole. A leaf split across processes gives
    this process's pieces alone (a partial Split), or, where its shards cannot travel alone, is gathered whole from
    every process (a collective each process of the island makes for the same leaves). `reference`: the global leaf,
    or this process's regions of it (`Island.own_reference`)."""
    if travels_in_pieces(local, spec):
        mine = own_pieces(local)
        ref = reference if isinstance(reference, Split) else to_host(reference)
        return Split(
            mine.shape,
            tuple(
                (offset, np.asarray(pseudo_gradient(values_at(ref, offset, where), values), np.float32))
                for offset, where, values in mine.regions()
            ),
        )
    if held_in_part(local):
        return pseudo_gradient(to_host(reference), np.asarray(multihost_utils.process_allgather(local, tiled=True)))
    return pseudo_gradient(to_host(reference), to_host(local))


def spread(pieces: Split, like: jax.Array) -> jax.Array:
    """A partial `Split` of this process's regions as a JAX array laid out as `like` (each process gives its own
    regions: no collective)."""
    shape = tuple(int(d) for d in like.shape)
    return jax.make_array_from_callback(
        shape, like.sharding, lambda index: np.array(pieces.at(_offset(index, shape)), like.dtype)
    )


@dataclass(frozen=True)
class TakenDelta:
    """Δ of one sync taken (host arrays) but not yet encoded (`Island.take_delta`): `encode` may run on another
    thread, so a streaming island's training thread goes on with the next fragment's steps while the wire thread
    quantizes and compresses this one (docs/architecture.md, "Streaming DiLoCo")."""

    run: InnerRun
    delta: dict[str, PyTree]
    residual: Residual
    """This island's error feedback for the leaves of Δ as it was when Δ was taken."""
    spec: CodecSpec
    decay: float = 1.0
    """β, the residual's decay before Δ is added (outer.kind = "sparseloco"; 1: plain error feedback)."""

    def encode(self) -> RoundPush:
        """encode(Δ + β·e): the bytes to push, the Δ the coordinator will decode and the residual to keep."""
        return RoundPush(self.run, compress_tree(self.delta, self.residual, self.spec, self.decay))


class Island:
    """An island's training engine on a mesh of its local devices."""

    def __init__(
        self,
        name: str,
        model: Model,
        tx: optax.GradientTransformation,
        stream: Batches,
        uplink: CodecSpec | None = None,
        n_devices: int = 1,
        microbatch: int = 0,
        shard_params: bool = False,
        tensor: int = 1,
        devices: list[jax.Device] | None = None,
        inner: InnerConfig | None = None,
        slowdown: float = 1.0,
        remat: bool | None = None,
        device_step_s: float = 0.0,
        feedback_decay: float = 1.0,
        seed: int = 0,
    ) -> None:
        """`inner`, when given, only puts the values of the inner settings into a divergence message, and `remat`
        (model.remat; None: the model has no such setting) into an out-of-memory one. `slowdown`: each inner step
        takes this many times as long (the island sleeps the difference; tests and benchmarks). `device_step_s`: every
        inner step lasts at least this long (it sleeps the rest, leaving the host idle as an accelerator's step does;
        benchmarks). `feedback_decay`: β of the uplink's error feedback (`OuterConfig.feedback_decay`). `seed`:
        run.seed, which with the island's name and inner step keys a loss that draws (workload.lora.dropout)."""
        self.name = name
        self.inner = inner
        self.remat = remat
        self.slowdown = slowdown
        self.device_step_s = device_step_s
        self.model = model
        self.tx = tx
        self.stream = stream
        self.uplink = uplink or CodecSpec(kind="fp32")
        self.feedback_decay = feedback_decay
        self.mesh = build_mesh(n_devices, devices, tensor)
        self.layout = Layout(self.mesh, shard_params, model.axis_units)
        self.microbatch = microbatch
        self.passes = accumulation_steps(stream.batch_size, microbatch, data_width(self.mesh))
        self._batch_sharding = batch_sharding(self.mesh)
        self._step_fn: Callable | None = None
        self._island_key = island_key(seed, name) if draws(model.loss) else None
        """The key data this island's steps draw from (`islands.inner.Draw`); None: its loss draws nothing."""
        self._across: dict[str, tuple[tuple[tuple[int, ...], tuple[slice, ...]], ...]] = {}
        """This process's regions (offset, slices) of each leaf of θ split across processes that travels in pieces
        (`travels_across`): the layout's, set by `start`."""
        self.state: IslandState | None = None

    # -- state ---------------------------------------------------------------------------------------------------

    def place(self, tree: PyTree) -> PyTree:
        """Copy a pytree (params or optimizer state) onto this island's mesh with its layouts."""
        return place_tree(tree, self.layout)

    def start(self, params: PyTree, opt_state: PyTree | None = None, step: int = 0, cursor: int = 0) -> None:
        """Begin from params with a fresh inner optimizer state and a zero residual (or resume: `restore`)."""
        self.layout.check(params)
        placed = self.place(params)
        opt = self.place(self.tx.init(placed) if opt_state is None else opt_state)
        named = flatten_named(placed, to_numpy=False)
        self._across = {n: _places(x) for n, x in named.items() if travels_across(x, self.uplink)}
        residual = self._spread_across(zero_residual(params, self.uplink))
        self.state = IslandState(params=placed, inner_opt_state=opt, residual=residual, step=step, data_cursor=cursor)
        self.stream.cursor = cursor
        self._step_fn = make_train_step(self.model.loss, self.tx, self.layout)
        self._warm = False

    def _spread_across(self, residual: Residual) -> Residual:
        """The residual of each leaf that travels in pieces across processes (`pieces_across`) laid out as that leaf,
        so each process holds, feeds back and checkpoints its own regions; the others' as they are (host arrays)."""
        if residual is None or not self._across:
            return residual
        return {**residual, **self.place({name: residual[name] for name in self._across})}

    def pieces_across(self) -> frozenset[str]:
        """The leaves of θ split across this island's processes whose Δ travels in pieces: each process forms, feeds
        back and encodes only its own (diloco/worker/island_group.py gathers them)."""
        return frozenset(self._across)

    def place_leaf(self, name: str, host: np.ndarray) -> jax.Array:
        """One leaf of θ (`name`) put on this island's mesh as `place` puts it: a process of a multi-process island
        places each leaf of a new θ as it arrives (diloco/worker/island_group.py), never holding the whole θ."""
        return self.place({name: host})[name]

    def own_reference(self, name: str, host: np.ndarray) -> np.ndarray | Split:
        """What `take_delta` needs of the reference leaf `name`: this process's regions of it (a partial `Split`) when
        the leaf travels in pieces across processes (`pieces_across`), else all of it."""
        places = self._across.get(name)
        if places is None:
            return host
        return Split(host.shape, tuple((offset, np.array(host[where])) for offset, where in places))

    def held_whole(self) -> bool:
        """This process holds every value of θ (not so on a multi-process island whose θ is split across its
        processes: it holds its own regions)."""
        assert self.state is not None
        return not any(held_in_part(x) for x in jax.tree.leaves(self.state.params))

    def restore(self, state: IslandState) -> None:
        """Continue from a saved state (a checkpoint restored into the layout of this island's fresh state)."""
        self.start(state.params, state.inner_opt_state, step=state.step, cursor=state.data_cursor)
        assert self.state is not None
        self.state = replace(self.state, residual=state.residual)

    def read_chunks(self, plan: Sequence[Span]) -> None:
        """data.sampling = "chunks": the next batches read `plan`, the spans the coordinator leased, from its start
        (islands/chunks.py)."""
        assert isinstance(self.stream, ChunkStream), "only a chunk stream reads leased spans"
        self.stream.begin(plan)

    def set_params(self, params: PyTree) -> None:
        """Adopt new global parameters; the inner optimizer state is kept (DiLoCo)."""
        assert self.state is not None, "start() the island first"
        self.state = replace(self.state, params=self.place(params))

    # -- training ------------------------------------------------------------------------------------------------

    def next_host_batch(self, params: PyTree = None) -> PyTree:
        """The stream's next batch as int32 [passes, sequences per pass, tokens] (a pytree batch: each leaf split so),
        on the host (cursor advanced). `params`: the θ a `PolicyBatches` stream draws with."""
        host = self.stream.next_for(params) if isinstance(self.stream, PolicyBatches) else self.stream.next()
        return jax.tree.map(lambda x: x.reshape(self.passes, x.shape[0] // self.passes, *x.shape[1:]), host)

    def next_batch(self, params: PyTree = None) -> PyTree:
        host = self.next_host_batch(params)
        if self._batch_sharding.is_fully_addressable:
            return jax.device_put(host, self._batch_sharding)
        # A multi-process island (diloco/worker/island_group.py): every process draws the same batch k from the same
        # stream and hands its own devices only their rows. device_put would first compare the whole batch across
        # processes (an all-gather per step).
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(x.shape, self._batch_sharding, lambda index: x[index]), host
        )

    def _batch_shape(self) -> tuple[int, int, int]:
        """[passes, sequences per pass, tokens]: what `next_batch` puts on the mesh (a pytree batch's leaves add
        their own trailing axes to the first two, `_batch_spec`)."""
        return self.passes, self.stream.batch_size // self.passes, self.stream.seq_len + 1

    def _batch_spec(self) -> PyTree:
        """What `next_batch` puts on the mesh, as shapes: every leaf [passes, sequences per pass, ...]."""
        passes, rows, _ = self._batch_shape()
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((passes, rows, *x.shape[1:]), x.dtype, sharding=self._batch_sharding),
            empty_batch(self.stream),
        )

    def abstract_state(self) -> tuple[PyTree, PyTree] | None:
        """(params, inner optimizer state) as shapes with the layouts `place` gives them: no memory, no values. None
        when the model's init cannot be traced without running it (a custom model may do host work there)."""
        try:
            params = jax.eval_shape(self.model.init, jax.random.key(0))
            opt_state = jax.eval_shape(self.tx.init, params)
        except Exception:  # whatever the user's code raises under tracing: the check waits for the real state
            return None

        self.layout.check(params)
        return self.layout.shapes(params), self.layout.shapes(opt_state)

    def check_memory(self, params: PyTree = None, opt_state: PyTree = None) -> Any:
        """Compile the inner step for this state (default: `abstract_state`, before any exists) and raise
        OutOfMemoryError when one step needs more than the devices (on CPU, the host) have free now.

        Returns the compiled step (`jax.stages.Compiled`; None when there is no state and none can be traced). jit's
        cache keeps it, so the train step does not compile again: the check costs no second compilation. No check
        where XLA or the device cannot tell (islands/memory.py).
        """
        if params is None:
            abstract = self.abstract_state()
            if abstract is None:
                return None
            params, opt_state = abstract
        compiled = self._compile_step(params, opt_state)
        passes, rows, tokens = self._batch_shape()
        split = f" in {passes} passes of {rows}" if passes > 1 else ""
        mine = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        message = verdict(
            f"island {self.name}",
            Footprint.of(compiled),
            device_room(mine),
            f"one train step (batch {self.stream.batch_size} x {tokens} tokens{split})",
            self.step_advice(),
        )
        if message is not None:
            raise OutOfMemoryError(message)
        return compiled

    def step_advice(self) -> str:
        """The settings that shrink this island's train step (islands/memory.py, `step_advice`)."""
        batch, layout = self.stream.batch_size, self.layout
        return step_advice(batch, self.microbatch, self.passes, self.mesh.size, layout.shard_params, self.remat)

    def _compile_step(self, params: PyTree, opt_state: PyTree) -> Any:
        step = make_train_step(self.model.loss, self.tx, self.layout)
        return step.lower(params, opt_state, self._batch_spec()).compile()

    def step_footprint(self) -> Footprint | None:
        """XLA's figure for one train step of this island, per device, from the state's shapes alone (the process's
        cost model: diloco/run/memory_plan.py). None where XLA or the model's init cannot say. The compilation is
        `check_memory`'s, which jit's cache keeps."""
        abstract = self.abstract_state()
        return None if abstract is None else Footprint.of(self._compile_step(*abstract))

    def _warm_up(self) -> None:
        """Compile the inner step (`check_memory`, now that this island's state and its neighbours' are held) and run
        it once on copies of the state and a batch of zeros (results dropped, no batch consumed), so that no timed
        step, step budget or slowdown ever includes the compilation."""
        assert self.state is not None and self._step_fn is not None
        compiled = self.check_memory(self.state.params, self.state.inner_opt_state)
        batch = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), self._batch_spec())
        out = compiled(self.place(self.state.params), self.place(self.state.inner_opt_state), batch)
        jax.block_until_ready(out)
        self._warm = True

    def train(self, n_steps: int) -> InnerRun:
        """Run n inner steps. Losses stay on device until the end so the host never stalls the pipeline."""
        assert self.state is not None and self._step_fn is not None, "start() the island first"
        if not self._warm:
            self._warm_up()
        params, opt_state = self.state.params, self.state.inner_opt_state
        losses: list[jax.Array] = []
        figures: dict[str, list[jax.Array]] = {name: [] for name in self.model.step_figures}
        t0 = time.perf_counter()
        for i in range(n_steps):
            # A loss that draws is keyed by the inner step, which the saved state carries: a resume draws the same.
            draw = () if self._island_key is None else ((self._island_key, np.uint32(self.state.step + i)),)
            params, opt_state, metrics = self._step_fn(params, opt_state, self.next_batch(params), *draw)
            losses.append(metrics["loss"])
            for name, values in figures.items():
                values.append(metrics[name])
        # The finiteness of θ is queued behind the last step and read back with the losses: one wait on the device,
        # not two. A second round trip would cost every call, and a streaming island calls every few short steps.
        host_losses, host_figures, finite = jax.device_get((losses, figures, _all_finite(params)))
        took = time.perf_counter() - t0
        lasts = max(self.slowdown * took, n_steps * self.device_step_s)
        if lasts > took:
            time.sleep(lasts - took)
        seconds = time.perf_counter() - t0
        return self.step_to(
            params,
            opt_state,
            np.asarray(host_losses, np.float32),
            seconds,
            params_finite=bool(finite),
            figures={name: np.asarray(values, np.float32) for name, values in host_figures.items()},
        )

    def step_to(
        self,
        params: PyTree,
        opt_state: PyTree,
        losses: np.ndarray,
        seconds: float,
        params_finite: bool | None = None,
        figures: Mapping[str, np.ndarray] | None = None,
    ) -> InnerRun:
        """Move the state to what len(losses) inner steps from it produced (on batches drawn from this island's
        stream, whose cursor is past them), once `check_finite` passed: `train`'s last part, also
        the way back of islands/vectorized.py, which steps many islands at once. `params_finite`: already read."""
        assert self.state is not None, "start() the island first"
        first_step, n_steps = self.state.step, len(losses)
        self.check_finite(losses, params, first_step, params_finite)
        self.state = replace(
            self.state,
            params=params,
            inner_opt_state=opt_state,
            step=first_step + n_steps,
            data_cursor=self.stream.cursor,
        )
        tokens = n_steps * self.stream.batch_size * self.stream.seq_len
        return InnerRun(losses=losses, tokens=tokens, seconds=seconds, first_step=first_step, figures=figures or {})

    def check_finite(
        self, losses: np.ndarray, params: PyTree, first_step: int, params_finite: bool | None = None
    ) -> None:
        """Raise DivergedError naming the first inner step whose loss is NaN/Inf, or the parameters if they are.

        Checked once per `train` call rather than per step, because reading a loss back every step would stall the
        device pipeline; the first bad step is still named exactly. The parameters are checked too (one reduction
        on device) because the last step's update can overflow after a finite loss, and Δ is formed from them.
        """
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            i = int(bad[0])
            before = f" (it was {losses[i - 1]:.4g} at step {first_step + i})" if i > 0 else ""
            raise DivergedError(
                f"island {self.name} diverged: loss is {losses[i]} at inner step {first_step + i + 1}{before}; "
                f"{divergence_advice(self.inner)}"
            )
        if not (bool(_all_finite(params)) if params_finite is None else params_finite):
            last = f" (loss {losses[-1]:.4g})" if len(losses) else ""
            raise DivergedError(
                f"island {self.name} diverged: its parameters hold NaN or Inf after inner step "
                f"{first_step + len(losses)}{last}; {divergence_advice(self.inner)}"
            )

    def train_for(self, budget_s: float, max_steps: int) -> InnerRun:
        """As many inner steps as fit `budget_s` seconds of training: at least one, at most `max_steps`; with no
        budget (`budget_s` <= 0: train.round_seconds = 0), exactly `max_steps`.

        Trained in chunks sized by the step time measured so far (no per-step host sync on a fast device), each
        chunk at most what the budget still holds, so the budget is overrun by at most one step's time.
        """
        if budget_s <= 0:
            return self.train(max_steps)
        runs = [self.train(1)]
        done, spent = 1, runs[0].seconds
        while done < max_steps:
            chunk = min(max_steps - done, int((budget_s - spent) / (spent / done)))
            if chunk < 1:
                break
            runs.append(self.train(chunk))
            done, spent = done + chunk, spent + runs[-1].seconds
        return InnerRun.joined(runs)

    def encode_delta(self, run: InnerRun, reference: dict[str, PyTree]) -> RoundPush:
        """Δ = reference - θ_local over the leaves `reference` names (all of θ, or one fragment's), encoded with
        this island's error feedback for those leaves: what a push sends. `run`: the steps trained since that
        fragment last synced. The residual is not changed here: the caller decides whether the push counted
        (`keep_residual`)."""
        return self.take_delta(run, reference).encode()

    def take_delta(self, run: InnerRun, reference: dict[str, PyTree]) -> TakenDelta:
        """`encode_delta` without its encoding: Δ is formed now, before the next inner step replaces θ.

        On the host: each leaf of θ_local is read back once and subtracted there, where the global copy and the
        codec are. A subtraction on the device would send the reference over and Δ back (twice the bytes) and pay a
        dispatch per leaf, which costs the training thread more than the host's subtraction does. A leaf split over
        the island's devices is read shard by shard, each shard's Δ a piece of its tensor (`pytrees.pieces`)."""
        assert self.state is not None
        local = flatten_named(self.state.params, to_numpy=False)
        delta = {name: delta_of(reference[name], local[name], self.uplink) for name in reference}
        residual = None
        if self.state.residual is not None:
            residual = {name: self.state.residual[name] for name in reference}
            # This process's regions of a residual laid out across processes (`_spread_across`), as the Δ pieces are.
            residual = {n: own_pieces(r) if held_in_part(r) else r for n, r in residual.items()}
        return TakenDelta(run, delta, residual, self.uplink, self.feedback_decay)

    def keep_residual(self, push: RoundPush) -> None:
        """The push reached the coordinator's round: keep what its codec dropped, to send next round.

        This is the one place where the drivers may differ: `simulate` delivers every push, so it always keeps the
        residual; an island process keeps it only when the coordinator accepted the push. A refused push never
        reached θ, so its residual must not be carried either (its Δ is simply lost, as the fault model says).
        """
        assert self.state is not None
        if self.state.residual is not None and push.sent.residual is not None:
            kept = {
                name: spread(r, self.state.residual[name]) if isinstance(r, Split) else r
                for name, r in push.sent.residual.items()
            }
            self.state = replace(self.state, residual={**self.state.residual, **kept})

    def merge(
        self, global_fragment: dict[str, PyTree], alpha: float = 0.0, on_mesh: dict[str, PyTree] | None = None
    ) -> None:
        """θ_p <- α·θ_p,local + (1 - α)·θ_p,global for the leaves `global_fragment` names (Streaming DiLoCo's merge).

        α = 0 takes the global leaves as they are (no float op), so every island holds them bit for bit. `on_mesh`:
        those leaves already placed on this island's mesh (`place`, by a thread that had the time), used as they
        are when α = 0; the island owns them from here on (the next step donates them).
        """
        assert self.state is not None, "start() the island first"
        local = flatten_named(self.state.params, to_numpy=False)
        if alpha == 0.0:
            placed = on_mesh if on_mesh is not None else self.place(dict(global_fragment))
        else:
            # A leaf a process of a multi-process island placed as it arrived stays on the devices.
            placed = self.place(
                {
                    n: alpha * local[n] + (1.0 - alpha) * (g if isinstance(g, jax.Array) else np.asarray(g))
                    for n, g in global_fragment.items()
                }
            )
        # Only the fragment's leaves are placed (copied onto the mesh): the others are this island's own, already
        # there. Placing all of θ would copy the whole model at every one of the P merges of a round.
        self.state = replace(self.state, params=unflatten_named({**local, **placed}, self.state.params))
