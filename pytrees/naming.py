"""Leaf names of a JAX pytree: ``blocks/0/attn/wq``, the names tensors travel and are checked under.

Every process names the leaves of the same tree the same way, in sorted name order, so a named dict is the form in
which pseudo-gradients, updates and θ are encoded, sent, fragmented (`outer_optimizer/fragments.py`) and rebuilt.
The walk is JAX's (`jax.tree_util`), which knows every registered pytree node, a user model's too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from floor.codec import CodecError

PyTree = Any
"""A JAX pytree (nested dicts, lists, tuples, registered dataclasses) of arrays: parameters, optimizer states,
pseudo-gradients. The project's one alias for it (outer_optimizer uses optax's `Params`/`Updates`)."""


def _key_name(k: Any) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def path_name(path: tuple[Any, ...]) -> str:
    """The name of the leaf at a `jax.tree_util` key path (``blocks/0/attn/wq``; a bare array is ``value``)."""
    return "/".join(_key_name(k) for k in path) or "value"


def _named_leaves(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = [(path_name(path), leaf) for path, leaf in paths]
    seen: set[str] = set()
    for name, _ in out:
        if name in seen:
            raise CodecError(f"two leaves of the tree share the name {name!r}")
        seen.add(name)
    return out, treedef


def shapes_of(tree: Any) -> Any:
    """``tree`` with each leaf replaced by its shape and dtype (``jax.ShapeDtypeStruct``): a template for
    :func:`unflatten_named` that holds no values."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def to_host(x: Any) -> Any:
    """A leaf as a host numpy array: numpy and scalars as `np.asarray` gives them (no copy), a JAX array copied shard by
    shard into a new array.

    `np.asarray` of a JAX array keeps the host copy it makes inside the array, for as long as the array lives: an
    island's θ read for its Δ would hold a second θ until the next step, and θ_0 read by the first commit would hold
    one for the whole run. Copying each shard's buffer into an array of our own leaves nothing behind.

    A multi-process island's leaf spans every process's devices; each process holds all of it when it is split only
    over that process's devices (islands.tensor; replicated across processes), and reads it from them. A leaf split
    across processes (`held_in_part`: islands.shard_params over processes) is read by pieces instead
    (`islands.island.delta_of`): here it is a ValueError."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    out = np.empty(x.shape, x.dtype)
    if x.is_fully_addressable:
        for shard in x.addressable_shards:
            if shard.replica_id == 0:
                out[shard.index] = np.asarray(shard.data)
        return out
    if x.is_fully_replicated:
        return np.asarray(x)
    if held_in_part(x):
        raise ValueError(f"a leaf of shape {x.shape} is split across processes: this process holds part of it")
    for shard in {_index_key(s.index): s for s in x.addressable_shards}.values():
        out[shard.index] = np.asarray(shard.data)
    return out


def held_in_part(x: Any) -> bool:
    """A JAX array of which this process's devices hold only some values: a leaf split across the processes of a
    multi-process island (FSDP over them)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return False
    local = {_index_key(s.index) for s in x.addressable_shards}
    return local != {_index_key(index) for index in x.sharding.devices_indices_map(x.shape).values()}


def _index_key(index: tuple[slice, ...]) -> str:
    """A shard's place in its array as a hashable text."""
    return repr([(s.start, s.stop) for s in index])


def flatten_named(tree: Any, *, to_numpy: bool = True) -> dict[str, Any]:
    """Leaves of ``tree`` keyed by their path (``blocks/0/attn/wq``), in sorted name order.

    Dict keys, sequence indices and dataclass attribute names are joined with ``/``; a bare array is named
    ``value``. Leaves come to the host by `to_host`; with ``to_numpy=False`` they stay JAX arrays (so :func:`encode`
    quantizes them on their own device).
    """
    leaves, _ = _named_leaves(tree)
    conv = to_host if to_numpy else (lambda a: a)
    return {name: conv(leaf) for name, leaf in sorted(leaves, key=lambda kv: kv[0])}


def unflatten_named(named: Mapping[str, Any], like_tree: Any) -> Any:
    """Rebuild a tree shaped like ``like_tree`` from ``named``; names and shapes must match exactly."""
    leaves, treedef = _named_leaves(like_tree)
    want = {n for n, _ in leaves}
    missing, extra = sorted(want - named.keys()), sorted(named.keys() - want)
    if missing or extra:
        raise CodecError(f"tensor names do not match the tree: missing {missing[:5]}, unexpected {extra[:5]}")
    out = []
    for name, like in leaves:
        arr = named[name]
        like_shape = tuple(np.shape(like))
        if tuple(np.shape(arr)) != like_shape:
            raise CodecError(f"tensor {name!r} has shape {tuple(np.shape(arr))}, expected {like_shape}")
        out.append(arr)
    return jax.tree_util.tree_unflatten(treedef, out)
