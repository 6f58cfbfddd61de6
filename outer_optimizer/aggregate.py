"""Aggregation of pseudo-gradients (DiLoCo, arXiv 2311.08105, Algorithm 1, line 12), plain or Byzantine-robust.

A pseudo-gradient is Δ_i = θ_global - θ_i: global parameters minus the island's parameters after its H inner
steps. Its sign matches an ordinary gradient (it points uphill), so an outer optimizer can treat it as one.

`weighted_mean` is DiLoCo's rule: weighted by the tokens each island trained on, so a slow island that finished
fewer steps (or trained a smaller batch) counts for less. One island that authenticates but sends garbage owns it,
though: any single input moves a mean arbitrarily far (Blanchard et al., NeurIPS 2017), so a Δ scaled by 10^6
moves θ by thousands and float32-max values overflow the outer step. The robust rules bound what one island can do:

    norm_clip     scale each Δ_i down to at most norm_bound × the round's median island norm, then the token-weighted
                  mean (norm bounding, Sun et al. 2019, arXiv 1911.07963; the bound is relative to the round's
                  median so no absolute scale needs tuning, cf. centered clipping, arXiv 2012.10333). An attacker
                  keeps its direction but not its size; with no island clipped it is bit-identical to the mean.
    trimmed_mean  coordinate-wise: drop the t largest and t smallest of the n values, average the rest
    median        coordinate-wise median (both: Yin et al. 2018, arXiv 1803.01498): with at most t Byzantine islands
                  (median: fewer than half) every coordinate stays inside the honest islands' range, whatever they
                  send.

The order-statistic rules count every island once, ignoring tokens: a weighted median would let a self-reported
weight buy votes, and every island trains the same H steps of the same batch, so the weights are equal anyway.

Non-finite input never makes a non-finite aggregate under the robust rules: an island whose norm is not finite in
float32 is scaled to 0 by norm_clip (its token weight stays in the denominator: it moved nothing), and the
order-statistic rules read a NaN or ±inf coordinate as 0 (no move) before they rank.

Every rule is a pure function of (pseudo-gradients, weights) that returns an `Aggregated`: the Δ and, per island,
the share of its Δ that was used, for logging. The weights are host numbers (tokens), the island count is static,
so each rule traces under `jax.jit`. Islands are taken in the order given; callers pass them sorted by island name,
and ties between equal values are broken by that order, so every process computes bit-identical results.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from outer_optimizer.config import RULES, valid_norm_bound, valid_trim


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Aggregated:
    """What a rule made of one round's pseudo-gradients: the Δ, and a record of how much of each island it used."""

    delta: optax.Updates
    """The aggregate Δ (float32) the outer optimizer descends along."""
    scales: jax.Array | None = None
    """mean and norm_clip: float32 [n], the factor each Δ_i was multiplied by (1 = all of it)."""
    masks: tuple[tuple[jax.Array, ...], ...] | None = None
    """trimmed_mean and median: per leaf, per word of up to 32 islands, an unsigned integer array shaped like the
    leaf whose bit i says island 32·w + i's value was among those averaged there. Counting them is left to `kept`
    because on CPU XLA's integer sums over them cost more than the aggregate itself: a commit makes the masks on
    the islands' path, and the coordinator counts them after (its settle thread reads `kept`)."""
    islands: int = field(default=0, metadata={"static": True})
    """n, how many pseudo-gradients were aggregated (the masks' bit count)."""

    @property
    def kept(self) -> np.ndarray:
        """float32 [n], in the order given: how much of each island's Δ the rule used, 1 = all of it. norm_clip: the
        scale applied to Δ_i; trimmed_mean and median: the share of coordinates at which Δ_i's value was kept.
        Computed on the host when asked (outside any trace)."""
        if self.masks is None:
            return np.asarray(self.scales, np.float32)
        counts, size = np.zeros(self.islands, np.int64), 0
        for words in self.masks:
            size += int(np.size(words[0]))
            for w, word in enumerate(jax.device_get(words)):
                counts[32 * w : 32 * (w + 1)] += count_bits(word, min(32, self.islands - 32 * w))
        return (counts / max(size, 1)).astype(np.float32)


def count_bits(word: np.ndarray, bits: int) -> np.ndarray:
    """int64 [bits]: how many elements of ``word`` have bit i set, for i < bits."""
    flat = word.reshape(-1)
    if flat.dtype.itemsize <= 2:  # a histogram of the codes themselves: one pass, then a few thousand adds
        histogram = np.bincount(flat, minlength=1 << (8 * flat.dtype.itemsize))
        codes = np.arange(histogram.size)
        return np.array([histogram[(codes >> i) & 1 == 1].sum() for i in range(bits)], np.int64)
    return np.array([np.count_nonzero(flat & np.uint32(1 << i)) for i in range(bits)], np.int64)


Rule = Callable[[Sequence[optax.Updates], Sequence[float]], Aggregated]
"""A rule: (pseudo-gradients in island-name order, their token weights) -> Aggregated."""


def pseudo_gradient(global_params: optax.Params, local_params: optax.Params) -> optax.Updates:
    """Δ = global - local (the sign docs/architecture.md fixes, "The round": an outer *descent* step subtracts it)."""
    return jax.tree.map(lambda g, p: g - p, global_params, local_params)


def _check(rule: str, deltas: Sequence[optax.Updates], weights: Sequence[float]) -> None:
    """The inputs every rule requires; the message names the rule."""
    if len(deltas) == 0:
        raise ValueError(f"{rule} needs at least one pseudo-gradient")
    if len(deltas) != len(weights):
        raise ValueError(f"{rule} got {len(deltas)} pseudo-gradients but {len(weights)} weights")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{rule} weights must be >= 0 with a positive sum (got {list(weights)})")


def weighted_mean(deltas: Sequence[optax.Updates], weights: Sequence[float]) -> optax.Updates:
    """Σ w_i Δ_i / Σ w_i, summed left to right in the order given (deterministic float sums)."""
    _check("weighted_mean", deltas, weights)
    total = float(sum(weights))
    scales = [float(w) / total for w in weights]
    acc = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) * scales[0], deltas[0])
    for delta, scale in zip(deltas[1:], scales[1:], strict=True):
        acc = jax.tree.map(lambda a, x, s=scale: a + jnp.asarray(x, jnp.float32) * s, acc, delta)
    return acc


def mean(deltas: Sequence[optax.Updates], weights: Sequence[float]) -> Aggregated:
    """Rule "mean": `weighted_mean` itself (bit-identical to DiLoCo's aggregation); every island fully kept."""
    return Aggregated(weighted_mean(deltas, weights), scales=jnp.ones(len(deltas), jnp.float32))


# -- norm_clip ----------------------------------------------------------------------------------------------------


def _global_norm(delta: optax.Updates) -> jax.Array:
    """‖Δ‖₂ in float32 as d · sqrt(Σ (x/d)²) with d ≈ max |x|, so that squares neither overflow (values above
    ~1e19) nor underflow (below ~1e-19); +inf where the norm itself exceeds float32.

    d is max |x| / 8 (or · 8 below 1), a power-of-two scaling: XLA on CPU divides through a reciprocal and flushes
    subnormals to zero, so dividing by max |x| itself near float32 max would make every x/d zero.
    """
    leaves = [jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(delta)]
    m = jnp.max(jnp.stack([jnp.max(jnp.abs(x), initial=0.0) for x in leaves]))
    d = jnp.where((m > 0) & jnp.isfinite(m), jnp.where(m > 1, m * 0.125, m * 8.0), 1.0)
    norm = d * jnp.sqrt(sum(jnp.sum(jnp.square(x / d)) for x in leaves))
    return jnp.where(jnp.isfinite(norm), norm, jnp.inf)


def global_norms(deltas: Sequence[optax.Updates]) -> jax.Array:
    """float32 [n]: each island's global L2 norm; +inf where it exceeds float32 or Δ holds NaN/inf."""
    return jnp.stack([_global_norm(d) for d in deltas])


def lower_median(values: jax.Array) -> jax.Array:
    """The ((n-1)//2)-th smallest value: the median for odd n, the lower middle one for even n.

    The lower one, so that with two islands an inflated Δ is clipped against the other island's norm rather than
    against their average (which it would dominate), and with 4 islands one large attacker cannot raise it.
    """
    return jnp.sort(values)[(values.shape[0] - 1) // 2]


def clip_scales(norms: jax.Array, bound: float) -> jax.Array:
    """float32 [n] in [0, 1]: min(1, bound · lower_median(norms) / norm_i), and 0 for a non-finite norm.

    Exactly 1.0 for an island within the bound, so that its Δ is multiplied by 1 (bit-exact). A median of 0 (half
    the islands sent zeros) scales every non-zero Δ to 0: the round moves nothing rather than trusting a minority.
    """
    limit = bound * lower_median(norms)
    scaled = jnp.where(norms <= limit, 1.0, limit / norms)
    return jnp.where(jnp.isfinite(norms), scaled, 0.0).astype(jnp.float32)


def _scaled(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x · scale, and exactly 0 where scale is 0 (so inf · 0 never makes a NaN)."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.where(scale > 0, x * scale, 0.0)


def norm_clip(deltas: Sequence[optax.Updates], weights: Sequence[float], bound: float) -> Aggregated:
    """Rule "norm_clip": each Δ_i scaled to norm <= bound × lower_median(norms), then `weighted_mean`.

    ‖aggregate‖ <= bound × median norm whatever one island sends; when no island is clipped every scale is 1.0
    and the result is bit-identical to `weighted_mean` (so honest runs keep their digests).
    """
    _check("norm_clip", deltas, weights)
    if not valid_norm_bound(bound):
        raise ValueError(f"norm_clip bound must be a finite number >= 1 (got {bound})")
    scales = clip_scales(global_norms(deltas), bound)
    clipped = [jax.tree.map(lambda x, i=i: _scaled(x, scales[i]), d) for i, d in enumerate(deltas)]
    return Aggregated(weighted_mean(clipped, weights), scales=scales)


# -- trimmed_mean and median --------------------------------------------------------------------------------------


def trim_count(trim: float, n: int) -> int:
    """Values dropped at each end of every coordinate for n islands: `trim` itself when >= 1 (a count), else
    ceil(trim · n) (a fraction: the Byzantine share to tolerate, rounded up so that 0.25 drops one of 3 or 4).

    Never more than (n-1)//2, so one value (odd n) or two (even n) remain: with too few islands for the asked trim
    the rule becomes the coordinate-wise median, and with 2 islands (or 1) it is their plain mean.
    """
    wanted = int(trim) if trim >= 1 else math.ceil(round(trim * n, 9))  # round: 0.3 · 10 is 3.0000000000000004
    return min(wanted, (n - 1) // 2)


def _mask_dtype(n: int) -> jnp.dtype:
    """The narrowest unsigned integer holding one bit per island, up to a 32-island word."""
    return jnp.uint8 if n <= 8 else jnp.uint16 if n <= 16 else jnp.uint32


PAIRWISE_MAX = 16
"""Up to this many islands `_middle_mean` ranks by pairwise compares; above it, by a sort (`_middle_mean_sorted`)."""


def _middle_mean(values: tuple[jax.Array, ...], t: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Per coordinate of n same-shaped arrays: the mean of the values ranked t .. n-t-1, and the masks of which
    islands' values those were (`Aggregated.masks`). Non-finite values count as 0; ties rank in the given (island)
    order. Both ways of ranking give bit-identical results."""
    return (_middle_mean_pairwise if len(values) <= PAIRWISE_MAX else _middle_mean_sorted)(values, t)


def _middle_mean_pairwise(values: tuple[jax.Array, ...], t: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`_middle_mean` by pairwise compares.

    Ranks by comparing every pair once (n(n-1)/2 elementwise compares, fused by jit) rather than sorting: with a
    handful of islands that is one pass over memory, where XLA's CPU sort along the island axis is far slower.
    Island i ranks above island j < i where x_j <= x_i, and above j > i where x_j < x_i, i.e. where not x_i <= x_j:
    one compare serves both.
    """
    n = len(values)
    share = 1.0 / (n - 2 * t)
    clean = [jnp.where(jnp.isfinite(x), x, 0.0) for x in values]
    at_most = {(i, j): clean[i] <= clean[j] for i in range(n) for j in range(i + 1, n)}
    acc, words = None, []
    for i, x in enumerate(clean):
        above = [at_most[j, i] for j in range(i)] + [~at_most[i, j] for j in range(i + 1, n)]
        rank = sum((b.astype(jnp.int32) for b in above), jnp.zeros(x.shape, jnp.int32))
        kept = (rank >= t) & (rank < n - t)
        term = jnp.where(kept, x * share, 0.0)  # scaled before the sum: float32-max values cannot overflow it
        acc = term if acc is None else acc + term
        w = i // 32
        dtype = _mask_dtype(min(32, n - 32 * w))
        bit = kept.astype(dtype) << dtype(i - 32 * w)
        if w == len(words):
            words.append(bit)
        else:
            words[w] = words[w] | bit
    return acc, tuple(words)


def _middle_mean_sorted(values: tuple[jax.Array, ...], t: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`_middle_mean` by a stable sort along the island axis: the same ranks (ties in island order), its program's
    size independent of n. The pairwise compares are n(n-1)/2 operations to compile, and a roster that grows while
    the run goes on compiles anew at every new island count: with tens of islands that compile stalls the round
    (BENCHMARKS.md, "Elastic federation"), where a sort's compile does not grow with n."""
    n = len(values)
    share = 1.0 / (n - 2 * t)
    stack = jnp.stack([jnp.where(jnp.isfinite(x), x, 0.0) for x in values])
    order = jnp.argsort(stack, axis=0, stable=True)
    places = jnp.broadcast_to(
        jnp.arange(n, dtype=order.dtype).reshape(order.shape[:1] + (1,) * (stack.ndim - 1)), order.shape
    )
    rank = jnp.put_along_axis(jnp.zeros_like(order), order, places, axis=0, inplace=False)  # each value's rank
    kept = (rank >= t) & (rank < n - t)
    terms = jnp.where(kept, stack * share, 0.0)  # scaled before the sum: float32-max values cannot overflow it
    acc = terms[0]
    for i in range(1, n):  # in island order, as the pairwise path adds
        acc = acc + terms[i]
    words = []
    for w in range(0, n, 32):
        dtype = _mask_dtype(min(32, n - w))
        shifts = jnp.arange(min(32, n - w), dtype=dtype).reshape((-1,) + (1,) * (stack.ndim - 1))
        words.append(jnp.sum(kept[w : w + 32].astype(dtype) << shifts, axis=0, dtype=dtype))  # distinct bits: OR
    return acc, tuple(words)


def _order_statistic(rule: str, deltas: Sequence[optax.Updates], t: int) -> Aggregated:
    """`_middle_mean` over every leaf of the islands' pytrees, as one program."""
    leaves = [jax.tree.flatten(d) for d in deltas]
    treedef = leaves[0][1]
    if any(td != treedef for _, td in leaves):
        raise ValueError(f"{rule} got pseudo-gradients of different structures")
    by_leaf = tuple(tuple(flat[j] for flat, _ in leaves) for j in range(treedef.num_leaves))
    _make_room((len(deltas), t, tuple(np.shape(values[0]) for values in by_leaf)))
    out, masks = _middle_means(by_leaf, t)
    return Aggregated(jax.tree.unflatten(treedef, out), masks=tuple(masks), islands=len(deltas))


COMPILED_KEPT = 16
"""Compiled `_middle_means` programs held at once: one per island count, trim count and leaf shapes (a streaming
fragment has its own). A roster whose size keeps changing compiles one per size it reaches; past this many the
cache starts over, so the coordinator's memory is bounded by it, not by every island count the run has seen."""
_held: OrderedDict[Hashable, None] = OrderedDict()
_held_lock = threading.Lock()


def _make_room(key: Hashable) -> None:
    """Before `_middle_means` runs for `key`: when it is a program not compiled yet and `COMPILED_KEPT` are held,
    forget them all (recompiled when next needed, bit-identical) and hand the memory back to the system."""
    with _held_lock:
        if key in _held:
            return
        if len(_held) >= COMPILED_KEPT:
            _middle_means.clear_cache()
            _held.clear()
            _trim_heap()
        _held[key] = None


def _trim_heap() -> None:
    """glibc keeps freed memory in its arenas: give it back (a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@partial(jax.jit, static_argnums=1)
def _middle_means(
    by_leaf: tuple[tuple[jax.Array, ...], ...], t: int
) -> tuple[list[jax.Array], list[tuple[jax.Array, ...]]]:
    """`_middle_mean` of every leaf (by_leaf[j]: the islands' values of leaf j) as one program: one dispatch per
    commit instead of one per leaf (a model has ~100 leaves, and a dispatch and host-to-device copy for each would
    be a large share of the coordinator's commit)."""
    pairs = [_middle_mean(tuple(jnp.asarray(x, jnp.float32) for x in values), t) for values in by_leaf]
    return [value for value, _ in pairs], [words for _, words in pairs]


def trimmed_mean(deltas: Sequence[optax.Updates], weights: Sequence[float], trim: float) -> Aggregated:
    """Rule "trimmed_mean": coordinate-wise mean after dropping trim_count(trim, n) values at each end.

    With at most trim_count Byzantine islands every coordinate lies within the honest islands' values (Yin et al.
    2018). Weights are validated but unused (every island counts once; see the module docstring).
    """
    _check("trimmed_mean", deltas, weights)
    if not valid_trim(trim):
        raise ValueError(f"trimmed_mean trim must be a fraction in [0, 0.5) or a whole count >= 1 (got {trim})")
    return _order_statistic("trimmed_mean", deltas, trim_count(trim, len(deltas)))


def median(deltas: Sequence[optax.Updates], weights: Sequence[float]) -> Aggregated:
    """Rule "median": coordinate-wise median (the mean of the two middle values for even n); the trimmed mean with
    the most trimming, so it holds while fewer than half the islands are Byzantine (Yin et al. 2018)."""
    _check("median", deltas, weights)
    return _order_statistic("median", deltas, (len(deltas) - 1) // 2)


def make_rule(kind: str, norm_bound: float, trim: float) -> Rule:
    """The rule `kind` names, with its parameter bound in (norm_bound for norm_clip, trim for trimmed_mean)."""
    rules: dict[str, Rule] = {
        "mean": mean,
        "norm_clip": lambda deltas, weights: norm_clip(deltas, weights, norm_bound),
        "trimmed_mean": lambda deltas, weights: trimmed_mean(deltas, weights, trim),
        "median": median,
    }
    if kind not in rules:
        raise ValueError(f"aggregation rule must be one of {', '.join(RULES)} (got {kind!r})")
    return rules[kind]
