"""The inner steps of many islands as one program: `diloco simulate`'s vectorized path (train.vectorize).

`simulate` runs M islands in one process. Stepped one at a time (`Island.train`), every inner step of every island is
a dispatch of its own, and on a small model that overhead (Python, argument handling, a launch per step) costs as
much as the step itself. `IslandStack.train(n)` runs n inner steps of all M islands together:

    stack     each island's params and inner optimizer state, leaf by leaf, along a new leading island axis (one
              dispatch). The islands' own buffers are read, never donated: they stay the islands' until replaced.
    batches   n batches from each island's own stream (every cursor advances n, as `train` would advance it), as one
              int32 array [n, M, passes, sequences, tokens] and one transfer
    run       jit(scan over the n steps of vmap(inner_update) over the island axis): one dispatch for n steps of all
              islands. The stacked params and state are donated: they are this module's own copies.
    unstack   each island's slice as arrays of its own (one dispatch), with the island's layout; each island steps
              to its slice and its n losses (`Island.step_to`): `check_finite` under its own name, step counter, data
              cursor, InnerRun

so the islands stay the holders of their state between calls (push, merge, residuals, checkpoints see no difference)
and a run of n steps costs a few dispatches instead of n·M. Only a run of steps is vectorized; what happens between
runs (a sync, a merge) stays the island's own.

What it cannot do, the sequential path does: an island on a mesh of several devices (the island axis would need a
second mesh axis), a time budget or a slowdown (both need each island's own step time). The config refuses
train.vectorize with those (diloco/config.py), and `IslandStack` refuses islands that cannot share one program.

Numerics. Each island's step is the same function of its own state and batch, but vmap turns the islands' matrix
products into batched ones, which XLA may sum in another order: a vectorized run agrees with a sequential one to float
rounding, not bit for bit (tests/test_vectorized.py measures it). It is deterministic, so its own resume is exact.

Long runs of steps go in chunks of at most `CHUNK_BYTES` of batches, so the batches held on the device stay bounded;
dispatch is asynchronous, so the host draws a chunk's batches while the previous chunk runs. Each chunk length is
compiled once, ahead of the timed steps (as `Island._warm_up` keeps compilation out of a timed step), and checked
against the memory free (islands/memory.py) like an island's own step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from islands.inner import LossFn, inner_update
from islands.island import InnerRun, Island
from islands.memory import Footprint, OutOfMemoryError, device_room, verdict
from islands.mesh import replicated
from pytrees.naming import PyTree

CHUNK_BYTES = 64 << 20
"""At most this many bytes of batches go to the device in one program call (a run of n steps is split in chunks)."""


def _stack(trees: list[PyTree]) -> PyTree:
    """Leaf-wise stack of equally shaped pytrees along a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _unstack(tree: PyTree, count: int) -> list[PyTree]:
    """The `count` slices of `_stack`'s result, each a pytree of its own."""
    return [jax.tree.map(lambda leaf, i=i: leaf[i], tree) for i in range(count)]


def scan_steps(loss_fn: LossFn, tx: optax.GradientTransformation) -> Callable:
    """(params, opt_state, batches) -> (params, opt_state, losses): for stacked params and optimizer states (island
    axis first) and batches [n, islands, passes, sequences, tokens], n inner steps of every island (`inner_update`,
    the sequential step's body), losses [n, islands]. Not jitted."""
    step = jax.vmap(functools.partial(inner_update, loss_fn, tx))

    def run(params: PyTree, opt_state: PyTree, batches: jax.Array) -> tuple[PyTree, PyTree, jax.Array]:
        def one(carry: tuple[PyTree, PyTree], batch: jax.Array) -> tuple[tuple[PyTree, PyTree], jax.Array]:
            params, opt_state, metrics = step(*carry, batch)
            return (params, opt_state), metrics["loss"]

        (params, opt_state), losses = jax.lax.scan(one, (params, opt_state), batches)
        return params, opt_state, losses

    return run


class IslandStack:
    """Islands of one process whose runs of inner steps go as one program (module docstring).

    They must be able to share it: one model, one kind of inner optimizer (the first island's transformation is used;
    the islands of one run all have the one their config describes, `diloco.run.setup.make_island`), equal batches, one
    device each, the same one, and no slowdown.
    """

    def __init__(self, islands: Sequence[Island]) -> None:
        if not islands:
            raise ValueError("IslandStack needs at least one island")
        first = islands[0]
        for island in islands:
            why = _cannot_share(first, island)
            if why is not None:
                raise ValueError(f"islands {first.name} and {island.name} cannot be stepped as one program: {why}")
        self.islands = list(islands)
        self._layout = replicated(first.mesh)
        self._run = jax.jit(scan_steps(first.model.loss, first.tx), donate_argnums=(0, 1))
        self._stack = jax.jit(_stack, out_shardings=self._layout)
        self._unstack = jax.jit(_unstack, static_argnums=1, out_shardings=self._layout)
        self._compiled: dict[int, Any] = {}
        """Chunk length -> the compiled program (`jax.stages.Compiled`) of that many steps."""
        self._warm = False

    def chunks(self, n_steps: int) -> list[int]:
        """The lengths of the program calls that make a run of n_steps: as long as CHUNK_BYTES of batches allow."""
        first = self.islands[0]
        step_bytes = len(self.islands) * first.stream.batch_size * (first.stream.seq_len + 1) * 4
        longest = max(1, CHUNK_BYTES // step_bytes)
        return [longest] * (n_steps // longest) + ([n_steps % longest] if n_steps % longest else [])

    def train(self, n_steps: int) -> list[InnerRun]:
        """n inner steps of every island, as `Island.train(n_steps)` of each in turn would take them (to float
        rounding); one InnerRun per island, in island order.

        The islands trained together, so no island's own seconds can be measured: each is given an even share of
        the shared wall time (stack, batches, steps, losses, unstack), so their sum is the time the run took, as the
        sum of the sequential islands' seconds is. Raises DivergedError naming the first island (in island order)
        whose losses or parameters are not finite: the islands before it have taken their steps, as in turn, and the
        ones after it keep their states (a diverged run ends there)."""
        chunks = self.chunks(n_steps)
        programs = [self._program(k) for k in chunks]  # compiled before the clock starts
        if not self._warm:  # so are the stack and unstack (run once on the states, results dropped)
            jax.block_until_ready(self._unstack(self._stack(self._states()), len(self.islands)))
            self._warm = True
        t0 = time.perf_counter()
        params, opt_state = self._stack(self._states())
        losses = []
        for k, program in zip(chunks, programs, strict=True):
            host = np.stack([np.stack([island.next_host_batch() for island in self.islands]) for _ in range(k)])
            params, opt_state, chunk_losses = program(params, opt_state, jax.device_put(host, self._layout))
            losses.append(chunk_losses)
        host_losses = np.concatenate(jax.device_get(losses)) if losses else np.zeros((0, len(self.islands)))
        states = self._unstack((params, opt_state), len(self.islands))
        jax.block_until_ready(states)
        # Apportioned evenly: one program ran every island's steps, so the shared wall time is split M ways.
        seconds = (time.perf_counter() - t0) / len(self.islands)
        return [
            island.step_to(p, o, np.asarray(host_losses[:, i], dtype=np.float32), seconds)
            for i, (island, (p, o)) in enumerate(zip(self.islands, states, strict=True))
        ]

    def _program(self, n_steps: int) -> Any:
        """The compiled program of n_steps steps of every island (compiled once per length), checked against the
        memory free now."""
        if n_steps not in self._compiled:
            first, count = self.islands[0], len(self.islands)
            params, opt_state = (jax.tree.map(self._abstract, t) for t in jax.eval_shape(self._stack, self._states()))
            shape = (n_steps, count, first.passes, first.stream.batch_size // first.passes, first.stream.seq_len + 1)
            batches = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._layout)
            compiled = self._run.lower(params, opt_state, batches).compile()
            message = verdict(
                f"{count} islands stepped together (train.vectorize)",
                Footprint.of(compiled),
                device_room(list(first.mesh.devices.flat)),
                f"{n_steps} inner steps of each (batch {first.stream.batch_size} x {first.stream.seq_len + 1} tokens)",
                "set train.vectorize = false (one island's step at a time) or lower train.batch_size",
            )
            if message is not None:
                raise OutOfMemoryError(message)
            self._compiled[n_steps] = compiled
        return self._compiled[n_steps]

    def _states(self) -> list[tuple[PyTree, PyTree]]:
        """Every island's (params, inner optimizer state), in island order."""
        states = [island.state for island in self.islands]
        assert all(s is not None for s in states), "start() the islands first"
        return [(s.params, s.inner_opt_state) for s in states if s is not None]

    def _abstract(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._layout)


def _cannot_share(a: Island, b: Island) -> str | None:
    """Why islands a and b cannot run in one program, or None."""
    if b.model is not a.model:
        return "they train different models"
    if (b.stream.batch_size, b.stream.seq_len, b.passes) != (a.stream.batch_size, a.stream.seq_len, a.passes):
        return "their batches differ"
    if a.mesh.size != 1 or b.mesh.devices.tolist() != a.mesh.devices.tolist():
        return "each must have one device, the same one"
    if a.slowdown != 1.0 or b.slowdown != 1.0:
        return "a slowed island needs its own step time"
    return None
