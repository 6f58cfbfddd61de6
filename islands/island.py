"""One island: its state, its mesh, and the H inner steps it runs between synchronisations.

The island owns `IslandState(step, params, inner_opt_state, residual, data_cursor)`. Between rounds it keeps its
inner AdamW state (DiLoCo keeps inner optimizer state across rounds) and replaces only its parameters with the
global ones. The same class runs inside `diloco simulate` (many islands in one process) and inside an island
process of `diloco launch`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np
import optax

from islands.data import BatchStream
from islands.inner import make_train_step, place_tree
from islands.mesh import accumulation_steps, batch_sharding, build_mesh
from islands.models import Model

PyTree = Any


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class IslandState:
    params: PyTree
    inner_opt_state: PyTree
    residual: PyTree = None
    """What the uplink codec dropped last round (error feedback); None until a lossy codec is used."""
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


class Island:
    """An island's training engine on a mesh of its local devices."""

    def __init__(
        self,
        name: str,
        model: Model,
        tx: optax.GradientTransformation,
        stream: BatchStream,
        n_devices: int = 1,
        microbatch: int = 0,
        shard_params: bool = False,
        devices: list[jax.Device] | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.tx = tx
        self.stream = stream
        self.mesh = build_mesh(n_devices, devices)
        self.shard_params = shard_params
        self.passes = accumulation_steps(stream.batch_size, microbatch, n_devices)
        self._batch_sharding = batch_sharding(self.mesh)
        self._step_fn: Callable | None = None
        self.state: IslandState | None = None

    # -- state ---------------------------------------------------------------------------------------------------

    def place(self, tree: PyTree) -> PyTree:
        """Copy a pytree (params or optimizer state) onto this island's mesh with its layouts."""
        return place_tree(tree, self.mesh, self.shard_params)

    def start(self, params: PyTree, opt_state: PyTree | None = None, step: int = 0, cursor: int = 0) -> None:
        """Begin (or resume) from params, with a fresh inner optimizer state unless one is given."""
        placed = self.place(params)
        opt = self.place(self.tx.init(placed) if opt_state is None else opt_state)
        self.state = IslandState(params=placed, inner_opt_state=opt, step=step, data_cursor=cursor)
        self.stream.cursor = cursor
        self._step_fn = make_train_step(self.model.loss, self.tx, self.mesh, self.shard_params)

    def set_params(self, params: PyTree) -> None:
        """Adopt new global parameters; the inner optimizer state is kept (DiLoCo)."""
        assert self.state is not None, "start() the island first"
        self.state = replace(self.state, params=self.place(params))

    # -- training ------------------------------------------------------------------------------------------------

    def next_batch(self) -> jax.Array:
        host = self.stream.next()
        host = host.reshape(self.passes, host.shape[0] // self.passes, host.shape[1])
        return jax.device_put(host, self._batch_sharding)

    def train(self, n_steps: int) -> InnerRun:
        """Run n inner steps. Losses stay on device until the end so the host never stalls the pipeline."""
        assert self.state is not None and self._step_fn is not None, "start() the island first"
        params, opt_state = self.state.params, self.state.inner_opt_state
        first_step = self.state.step
        losses = []
        t0 = time.perf_counter()
        for _ in range(n_steps):
            params, opt_state, metrics = self._step_fn(params, opt_state, self.next_batch())
            losses.append(metrics["loss"])
        host_losses = np.asarray(jax.device_get(losses), dtype=np.float32)
        seconds = time.perf_counter() - t0
        self.state = replace(
            self.state,
            params=params,
            inner_opt_state=opt_state,
            step=first_step + n_steps,
            data_cursor=self.stream.cursor,
        )
        tokens = n_steps * self.stream.batch_size * self.stream.seq_len
        return InnerRun(losses=host_losses, tokens=tokens, seconds=seconds, first_step=first_step)
