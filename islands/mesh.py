"""The island's device mesh and how arrays are laid out on it.

An island is one single-controller JAX program over its local devices (CPU devices here, GPUs, or TPUs under
Pathways). Its mesh has two axes: "data" x "tensor" (islands.tensor wide, 1 by default). Batches split over the
data axis. The tensor axis splits each parameter along one of its logical axes (islands/models/axes.py), by the one
rules table `TENSOR_RULES` in the manner of MaxText's `logical_axis_rules`: attention heads, key/value heads, the
feed-forward's hidden width, the vocabulary or an expert stack, Megatron style (Shoeybi et al. 2019, arXiv
1909.08053: column-split projections into the heads and the hidden width, row-split ones out of them). With
`shard_params` every parameter is also split along the data axis (FSDP: the largest dimension that axis divides and
the tensor axis leaves), and so is the optimizer state, whose leaves mirror the parameters under the same names. XLA
(GSPMD) inserts the all-gathers, reduce-scatters and all-reduces; a layout changes where arrays live and which
collectives run, not what is computed.

The devices of the tensor axis are consecutive (one host's, in a multi-process island: islands.tensor divides each
process's islands.devices), so its per-layer collectives stay on the fastest links.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from floor.errors import UserError
from islands.models.axes import logical_axes
from pytrees.naming import path_name

DATA = "data"
TENSOR = "tensor"

TENSOR_RULES: tuple[str, ...] = ("experts", "heads", "kv_heads", "mlp", "vocab", "qkv")
"""The logical axes the tensor axis may split, in order of preference: a leaf is split along the first of its axes
in this list whose units the tensor axis divides (an expert stack by expert, not inside each expert's matrices; key/
value projections of fewer heads than the tensor axis stay whole, as MaxText keeps them); "embed" never is, so the
residual stream stays whole on each device and is what the data axis (FSDP) splits."""


class MeshError(UserError, ValueError):
    """The island asked for devices it does not have, a split they cannot make, or a batch they cannot split."""


def build_mesh(n_devices: int, devices: Sequence[jax.Device] | None = None, tensor: int = 1) -> Mesh:
    """A data x tensor mesh of the first `n_devices` of `devices` (default: every device of the JAX program, which
    for a multi-process island (jax.distributed) is every process's devices, in process order; else this process's);
    each row of `tensor` consecutive devices is one tensor group."""
    available = list(devices) if devices is not None else jax.devices()
    if n_devices > len(available):
        raise MeshError(
            f"islands.devices is {n_devices} but this process sees {len(available)} device(s); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n_devices}"
        )
    if tensor < 1 or n_devices % tensor:
        raise MeshError(f"islands.tensor ({tensor}) must divide the island's {n_devices} device(s)")
    return Mesh(np.array(available[:n_devices]).reshape(n_devices // tensor, tensor), (DATA, TENSOR))


def data_width(mesh: Mesh) -> int:
    """The devices a batch's sequences split over."""
    return mesh.shape[DATA]


def accumulation_steps(batch_size: int, microbatch: int, n_devices: int) -> int:
    """How many forward/backward passes make one island batch on this many devices of the data axis.

    The island's batch is fixed by config; when devices are lost, passes are added so the batch (and so the
    optimisation trajectory) stays the same.
    """
    per_pass = microbatch * n_devices if microbatch else batch_size
    if per_pass > batch_size:
        per_pass = batch_size
    if batch_size % per_pass or per_pass % n_devices:
        raise MeshError(
            f"train.batch_size ({batch_size}) cannot be split into passes of train.microbatch ({microbatch}) "
            f"sequences on each of {n_devices} device(s) of the data axis"
        )
    return batch_size // per_pass


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are [passes, sequences, tokens]: sequences split over the data axis."""
    return NamedSharding(mesh, P(None, DATA))


def row_sharding(mesh: Mesh) -> NamedSharding:
    """Arrays of rows [B, ...] (prompts, generated tokens): rows split over the data axis."""
    return NamedSharding(mesh, P(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def leaf_spec(
    shape: tuple[int, ...],
    axes: tuple[str | None, ...] | None,
    data: int,
    tensor: int,
    shard_params: bool,
    units: dict[str, int],
) -> P:
    """Where a leaf of `shape` with logical `axes` (None: unknown) lives on a data x tensor mesh: the tensor axis on
    the first dimension `TENSOR_RULES` names whose units (`units`, else its columns) it divides; with
    `shard_params`, the data axis on the largest other dimension it divides. Replicated where nothing divides."""
    spec: list[str | None] = [None] * len(shape)
    if tensor > 1 and axes:
        for logical in TENSOR_RULES:
            if logical in axes:
                dim = axes.index(logical)
                if shape[dim] % tensor == 0 and units.get(logical, shape[dim]) % tensor == 0:
                    spec[dim] = TENSOR
                    break
    if shard_params and data > 1:
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % data == 0]
        if free:
            spec[max(free, key=lambda d: shape[d])] = DATA
    return P(*spec) if any(spec) else P()


@dataclass(frozen=True)
class Layout:
    """How an island lays its parameters and optimizer state out: its mesh, FSDP along the data axis or not, and the
    units of the model's logical axes (`Model.axis_units`) that a tensor split keeps whole. Hashable: the compiled
    train step is cached by it."""

    mesh: Mesh
    shard_params: bool = False
    units: tuple[tuple[str, int], ...] = ()

    @property
    def tensor(self) -> int:
        return self.mesh.shape[TENSOR]

    def sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        """The layout of the leaf `name` (a parameter's, or an optimizer state's that mirrors it) of `shape`."""
        axes = logical_axes(name, len(shape))
        return NamedSharding(
            self.mesh, leaf_spec(shape, axes, data_width(self.mesh), self.tensor, self.shard_params, dict(self.units))
        )

    def shardings(self, tree: Any) -> Any:
        """`sharding` of every leaf of `tree` (arrays or shapes), as a tree of the same structure."""
        return jax.tree_util.tree_map_with_path(lambda p, x: self.sharding(path_name(p), np.shape(x)), tree)

    def shapes(self, tree: Any) -> Any:
        """`tree` as shapes (`jax.ShapeDtypeStruct`) with the layouts `sharding` gives them: what a step is compiled
        for before any state exists."""
        return jax.tree.map(
            lambda x, layout: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=layout), tree, self.shardings(tree)
        )

    def unnamed(self, params: Any) -> list[str]:
        """The leaves of `params` with no logical axes (a user model's): a tensor split cannot place them."""
        leaves = jax.tree_util.tree_leaves_with_path(params)
        return [path_name(p) for p, x in leaves if logical_axes(path_name(p), np.ndim(x)) is None]

    def check(self, params: Any) -> None:
        """Refuse, in one line, a tensor split of a model whose leaves say nothing of their axes."""
        if self.tensor > 1 and (unnamed := self.unnamed(params)):
            raise MeshError(
                f"islands.tensor = {self.tensor} splits parameters by their logical axes, and this model's leaf "
                f"{unnamed[0]!r} has none (a built-in model.kind has them; with model.kind = 'custom' use "
                "islands.tensor = 1, and islands.shard_params to split the parameters)"
            )
