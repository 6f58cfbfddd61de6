"""The island's inner optimizer and its jitted train step (the H inner steps of DiLoCo).

AdamW (or Muon for the hidden layers' matrices and AdamW for the rest: inner.kind) with linear warmup and cosine
decay (or warmup-stable-decay, whose shape does not depend on the run's length), global-norm gradient clipping, and
gradient accumulation over `passes` micro-batches so that the island's batch is the same whatever its device count
(a post-training loss divides by the whole batch's counts of tokens, pairs or answers: `WholeBatchLoss`).
The step is jitted with explicit shardings over the island's mesh and donates the parameters and optimizer state.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from optax.contrib import MuonDimensionNumbers

from floor.errors import UserError
from islands.config import InnerConfig
from islands.mesh import Layout, replicated
from pytrees.encode import aligned_copy
from pytrees.naming import path_name

PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, dict[str, jax.Array]]]
"""(params, batch) -> (loss, metrics): a model's loss, or a workload's (islands/workloads/losses.py), whose batch is a
dict of arrays."""


def learning_rate_schedule(cfg: InnerConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
    """The inner learning rate at each inner step of a schedule of `total_steps` (inner.schedule), rising to
    `peak` (default inner.lr; Muon's matrices follow the same shape to inner.muon_lr)."""
    peak = cfg.lr if peak is None else peak
    if cfg.schedule == "wsd":
        return warmup_stable_decay(cfg, total_steps, peak)
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=peak * cfg.min_lr_ratio,
    )


def warmup_stable_decay(cfg: InnerConfig, total_steps: int, peak: float) -> optax.Schedule:
    """Linear warmup to `peak` over inner.warmup_steps, held, then from inner.decay_start_step (0: never) a linear
    decay to peak * min_lr_ratio over inner.decay_steps (0: to `total_steps`), held there after.

    Until the decay starts, the rate at a step depends on nothing but the step: a run planned for 8 rounds and
    lengthened to 16 on resume, with the decay started then, trains exactly as one planned for 16 from the start.
    """
    floor = peak * cfg.min_lr_ratio
    start = cfg.decay_start_step
    length = max(cfg.decay_steps or total_steps - start, 1)

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        warm = peak * jnp.minimum(step / max(cfg.warmup_steps, 1), 1.0) if cfg.warmup_steps else jnp.float32(peak)
        if not start:
            return warm
        done = jnp.clip((step - start) / length, 0.0, 1.0)
        return jnp.where(step < start, warm, peak + (floor - peak) * done)

    return schedule


MUON_MATRICES = ("wqkv", "wq", "wk", "wv", "wo", "w1", "w2", "w_gate", "w_up", "w_down", "router")
"""The names of a block's weight matrices (islands/models/transformer.py, moe.py and llama.py): Muon's share."""


class MuonError(UserError, ValueError):
    """inner.kind = "muon" on a model that has no hidden-layer matrix for Muon to take."""


def muon_dimensions(params: PyTree) -> PyTree:
    """Which parameters Muon takes, in the form of optax.contrib.muon's `muon_weight_dimension_numbers`: a
    `MuonDimensionNumbers` for each of them (the matrix axes), None for each leaf AdamW takes.

    MuLoCo's split (arXiv 2505.23725, after Keller Jordan's Muon): Muon's orthogonalized update is steepest descent
    under the spectral norm of a linear map between hidden vectors, so it takes the weight matrices inside the
    transformer blocks (a leaf under `blocks/` named in MUON_MATRICES: attention wqkv or wq, wk, wv, and wo, the
    feed-forward w1 and w2 or SwiGLU's w_gate, w_up and w_down (a shared expert's too), the mixture-of-experts router;
    a stack of experts [E, D, F] is E matrices, each orthogonalized on its own). AdamW takes the rest: the token and
    position embeddings (tables looked up by index, not maps of hidden vectors; the token table is also the tied
    output head, which MuLoCo leaves to AdamW, as it leaves an untied lm_head), the norms' scales and biases, the
    attention and feed-forward biases (vectors, or stacks of them per expert) and a shared expert's gate [D, 1]. A
    model with nothing for Muon (a user model without `blocks/`) is refused in one line rather than trained as AdamW
    under Muon's name."""

    def dimensions(path: tuple[Any, ...], leaf: jax.Array) -> MuonDimensionNumbers | None:
        parts = path_name(path).split("/")
        if parts[0] != "blocks" or parts[-1] not in MUON_MATRICES or leaf.ndim not in (2, 3):
            return None
        return MuonDimensionNumbers(reduction_axis=leaf.ndim - 2, output_axis=leaf.ndim - 1)

    dims = jax.tree_util.tree_map_with_path(dimensions, params)
    if not jax.tree.leaves(dims, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers)):
        raise MuonError(
            'inner.kind = "muon" finds no hidden-layer weight matrix in this model (Muon takes the leaves '
            f'blocks/.../{{{",".join(MUON_MATRICES)}}} of a transformer); use inner.kind = "adamw"'
        )
    return dims


@functools.lru_cache(maxsize=32)
def make_inner_optimizer(cfg: InnerConfig, total_steps: int) -> optax.GradientTransformation:
    """The inner.kind optimizer (after global-norm clipping) on the inner.schedule learning rate, over a schedule of
    inner.schedule_steps or, when that is 0, `total_steps`. Cached: the islands of one process get the same
    transformation, so `make_train_step`'s cache (keyed by it) gives them one compiled step, not one each.

    Muon is optax.contrib.muon: Nesterov momentum, 5 Newton-Schulz steps, the update scaled by
    sqrt(max(1, fan_out / fan_in)), on the matrices `muon_dimensions` picks; the other parameters get the AdamW
    that optax.contrib.muon holds inside, with inner.lr, b1, b2, eps and weight_decay (optax gives it Muon's
    Nesterov flag, so it is Nesterov AdamW: the one difference from inner.kind = "adamw" on those parameters)."""
    span = cfg.schedule_steps or total_steps
    if cfg.kind == "muon":
        opt = optax.contrib.muon(
            learning_rate=learning_rate_schedule(cfg, span, cfg.muon_lr),
            beta=cfg.muon_momentum,
            eps=cfg.eps,
            weight_decay=cfg.muon_weight_decay,
            adam_b1=cfg.b1,
            adam_b2=cfg.b2,
            adam_weight_decay=cfg.weight_decay,
            adam_learning_rate=learning_rate_schedule(cfg, span),
            muon_weight_dimension_numbers=muon_dimensions,
        )
    else:
        opt = optax.adamw(
            learning_rate_schedule(cfg, span),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt) if cfg.clip_norm > 0 else opt


@runtime_checkable
class WholeBatchLoss(Protocol):
    """A loss whose every term and figure is a sum over the items of the rows it is given (answer tokens, pairs,
    answers) divided by the whole batch's count of them: `totals(batch)` counts them over a batch in passes, and
    `loss(params, one_pass, totals)` is that pass's share, so the passes' shares add up to the loss and gradient of
    the batch taken at once, however the items fall into passes (transformers' `num_items_in_batch`, which TRL's
    trainers divide by under gradient accumulation). The post-training losses are such
    (islands/workloads/losses.py, `WorkloadLoss`); a loss that is not, such as the lm loss (a mean over windows of
    one length, so over passes of equal weight), has its passes' means averaged."""

    def totals(self, batch: PyTree) -> PyTree: ...

    def __call__(
        self, params: PyTree, batch: PyTree, totals: PyTree = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...


def _accumulated_grads(
    loss_fn: LossFn, params: PyTree, batch: PyTree, key: jax.Array | None = None
) -> tuple[jax.Array, PyTree, dict]:
    """Loss and gradient over the leading `passes` axis of batch [passes, seqs, tokens+1] (or of every leaf of a
    pytree batch, [passes, seqs, ...]: a post-training workload's, islands/workloads/batches.py): a
    `WholeBatchLoss`'s passes' shares (and figures) summed, another loss's passes' means averaged. `key`: the step's,
    for a `DrawingLoss`, whose pass p draws from it with p folded in (each pass its own masks); without one, no pass
    index is made, so the program of a loss that draws nothing is what it was before losses drew."""
    passes = jax.tree.leaves(batch)[0].shape[0]
    whole = isinstance(loss_fn, WholeBatchLoss)
    totals = loss_fn.totals(batch) if whole and passes > 1 else None

    def grad_of(micro: PyTree, index: Any = None) -> tuple[tuple[jax.Array, dict], PyTree]:
        loss = loss_fn if key is None else loss_fn.keyed(jax.random.fold_in(key, index))  # type: ignore[attr-defined]
        share = loss if totals is None else functools.partial(loss, totals=totals)
        return jax.value_and_grad(share, has_aux=True)(params, micro)

    if passes == 1:
        (loss, metrics), grads = grad_of(jax.tree.map(lambda leaf: leaf[0], batch), 0)
        return loss, grads, metrics

    def one_pass(carry: tuple, micro: Any) -> tuple[tuple, dict]:
        loss_sum, grad_sum = carry
        (loss, metrics), grads = grad_of(micro) if key is None else grad_of(*micro)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    micros = batch if key is None else (batch, jnp.arange(passes, dtype=jnp.uint32))
    (loss_sum, grad_sum), metrics = jax.lax.scan(one_pass, (jnp.zeros((), jnp.float32), zeros), micros)
    if whole:
        return loss_sum, grad_sum, jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)
    scale = 1.0 / passes
    return loss_sum * scale, jax.tree.map(lambda g: g * scale, grad_sum), jax.tree.map(jnp.mean, metrics)


def place_tree(tree: PyTree, layout: Layout) -> PyTree:
    """Put every leaf on the layout's mesh where `Layout.sharding` puts its name and shape.

    Parameters and the optimizer moments that mirror them (the same last path parts) get the same layout; scalars
    (step counts) are replicated.
    """
    # The result is donated to the train step, which must never free the caller's buffers (in `simulate` every
    # island starts from the coordinator's own global parameters). `may_alias=False` alone is not enough: putting a
    # one-device array on a replicated multi-device sharding reuses its buffer as the first shard (JAX 0.10.2), so
    # copy first and let the placement alias only the copy: a host array on the host (a memcpy, 64-byte aligned so
    # that XLA:CPU takes it as it is rather than copying it once more), a device array on its device. All leaves go
    # in one batched device_put (a streaming island places a fragment at every merge).
    #
    # A host leaf bound for devices of several processes (a multi-process island) is put by each process on its own
    # devices, region by region: `device_put` would first check that every process passed the same value, an
    # all-gather of the whole leaf onto every device, which an island split across its processes has no room for.
    #
    # A leaf given as its shape alone (an island process's θ_0: diloco/run/setup.py `build_setup(theta=False)`) is
    # zeros, made on the devices in its layout.
    leaves, treedef = jax.tree.flatten(tree)
    shardings = jax.tree.leaves(layout.shardings(tree))
    placed = {
        i: _zeros(x.shape, x.dtype, s)  # made where they belong: nobody else holds them, no copy is owed
        for i, (x, s) in enumerate(zip(leaves, shardings, strict=True))
        if isinstance(x, jax.ShapeDtypeStruct)
    }
    for i, (x, sharding) in enumerate(zip(leaves, shardings, strict=True)):
        if i not in placed and isinstance(x, np.ndarray) and not sharding.is_fully_addressable:
            placed[i] = jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: aligned_copy(x[index]))
    local = [i for i in range(len(leaves)) if i not in placed]
    copies = [
        aligned_copy(leaves[i]) if isinstance(leaves[i], np.ndarray) else jnp.array(leaves[i], copy=True) for i in local
    ]
    placed.update(zip(local, jax.device_put(copies, [shardings[i] for i in local]), strict=True))
    return jax.tree.unflatten(treedef, [placed[i] for i in range(len(leaves))])


def _zeros(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.Array:
    """Zeros of `shape` made on the devices of `sharding`, each its shard, laid out exactly as `sharding` says."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)()


def _constrain(tree: PyTree, layout: Layout) -> PyTree:
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, layout.shardings(tree))


TrainStep = Callable[..., tuple[PyTree, PyTree, dict[str, jax.Array]]]
"""(params, opt_state, batch) -> (params, opt_state, metrics); (params, opt_state, batch, draw) for a loss that
draws (`WithDraw`)."""


def inner_update(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    params: PyTree,
    opt_state: PyTree,
    batch: PyTree,
    key: jax.Array | None = None,
) -> tuple[PyTree, PyTree, dict[str, jax.Array]]:
    """One inner step on one island's batch [passes, seqs, tokens+1] (or a pytree of leaves [passes, seqs, ...]), not
    jitted: the body that `make_train_step` jits over an island's mesh and islands/vectorized.py maps over an axis of
    islands. `key`: the step's, which a `DrawingLoss` draws from (`step_key`); None for a loss that draws nothing."""
    loss, grads, metrics = _accumulated_grads(loss_fn, params, batch, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}


@runtime_checkable
class FrozenLoss(Protocol):
    """A loss that reads arrays it does not train (workload.lora's frozen base, islands/models/lora.py): `frozen`,
    and `bind(frozen)`, the same loss reading the `frozen` it is given. The programs that run it take them as an
    argument (`WithFrozen`): arrays a traced function closes over are compiled into the program as constants, a copy
    of the base in every executable."""

    frozen: PyTree

    def bind(self, frozen: PyTree) -> LossFn: ...


@dataclass(frozen=True, eq=False)
class WithFrozen:
    """A jitted program whose last argument is a loss's frozen arrays, called, lowered and compiled without it: the
    arrays are handed over at every call, placed once on the program's mesh. What `lower` and `compile` give reads
    as JAX's own (`Lowered`, `Compiled`: their other attributes pass through)."""

    program: Any
    frozen: PyTree

    def __call__(self, *args: Any) -> Any:
        return self.program(*args, self.frozen)

    def lower(self, *args: Any) -> WithFrozen:
        return WithFrozen(self.program.lower(*args, self.frozen), self.frozen)

    def compile(self) -> WithFrozen:
        return WithFrozen(self.program.compile(), self.frozen)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.program, name)


@runtime_checkable
class DrawingLoss(Protocol):
    """A loss that may draw random numbers in training (workload.lora.dropout's masks, islands/models/lora.py
    `AdapterLoss`): `draws`, whether it does, and `keyed(key)`, the same loss drawing from `key`. Called without a
    key (evaluation) it draws nothing. The train step of one that draws takes a `Draw` per step (`make_train_step`)."""

    @property
    def draws(self) -> bool: ...

    def keyed(self, key: jax.Array) -> LossFn: ...


def draws(loss_fn: LossFn) -> bool:
    """Whether `loss_fn` draws random numbers in training: its train step then takes a `Draw` (`make_train_step`)."""
    return isinstance(loss_fn, DrawingLoss) and loss_fn.draws


Draw = tuple[np.ndarray, np.ndarray]
"""What a step of a loss that draws is keyed by: its island's key data (`island_key`, uint32) and the island's inner
step (uint32 []), host values that every process of an island passes alike. The step folds them into its key
(`step_key`)."""


def island_key(seed: int, island: str) -> np.ndarray:
    """The key data (uint32) of island `island`'s draws in a run of `seed` (run.seed): the seed's key with the name's
    CRC-32 folded in. A name, not a position: an island draws the same in `diloco simulate` and in its own process of
    `diloco launch`, admitted or configured, and two islands draw differently."""
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(island.encode()))
    return np.asarray(jax.random.key_data(key))


def step_key(draw: Draw) -> jax.Array:
    """The key of one inner step: the island's key with the step folded in, so a step draws the same whether the
    run got to it uninterrupted or resumed (the step is saved with the island's state), and every step differently."""
    data, step = draw
    return jax.random.fold_in(jax.random.wrap_key_data(data), step)


@dataclass(frozen=True, eq=False)
class WithDraw:
    """The train step of a loss that draws (`draws`): called as (params, opt_state, batch, draw), the `Draw` of the
    step. Lowered, compiled and warmed up without one (the draw of island "" at step 0: a warm-up's results are
    dropped), so what compiles and checks a step needs to know nothing of draws. What `lower` and `compile` give reads
    as JAX's own, as `WithFrozen`'s does."""

    program: Any

    def __call__(self, params: PyTree, opt_state: PyTree, batch: PyTree, draw: Draw | None = None) -> Any:
        return self.program(params, opt_state, batch, _no_draw() if draw is None else draw)

    def lower(self, params: PyTree, opt_state: PyTree, batch: PyTree, draw: Draw | None = None) -> WithDraw:
        return WithDraw(self.program.lower(params, opt_state, batch, _no_draw() if draw is None else draw))

    def compile(self) -> WithDraw:
        return WithDraw(self.program.compile())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.program, name)


def _no_draw() -> Draw:
    return island_key(0, ""), np.uint32(0)


def _bound(loss_fn: LossFn, frozen: PyTree) -> LossFn:
    return loss_fn.bind(frozen) if isinstance(loss_fn, FrozenLoss) else loss_fn


def _with_frozen(program: Any, loss_fn: LossFn, layout: Layout) -> Any:
    """`program` itself for a loss without frozen arrays, else `WithFrozen` with them laid out as parameters are."""
    if not isinstance(loss_fn, FrozenLoss):
        return program
    return WithFrozen(program, jax.device_put(loss_fn.frozen, layout.shardings(loss_fn.frozen)))


@functools.lru_cache(maxsize=32)
def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, layout: Layout) -> TrainStep:
    """jit(step) over the layout's mesh; params and optimizer state are donated and keep their layout.

    Inputs arrive placed by `place_tree` and batches by `batch_sharding`; the outputs are constrained to the
    same layouts, so the donated buffers are reused. Cached, so islands of one process share one compilation. A
    `FrozenLoss`'s frozen arrays are the program's last argument (`WithFrozen`); a loss that draws (`draws`) takes
    the step's `Draw` after the batch (`WithDraw`), and the step of one that does not has no such argument.
    """

    def step(params: PyTree, opt_state: PyTree, batch: PyTree, frozen: PyTree = None) -> tuple[PyTree, PyTree, dict]:
        params, opt_state, metrics = inner_update(_bound(loss_fn, frozen), tx, params, opt_state, batch)
        return _constrain(params, layout), _constrain(opt_state, layout), metrics

    def drawing(
        params: PyTree, opt_state: PyTree, batch: PyTree, draw: Draw, frozen: PyTree = None
    ) -> tuple[PyTree, PyTree, dict]:
        params, opt_state, metrics = inner_update(_bound(loss_fn, frozen), tx, params, opt_state, batch, step_key(draw))
        return _constrain(params, layout), _constrain(opt_state, layout), metrics

    if draws(loss_fn):
        return WithDraw(_with_frozen(jax.jit(drawing, donate_argnums=(0, 1)), loss_fn, layout))
    return _with_frozen(jax.jit(step, donate_argnums=(0, 1)), loss_fn, layout)


def make_eval_fn(loss_fn: LossFn, mesh: Mesh) -> Callable[[PyTree, jax.Array], jax.Array]:
    """Mean loss over a stack of batches [n, seqs, tokens+1] (params replicated or sharded as given)."""

    def evaluate(params: PyTree, batches: jax.Array, frozen: PyTree = None) -> jax.Array:
        loss = _bound(loss_fn, frozen)

        def cross_entropy(batch: jax.Array) -> jax.Array:
            value, metrics = loss(params, batch)
            return metrics.get("ce", value)  # eval reports cross-entropy, without auxiliary losses

        return jnp.mean(jax.lax.map(cross_entropy, batches))

    return _with_frozen(jax.jit(evaluate, out_shardings=replicated(mesh)), loss_fn, Layout(mesh))
