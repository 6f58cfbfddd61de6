"""Robust aggregation rules (outer_optimizer/aggregate.py): hand-computed tables, the one-island invariant, and
properties against one Byzantine island among 4 (Yin et al. 2018, arXiv 1803.01498; norm bounding, arXiv 1911.07963).
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from diloco.run.rounds import OuterLoop
from floor.codec import CodecSpec
from outer_optimizer import aggregate
from outer_optimizer.aggregate import (
    global_norms,
    lower_median,
    make_rule,
    median,
    norm_clip,
    trim_count,
    trimmed_mean,
    weighted_mean,
)
from outer_optimizer.config import RULES, OuterConfig
from outer_optimizer.optimizers import aggregator, build_optimizer
from pytrees.digest import tree_digest
from tests.conftest import child_env

pytestmark = pytest.mark.timeout(120)

F32_MAX = float(np.finfo(np.float32).max)
NAN, INF = float("nan"), float("inf")


def _trees(*rows: list[float]) -> list[dict[str, np.ndarray]]:
    return [{"w": np.array(row, np.float32)} for row in rows]


# -- hand-computed tables --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "weights", "expected", "kept"),
    [
        # norms 5, 1: lower median 1, limit 2, so a is scaled by 2/5 to [1.2, 1.6]; mean with [0, 1].
        ([[3, 4], [0, 1]], [1, 1], [0.6, 1.3], [0.4, 1.0]),
        # norms 1, 2, 50: median 2, limit 4, c scaled by 0.08 to [2.4, 3.2]; weights 1, 1, 2 (sum 4).
        ([[1, 0], [0, 2], [30, 40]], [1, 1, 2], [5.8 / 4, 8.4 / 4], [1.0, 1.0, 0.08]),
        # norms 1, 2, 3, inf (NaN): median 2, limit 4; the NaN island scales to 0 and keeps its weight.
        ([[1, 0], [0, 2], [3, 0], [NAN, 1]], [1, 1, 1, 1], [1.0, 0.5], [1.0, 1.0, 1.0, 0.0]),
        # all within 2x of the median: nothing clipped, the weighted mean.
        ([[1, 1], [1.5, 0], [0, -1.2]], [1, 2, 1], [(1 + 3) / 4, (1 - 1.2) / 4], [1.0, 1.0, 1.0]),
    ],
)
@pytest.mark.slow
def test_norm_clip_table(rows: list, weights: list[int], expected: list[float], kept: list[float]) -> None:
    got = norm_clip(_trees(*rows), weights, bound=2.0)
    np.testing.assert_allclose(got.delta["w"], expected, rtol=1e-6)
    np.testing.assert_allclose(got.kept, kept, rtol=1e-6)


@pytest.mark.parametrize(
    ("rows", "trim", "expected", "kept"),
    [
        # 4 islands, drop 1 each end: [1, 2, 3, 100] -> 2.5; [10, -1, 0, 5] -> mean(0, 5) = 2.5.
        ([[1, 10], [2, -1], [3, 0], [100, 5]], 1, [2.5, 2.5], [0.0, 0.5, 1.0, 0.5]),
        ([[1, 10], [2, -1], [3, 0], [100, 5]], 0.25, [2.5, 2.5], [0.0, 0.5, 1.0, 0.5]),
        # 3 islands, 0.25 -> ceil(0.75) = 1: the median, [1, 4, -7] -> 1 and [5, 2, 3] -> 3.
        ([[1, 5], [4, 2], [-7, 3]], 0.25, [1.0, 3.0], [0.5, 0.0, 0.5]),
        # 5 islands, drop 1 each end: [5, 1, 4, 2, 3] -> mean(2, 3, 4).
        ([[5], [1], [4], [2], [3]], 1, [3.0], [0.0, 0.0, 1.0, 1.0, 1.0]),
        # 2 islands: nothing can be trimmed (at most (n-1)//2 = 0), the plain mean.
        ([[1], [3]], 0.25, [2.0], [1.0, 1.0]),
        # trim 0: the unweighted mean.
        ([[1], [2], [6]], 0, [3.0], [1.0, 1.0, 1.0]),
        # NaN and inf read as 0 before sorting, ties in island order: [0a, 1b, 2c, 0d] keeps d, b -> 0.5;
        # [3a, 0b, 1c, 2d] keeps c, d -> 1.5.
        ([[NAN, 3], [1, INF], [2, 1], [0, 2]], 1, [0.5, 1.5], [0.0, 0.5, 0.5, 1.0]),
    ],
)
@pytest.mark.slow
def test_trimmed_mean_table(rows: list, trim: float, expected: list[float], kept: list[float]) -> None:
    got = trimmed_mean(_trees(*rows), [1] * len(rows), trim)
    np.testing.assert_allclose(got.delta["w"], expected, rtol=1e-6)
    np.testing.assert_allclose(got.kept, kept, rtol=1e-6)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([[1], [2], [3], [100]], [2.5]),
        ([[1, 5], [4, 2], [-7, 3]], [1.0, 3.0]),
        ([[1], [3]], [2.0]),
        ([[-F32_MAX], [F32_MAX], [F32_MAX]], [F32_MAX]),
    ],
)
def test_median_table(rows: list, expected: list[float]) -> None:
    np.testing.assert_allclose(median(_trees(*rows), [1] * len(rows)).delta["w"], expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("trim", "n", "count"),
    [
        (0.25, 1, 0),
        (0.25, 2, 0),
        (0.25, 3, 1),
        (0.25, 4, 1),
        (0.25, 5, 2),
        (0.25, 8, 2),
        (0.25, 9, 3),
        (0.3, 10, 3),
        (0.1, 4, 1),
        (0, 4, 0),
        (1, 4, 1),
        (2, 4, 1),
        (2, 5, 2),
        (3, 100, 3),
    ],
)
def test_trim_count(trim: float, n: int, count: int) -> None:
    assert trim_count(trim, n) == count


def _stable_kept(rows: np.ndarray, t: int) -> np.ndarray:
    """The shares `kept` must report, counted the slow way: rank every column with ties in island order."""
    n, size = rows.shape
    counts = np.zeros(n)
    for column in rows.T:
        ranks = np.empty(n, int)
        ranks[np.argsort(column, kind="stable")] = np.arange(n)
        counts += (ranks >= t) & (ranks < n - t)
    return counts / size


@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 4, 9, 17, 33, 40])  # one word of uint8, uint16, uint32; two words
def test_trimmed_mean_kept_counts_the_masks(n: int) -> None:
    rng = np.random.default_rng(n)
    rows = rng.integers(-3, 4, size=(n, 257)).astype(np.float32)  # small integers: many ties
    trees = [{"a": row[:200].reshape(20, 10), "b": row[200:]} for row in rows]
    t = trim_count(0.25, n)
    got = trimmed_mean(trees, [1] * n, 0.25)
    np.testing.assert_allclose(got.kept, _stable_kept(rows, t), rtol=1e-6)
    assert got.kept.dtype == np.float32 and got.kept.shape == (n,)


def test_lower_median_is_an_element() -> None:
    assert float(lower_median(jnp.array([5.0, 1.0, 9.0, 2.0]))) == 2.0
    assert float(lower_median(jnp.array([3.0, 1.0]))) == 1.0


def test_weights_do_not_change_the_order_statistics() -> None:
    rows = _trees([1, 10], [2, -1], [3, 0], [100, 5])
    for rule in (median, lambda d, w: trimmed_mean(d, w, 1)):
        a, b = rule(rows, [1, 1, 1, 1]), rule(rows, [1, 50, 2, 7])
        np.testing.assert_array_equal(a.delta["w"], b.delta["w"])


# -- invariants ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.slow
def test_one_island_is_its_own_aggregate(rule: str) -> None:
    delta = {"a": np.array([[1.5, -2.0], [0.0, 3e-7]], np.float32), "b": np.array([7.0], np.float32)}
    got = make_rule(rule, 2.0, 0.25)([delta], [123])
    for key in delta:
        np.testing.assert_array_equal(got.delta[key], delta[key])
    np.testing.assert_array_equal(got.kept, [1.0])


def _honest_round(seed: int = 0, n: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"a": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)} for _ in range(n)
    ]


@pytest.mark.slow
def test_norm_clip_without_clipping_is_bit_identical_to_mean() -> None:
    deltas = _honest_round()
    assert float(global_norms(deltas).max()) < 2 * float(lower_median(global_norms(deltas)))
    got, want = norm_clip(deltas, [3, 1, 2, 5], 2.0), weighted_mean(deltas, [3, 1, 2, 5])
    for key in want:
        np.testing.assert_array_equal(np.asarray(got.delta[key]), np.asarray(want[key]))


@pytest.mark.parametrize("rule", ["trimmed_mean", "median"])
def test_two_equal_islands_are_bit_identical_to_mean(rule: str) -> None:
    """Nothing can be trimmed from 2 islands: configs with 2 (configs/tiny.toml) keep their digests."""
    deltas = _honest_round(3, 2)
    got, want = make_rule(rule, 2.0, 0.25)(deltas, [640, 640]), weighted_mean(deltas, [640, 640])
    for key in want:
        np.testing.assert_array_equal(np.asarray(got.delta[key]), np.asarray(want[key]))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.slow
def test_rules_trace_under_jit(rule: str) -> None:
    deltas, weights = _honest_round(1), [1, 2, 3, 4]
    fn = make_rule(rule, 2.0, 0.25)
    eager, jitted = fn(deltas, weights), jax.jit(lambda d: fn(d, weights))(deltas)
    for key in deltas[0]:
        np.testing.assert_allclose(jitted.delta[key], eager.delta[key], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jitted.kept, eager.kept)


@pytest.mark.parametrize("rule", RULES)
def test_rules_validate_their_inputs(rule: str) -> None:
    fn = make_rule(rule, 2.0, 0.25)
    with pytest.raises(ValueError, match="at least one"):
        fn([], [])
    with pytest.raises(ValueError, match="2 pseudo-gradients but 1 weights"):
        fn(_trees([1], [2]), [1])
    with pytest.raises(ValueError, match="positive sum"):
        fn(_trees([1]), [0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aggregate": "krum"}, "outer.aggregate must be one of mean, norm_clip, trimmed_mean, median (got 'krum')"),
        ({"norm_bound": 0.5}, "outer.norm_bound must be a finite number >= 1 (got 0.5)"),
        ({"norm_bound": INF}, "outer.norm_bound must be a finite number >= 1"),
        ({"trim": 0.5}, "outer.trim must be a fraction in [0, 0.5) or a whole count >= 1 (got 0.5)"),
        ({"trim": 1.5}, "outer.trim must be a fraction"),
        ({"trim": -1.0}, "outer.trim must be a fraction"),
        ({"trim": INF}, "outer.trim must be a fraction"),
    ],
)
def test_outer_config_validates_aggregation_keys(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        OuterConfig(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


# -- one Byzantine island among 4 ------------------------------------------------------------------------------

# XLA on CPU flushes subnormals to zero, which float64 reference norms would not: honest values are normal or 0.
HONEST = hnp.arrays(np.float32, 6, elements=st.floats(-10, 10, width=32, allow_subnormal=False))
BYZANTINE = hnp.arrays(
    np.float32,
    6,
    elements=st.one_of(st.floats(width=32), st.sampled_from([F32_MAX, -F32_MAX, INF, -INF, NAN, 1e30, -1e30, 0.0])),
)


def _round_with(honest: list[np.ndarray], byzantine: np.ndarray, at: int) -> list[dict[str, np.ndarray]]:
    rows = [*honest[:at], byzantine, *honest[at:]]
    return [{"w": r} for r in rows]


@settings(max_examples=150, deadline=None)
@given(st.lists(HONEST, min_size=3, max_size=3), BYZANTINE, st.integers(0, 3), st.sampled_from(["median", 1, 0.25]))
@example(
    [np.ones(6, np.float32), np.full(6, 2.2165857e-38, np.float32), np.full(6, 2.2165857e-38, np.float32)],
    np.zeros(6, np.float32),
    0,
    "median",
)
@pytest.mark.slow
def test_order_statistics_stay_in_the_honest_range(
    honest: list[np.ndarray], byzantine: np.ndarray, at: int, trim: str | float
) -> None:
    deltas = _round_with(honest, byzantine, at)
    got = median(deltas, [1] * 4) if trim == "median" else trimmed_mean(deltas, [1] * 4, float(trim))
    value = np.asarray(got.delta["w"])
    assert np.all(np.isfinite(value))
    stack = np.stack(honest)
    # XLA on CPU flushes subnormal results to zero, intermediate ones too: a median of two values near the smallest
    # normal, a·0.5 + b·0.5, loses both halves (found: 0 for two honest 2.2e-38), so the bound is two of them.
    tiny = 2 * np.finfo(np.float32).tiny
    assert np.all(value >= stack.min(axis=0) - tiny) and np.all(value <= stack.max(axis=0) + tiny)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    st.lists(HONEST, min_size=3, max_size=3),
    BYZANTINE,
    st.integers(0, 3),
    st.lists(st.integers(1, 1000), min_size=4, max_size=4),
    st.sampled_from([1.0, 2.0, 5.0]),
)
def test_norm_clip_bounds_the_byzantine_island(
    honest: list[np.ndarray], byzantine: np.ndarray, at: int, weights: list[int], bound: float
) -> None:
    deltas = _round_with(honest, byzantine, at)
    got = norm_clip(deltas, weights, bound)
    value = np.asarray(got.delta["w"], np.float64)
    assert np.all(np.isfinite(value))
    honest_norms = [float(np.linalg.norm(h.astype(np.float64))) for h in honest]
    med = float(lower_median(global_norms(deltas)))
    assert min(honest_norms) * (1 - 1e-6) <= med <= max(honest_norms) * (1 + 1e-6)  # one island cannot move it
    byz_norm = float(np.linalg.norm(np.nan_to_num(byzantine.astype(np.float64), posinf=0, neginf=0)))
    kept = float(got.kept[at])
    assert kept * byz_norm <= bound * med * (1 + 1e-5) + 1e-30 or kept == 0.0
    assert np.linalg.norm(value) <= bound * med * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("rule", ["norm_clip", "trimmed_mean", "median"])
@pytest.mark.parametrize("poison", [F32_MAX, -F32_MAX, INF, NAN])
@pytest.mark.slow
def test_a_robust_commit_stays_finite_when_one_island_sends_float32_max(rule: str, poison: float) -> None:
    cfg = OuterConfig(aggregate=rule)  # nesterov, lr 0.7, momentum 0.9: the outer step that overflowed
    params = {"w": jnp.zeros(6, jnp.float32)}
    loop = OuterLoop.fresh(params, build_optimizer(cfg), CodecSpec(kind="fp32"), aggregator(cfg))
    honest = _honest_round(2, 3)
    for name, delta in zip(["a", "b", "c"], honest, strict=True):
        loop.submit(name, 0, {"w": delta["b"][:6]}, tokens=10)
    loop.submit("z", 0, {"w": np.full(6, poison, np.float32)}, tokens=10)
    commit = loop.commit()
    theta = np.asarray(loop.params["w"])
    assert np.all(np.isfinite(theta)) and np.abs(theta).max() < 100
    assert "z" in commit.reduced and commit.kept[-1] < 1.0


def test_mean_commit_records_every_island_kept() -> None:
    params = {"w": jnp.zeros(2, jnp.float32)}
    loop = OuterLoop.fresh(params, build_optimizer(OuterConfig()), CodecSpec(kind="fp32"))
    loop.submit("b", 0, {"w": np.ones(2, np.float32)}, tokens=1)
    loop.submit("a", 0, {"w": np.ones(2, np.float32)}, tokens=1)
    commit = loop.commit()
    assert commit.kept == (1.0, 1.0) and commit.reduced == {}


def rule_digests() -> dict[str, str]:
    """Each rule's aggregate of one fixed round (one island inflated), as parameter digests."""
    rng = np.random.default_rng(7)
    deltas = [
        {"a": rng.normal(size=(64, 33)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
        for _ in range(4)
    ]
    deltas[2] = {k: v * 1000 for k, v in deltas[2].items()}
    return {rule: tree_digest(make_rule(rule, 2.0, 0.25)(deltas, [3, 1, 2, 5]).delta) for rule in RULES}


@pytest.mark.slow
def test_rules_are_bit_identical_across_processes() -> None:
    """The coordinator and `simulate` are different processes: the same Δs must give the same bits in both."""
    code = "import json; from tests.test_robust_aggregation import rule_digests; print(json.dumps(rule_digests()))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=child_env())
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == rule_digests()


@pytest.mark.parametrize("n", [17, 33])
@pytest.mark.slow
def test_ranking_by_sort_is_bit_identical_to_pairwise(n: int) -> None:
    """Above PAIRWISE_MAX islands the order statistics rank by a sort (its compile does not grow with n): the same
    aggregate, bit for bit, and the same masks, with ties (broken in island order), NaN, ±inf and -0.0."""
    from outer_optimizer.aggregate import _middle_mean_pairwise, _middle_mean_sorted, trim_count

    rng = np.random.default_rng(n)
    values = []
    for i in range(n):
        x = rng.normal(size=(7, 5)).astype(np.float32)
        x[0, :] = np.float32(i % 3)  # ties across islands
        x[1, i % 5] = [np.nan, np.inf, -np.inf, -0.0, 0.0][i % 5]
        values.append(jnp.asarray(x))
    for t in (0, trim_count(0.25, n), (n - 1) // 2):
        fast, fast_words = jax.jit(_middle_mean_sorted, static_argnums=1)(tuple(values), t)
        slow, slow_words = jax.jit(_middle_mean_pairwise, static_argnums=1)(tuple(values), t)
        assert np.array_equal(np.asarray(fast), np.asarray(slow)), t
        assert len(fast_words) == len(slow_words)
        for a, b in zip(fast_words, slow_words, strict=True):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), t


@pytest.mark.slow
def test_compiled_programs_are_bounded_and_a_recompile_is_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """A roster whose size keeps changing compiles an order-statistic program per island count: at most
    `COMPILED_KEPT` are held at once (the coordinator's memory is bounded by it, not by the counts it has seen), and
    a program compiled again after the cache started over gives the same bits."""
    monkeypatch.setattr(aggregate, "COMPILED_KEPT", 3)
    rng = np.random.default_rng(0)
    deltas = [{"w": jnp.asarray(rng.normal(size=(5,)), jnp.float32)} for _ in range(8)]
    first = np.asarray(trimmed_mean(deltas[:2], [1, 1], 0.25).delta["w"])
    for n in range(3, 9):
        trimmed_mean(deltas[:n], [1] * n, 0.25)
        assert aggregate._middle_means._cache_size() <= 3, n
    assert np.array_equal(np.asarray(trimmed_mean(deltas[:2], [1, 1], 0.25).delta["w"]), first)
