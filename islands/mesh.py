"""The island's device mesh and how arrays are laid out on it.

An island is one single-controller JAX program over its local devices (CPU devices here, GPUs, or TPUs under
Pathways). It trains data parallel over a 1-D mesh axis "data"; with `shard_params` it also shards every
parameter (and so the optimizer state, which XLA lays out like the parameters) along that axis, FSDP style,
for models larger than one device. XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from floor.errors import UserError

AXIS = "data"


class MeshError(UserError, ValueError):
    """The island asked for devices it does not have, or a batch its devices cannot split."""


def build_mesh(n_devices: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh of the first `n_devices` of `devices` (default: every device of the JAX program, which for a
    multi-process island (jax.distributed) is every process's devices, in process order; else this process's)."""
    available = list(devices) if devices is not None else jax.devices()
    if n_devices > len(available):
        raise MeshError(
            f"islands.devices is {n_devices} but this process sees {len(available)} device(s); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n_devices}"
        )
    return Mesh(np.array(available[:n_devices]), (AXIS,))


def accumulation_steps(batch_size: int, microbatch: int, n_devices: int) -> int:
    """How many forward/backward passes make one island batch on this many devices.

    The island's batch is fixed by config; when devices are lost, passes are added so the batch (and so the
    optimisation trajectory) stays the same.
    """
    per_pass = microbatch * n_devices if microbatch else batch_size
    if per_pass > batch_size:
        per_pass = batch_size
    if batch_size % per_pass or per_pass % n_devices:
        raise MeshError(
            f"train.batch_size ({batch_size}) cannot be split into passes of train.microbatch ({microbatch}) "
            f"sequences on each of {n_devices} device(s)"
        )
    return batch_size // per_pass


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are [passes, sequences, tokens]: sequences split over the data axis."""
    return NamedSharding(mesh, P(None, AXIS))


def row_sharding(mesh: Mesh) -> NamedSharding:
    """Arrays of rows [B, ...] (prompts, generated tokens): rows split over the data axis."""
    return NamedSharding(mesh, P(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_sharding(mesh: Mesh, shape: tuple[int, ...], shard_params: bool) -> NamedSharding:
    """Replicated, or (FSDP) split along the largest dimension the mesh divides evenly."""
    n = mesh.shape[AXIS]
    if shard_params and n > 1:
        candidates = [d for d in range(len(shape)) if shape[d] % n == 0]
        if candidates:
            dim = max(candidates, key=lambda d: shape[d])
            spec = [None] * len(shape)
            spec[dim] = AXIS
            return NamedSharding(mesh, P(*spec))
    return replicated(mesh)
