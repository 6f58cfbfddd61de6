"""LoRA (Hu et al. 2021, arXiv 2106.09685): a frozen base θ and, for each adapted block matrix W [in, out], a pair
of low-rank factors, the adapted weight being W + (α / r)·A·B with A [in, r] and B [r, out].

What trains is the adapters alone, a pytree of its own (`Lora.init`):

    {"blocks": [{"attn": {"wq": {"lora_a": [D, r], "lora_b": [r, Hq*Dh]}, ...}, "ff": {...}}, ...]}

so the DiLoCo machinery (pseudo-gradients, codecs, error feedback, the outer step, digests, checkpoints) moves the
adapters and nothing else, and a run's θ is its adapters. The base is held by each process (`Lora.base`, float32
or bfloat16) and read by the loss (`adapt`), whose programs take it as an argument (islands/inner.py
`FrozenLoss`). A is drawn from N(0, 1/in) (the paper's random Gaussian at a fan-in scale, as PEFT's Kaiming init
is), B is zero: at step 0 every adapted weight is W exactly, so the model is the base's.

Applied unmerged in training: the loss reads the parameters with each adapted matrix an `Adapted` (W, A, B) that
`transformer.dense` applies as x·W + (α / r)·(x·A)·B (`Lora.adapted`; islands/models/adapted.py), so a step never
makes W' = W + (α / r)·A·B, nor, in its backward, W''s whole gradient xᵀ·g to get A's and B's from: an adapted
matrix costs its low-rank products, 2·r·(in + out) flops per token forward, not a full fine-tune's weight gradient.
Every other consumer of a model's parameters (the sampler, rl's rollouts, the held-out evaluation, export,
`diloco sample`) reads them merged (`Lora.merged`), without knowing about adapters.

Dropout (workload.lora.dropout = p, PEFT's `lora_dropout`) drops the adapters' input in training only:
x·W + (α / r)·(drop(x)·A)·B, inverted dropout (islands/models/adapted.py). The train step keys each pass of each
inner step (islands/inner.py `step_key`: run.seed, the island's name and its inner step, the pass's index folded
in), `AdapterLoss.keyed` holds the key and `Lora.adapted` folds each matrix's index in `targets` into it: every
matrix, pass, step and island draws its own mask, the same in `diloco simulate`, in a `diloco launch` of the same
config and after a resume. The merged parameters, and the loss called without a key (the corpus's evaluation),
drop nothing.

Which matrices: leaves under `blocks/` whose name is one of the targets (islands/models/config.py `LORA_MODULES`;
none given: the attention projections). A target matrix must be 2-D: a stack of experts [E, D, F] is refused in one
line (a shared expert's matrices, 2-D, are adapted). Embeddings, norms, biases and routers stay frozen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from islands.models.adapted import Adapted
from islands.models.base import Metrics, Model, Params
from islands.models.config import LORA_ATTENTION, ModelError
from islands.models.transformer import normal_init
from pytrees.digest import tree_digest
from pytrees.naming import flatten_named

A, B = "lora_a", "lora_b"
"""The names of an adapter's two factors, under its matrix's name (blocks/0/attn/wq/lora_a)."""


class LoraError(ModelError):
    """workload.lora names matrices this model cannot adapt (none of them, or a stack of experts)."""


def target_names(shapes: Mapping[str, tuple[int, ...]], targets: tuple[str, ...]) -> tuple[str, ...]:
    """The leaves (`flatten_named`'s names, sorted) that `targets` adapt in a model of these leaf shapes; () for the
    attention projections. A target that matches no leaf or a stack of experts is one LoraError line."""
    wanted = targets or LORA_ATTENTION
    matched: dict[str, list[str]] = {t: [] for t in wanted}
    for name in sorted(shapes):
        parts = name.split("/")
        if parts[0] == "blocks" and parts[-1] in matched:
            if len(shapes[name]) != 2:
                raise LoraError(
                    f"workload.lora.targets: {name} is a stack of experts {list(shapes[name])}; LoRA adapts 2-D "
                    "matrices (leave the experts' matrices out of the targets)"
                )
            matched[parts[-1]].append(name)
    have = sorted({n.rsplit("/", 1)[-1] for n in shapes if n.startswith("blocks/")})
    missing = [t for t in targets if not matched[t]]
    if missing or not any(matched.values()):
        what = f"names {missing[0]!r}" if missing else "(the attention projections, by default)"
        raise LoraError(
            f"workload.lora.targets {what}, which this model has no block matrix of (its block leaves: "
            f"{', '.join(have)})"
        )
    return tuple(n for names in matched.values() for n in names)


def _nest(named: Mapping[str, Any]) -> Params:
    """{"blocks/0/attn/wq/lora_a": x, ...} -> {"blocks": [{"attn": {"wq": {"lora_a": x}}}, ...]}: the blocks a list,
    as in the model's params (Streaming DiLoCo cuts fragments by layer)."""
    tree: dict[str, Any] = {}
    for name, value in named.items():
        node = tree
        *path, last = name.split("/")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    n_blocks = 1 + max(int(i) for i in tree["blocks"])
    tree["blocks"] = [tree["blocks"].get(str(i), {}) for i in range(n_blocks)]
    return tree


def _over(base: Any, adapters: Any, adapted: Callable[[Any, Any, Any, str], Any], name: str = "") -> Any:
    """`base` with each adapted matrix W replaced by `adapted(W, A, B, its name)` (`flatten_named`'s:
    blocks/0/attn/wq) and every other leaf cast to float32."""
    if isinstance(adapters, dict) and A in adapters:
        return adapted(base, adapters[A], adapters[B], name)
    within = (lambda k: f"{name}/{k}") if name else str
    if isinstance(base, dict):
        return {k: _over(v, adapters.get(k) if adapters else None, adapted, within(k)) for k, v in base.items()}
    if isinstance(base, list):
        return [
            _over(v, adapters[i] if adapters and i < len(adapters) else None, adapted, within(i))
            for i, v in enumerate(base)
        ]
    return jnp.asarray(base, jnp.float32)


@dataclass(frozen=True, eq=False)
class Lora:
    """A frozen base and the adapters over it: their init and the merged parameters. Compared by identity (the
    train step's cache is keyed by the loss that holds it)."""

    base: Params
    """The frozen θ (the model's pytree; float32 or bfloat16 leaves)."""
    rank: int
    alpha: float
    targets: tuple[str, ...]
    """The adapted leaves' names (`target_names`)."""
    dropout: float = 0.0
    """p, the probability that an entry of an adapter's input is dropped in training (`adapted` with a key)."""

    @classmethod
    def over(
        cls,
        base: Params,
        rank: int,
        alpha: float,
        targets: tuple[str, ...] = (),
        dtype: str = "float32",
        dropout: float = 0.0,
    ) -> Lora:
        """Adapters of rank `rank` on the `targets` matrices (`target_names`) of `base`, held in `dtype`, their input
        dropped at rate `dropout` in training."""
        shapes = {name: tuple(np.shape(leaf)) for name, leaf in flatten_named(base, to_numpy=False).items()}
        names = target_names(shapes, tuple(targets))
        held = jax.tree.map(lambda leaf: jnp.asarray(leaf, dtype), base)
        return cls(held, rank, alpha, names, dropout)

    @property
    def scale(self) -> float:
        """α / r."""
        return self.alpha / self.rank

    @functools.cached_property
    def digest(self) -> bytes:
        """The frozen base's digest (`pytrees.digest.tree_digest`), computed once: what every process of a run must
        hold the same (an island's Join carries it)."""
        return bytes.fromhex(tree_digest(self.base))

    def init(self, key: jax.Array) -> Params:
        """The adapters at step 0: A ~ N(0, 1/in) [in, r], B = 0 [r, out] for each target, A's key folded from
        `key` by the target's index."""
        shapes = {name: tuple(np.shape(leaf)) for name, leaf in flatten_named(self.base, to_numpy=False).items()}
        named: dict[str, jax.Array] = {}
        for i, name in enumerate(self.targets):
            d_in, d_out = shapes[name]
            named[f"{name}/{A}"] = normal_init(jax.random.fold_in(key, i), (d_in, self.rank), d_in**-0.5)
            named[f"{name}/{B}"] = jnp.zeros((self.rank, d_out), jnp.float32)
        return _nest(named)

    def merged(self, adapters: Params) -> Params:
        """The model's parameters, float32: the base with every adapted matrix W + (α / r)·A·B."""
        return _over(self.base, adapters, lambda w, a, b, _: w.astype(jnp.float32) + self.scale * (a @ b))

    def adapted(self, adapters: Params, key: jax.Array | None = None) -> Params:
        """The parameters a training step's loss reads: the base with every adapted matrix an `Adapted` (W in the
        base's dtype, A, B), applied unmerged; every other leaf float32 as in `merged`. `key`: a training pass's,
        which each matrix's dropout mask is drawn from with its index in `targets` folded in (None, or a rate of 0:
        nothing is dropped)."""
        if key is None or self.dropout == 0:
            return _over(self.base, adapters, lambda w, a, b, _: Adapted(w, a, b, self.scale))

        def dropping(w: Any, a: Any, b: Any, name: str) -> Adapted:
            return Adapted(w, a, b, self.scale, jax.random.fold_in(key, self.targets.index(name)), self.dropout)

        return _over(self.base, adapters, dropping)


@dataclass(frozen=True, eq=False)
class AdapterLoss:
    """A model's loss over the adapters: the loss of the base with the adapters applied unmerged (`Lora.adapted`)."""

    loss: Callable[..., tuple[jax.Array, Metrics]]
    lora: Lora
    key: jax.Array | None = None
    """A training pass's key (`keyed`), which the adapters' dropout draws from; None: nothing is dropped."""

    @property
    def draws(self) -> bool:
        """Whether a training step draws dropout masks (islands/inner.py `DrawingLoss`): workload.lora.dropout > 0."""
        return self.lora.dropout > 0

    def keyed(self, key: jax.Array) -> AdapterLoss:
        """This loss dropping the adapters' input with masks drawn from `key` (a traced key of the train step)."""
        return replace(self, key=key)

    @property
    def frozen(self) -> Params:
        """The base: a program runs this loss with it as an argument (islands/inner.py `FrozenLoss`)."""
        return self.lora.base

    def bind(self, frozen: Params) -> AdapterLoss:
        """This loss over the base `frozen` (a traced argument of the program that runs it)."""
        return replace(self, lora=replace(self.lora, base=frozen))

    def __call__(self, adapters: Params, batch: Any, totals: Any = None) -> tuple[jax.Array, Metrics]:
        params = self.lora.adapted(adapters, self.key)
        return self.loss(params, batch) if totals is None else self.loss(params, batch, totals)


@dataclass(frozen=True, eq=False)
class WholeBatchAdapterLoss(AdapterLoss):
    """An `AdapterLoss` over a loss that counts its whole batch (islands/inner.py `WholeBatchLoss`: post-training's)."""

    def totals(self, batch: Any) -> Any:
        return self.loss.totals(batch)  # type: ignore[attr-defined]


def adapt(model: Model, lora: Lora) -> Model:
    """`model` training the adapters of `lora` over its frozen base: init draws the adapters, the loss applies them."""
    whole = callable(getattr(model.loss, "totals", None))
    loss = (WholeBatchAdapterLoss if whole else AdapterLoss)(model.loss, lora)
    return Model(init=lora.init, loss=loss, axis_units=model.axis_units, step_figures=model.step_figures)
