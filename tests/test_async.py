"""Asynchronous DiLoCo (`train.mode = "async"`, diloco/simulator/async_sim.py; outer_optimizer/asynchronous.py), checked by hand.

The pure parts on numbers worked out in the comments: the staleness weight w(τ) = (1 + τ)^(-a), Delayed Nesterov on
one weight (every value a short binary fraction, so float32 holds it exactly and the test compares with ==), and
the push order of the virtual clock with one island 2x slower. Then `simulate` itself follows that order, its first
update is a plain DiLoCo outer step, and a resumed run ends where an uninterrupted one does.
"""

from __future__ import annotations

import shutil
from fractions import Fraction
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco.config import ConfigError, load_config
from diloco.run.rundir import read_events
from diloco.run.summary import SUMMARY_KEYS
from diloco.simulator.async_sim import Push, push_order, staleness
from diloco.simulator.simulate import run_simulation
from outer_optimizer.asynchronous import delayed_nesterov, discount, staleness_weight
from outer_optimizer.optimizers import apply_update, make_outer_step
from tests.conftest import write_corpus

# -- the staleness weight ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tau", "a", "w"),
    [
        (0, 0.5, 1.0),  # nothing happened since the pull: the Δ goes in as it is
        (3, 0.5, 0.5),  # 4^-½
        (8, 0.5, 1 / 3),  # 9^-½
        (3, 1.0, 0.25),  # 4^-1
        (1, 2.0, 0.25),  # 2^-2
        (7, 0.0, 1.0),  # a = 0: no discount whatever the staleness
    ],
)
def test_staleness_weight_is_one_over_a_power_of_one_plus_tau(tau: int, a: float, w: float) -> None:
    assert staleness_weight(tau, a) == pytest.approx(w, rel=1e-12)


def test_staleness_weight_refuses_what_has_no_meaning() -> None:
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1, 0.5)
    with pytest.raises(ValueError, match="exponent must be a finite number >= 0"):
        staleness_weight(1, -0.5)


def test_discount_scales_every_leaf_and_weight_one_changes_no_bit() -> None:
    delta = {"a": np.array([0.1, -3.0], np.float32), "b": np.array([7.0], np.float32)}
    assert np.array_equal(np.asarray(discount(delta, 0.5)["a"]), np.array([0.05, -1.5], np.float32))
    same = discount(delta, 1.0)
    assert all(np.array_equal(np.asarray(same[k]), delta[k]) for k in delta)


# -- Delayed Nesterov -----------------------------------------------------------------------------------------------


def _apply(tx: optax.GradientTransformation, theta: float, grads: list[float]) -> list[float]:
    """θ after each pseudo-gradient, one weight, through the jitted step the coordinator runs (OuterLoop)."""
    step = make_outer_step(tx)
    params = {"w": jnp.array([theta], jnp.float32)}
    state = tx.init(params)
    out = []
    for g in grads:
        update, state = step(params, state, {"w": jnp.array([g], jnp.float32)})
        params = apply_update(params, update)
        out.append(float(params["w"][0]))
    return out


def test_delayed_nesterov_matches_the_values_worked_out_by_hand() -> None:
    # ε = ½, β = ½, N = 2, θ = 8, pseudo-gradients 2, 4, 2, 0.
    # t=1: b = 2; not due:            θ = 8 - ½·(2/2)                       = 7.5    (m stays 0)
    # t=2: b = 6; due: m = 6/2 + ½·0 = 3;  θ = 7.5 - ½·(4/2 + ½·3) = 7.5 - 1.75 = 5.75, b = 0
    #      (over the two: 8 - ½·(mean 3 + ½·3) = 5.75: one Nesterov step on their mean)
    # t=3: b = 2; not due:            θ = 5.75 - ½·(2/2)                    = 5.25   (m stays 3)
    # t=4: b = 2; due: m = 2/2 + ½·3 = 2.5; θ = 5.25 - ½·(0/2 + ½·2.5) = 5.25 - 0.625 = 4.625
    assert _apply(delayed_nesterov(0.5, 0.5, every=2), 8.0, [2.0, 4.0, 2.0, 0.0]) == [7.5, 5.75, 5.25, 4.625]


def test_delayed_nesterov_every_update_is_optax_nesterov_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    grads = [float(x) for x in rng.normal(size=6).astype(np.float32)]
    dn = _apply(delayed_nesterov(0.7, 0.9, every=1), 1.25, grads)
    assert dn == _apply(optax.sgd(0.7, momentum=0.9, nesterov=True), 1.25, grads)


def test_delayed_nesterov_refuses_every_below_one() -> None:
    with pytest.raises(ValueError, match="every >= 1"):
        delayed_nesterov(0.7, 0.9, every=0)


# -- the virtual clock ----------------------------------------------------------------------------------------------

SLOW = {"island-0": 1.0, "island-1": 1.0, "island-2": 2.0}
"""island-2 takes 2 time units per inner step, the others 1."""


def test_an_island_twice_as_slow_pushes_half_as_often() -> None:
    # H = 4: island-0 and island-1 push at 4, 8, 12, 16, ...; island-2 at 8, 16, ... Ties go in name order.
    order = push_order(SLOW, inner_steps=4, updates=10)
    assert [(int(p.time), p.island[-1]) for p in order] == [
        (4, "0"),
        (4, "1"),
        (8, "0"),
        (8, "1"),
        (8, "2"),
        (12, "0"),
        (12, "1"),
        (16, "0"),
        (16, "1"),
        (16, "2"),
    ]
    assert [p.island for p in order].count("island-2") * 2 == [p.island for p in order].count("island-0") == 4
    # τ = the updates applied between the island's pull (after its previous push, or at 0) and its push:
    # u0 island-0 pulled at 0 -> 0; u1 island-1 pulled at 0 -> 1; u2 island-0 pulled after u0 (1) -> 1;
    # u3 island-1 (2) -> 1; u4 island-2 pulled at 0 -> 4; u5 island-0 (3) -> 2; u6 island-1 (4) -> 2;
    # u7 island-0 (6) -> 1; u8 island-1 (7) -> 1; u9 island-2 pulled after u4 (5) -> 4.
    assert staleness(order) == [0, 1, 1, 1, 4, 2, 2, 1, 1, 4]


def test_push_times_are_exact_so_coinciding_pushes_tie_in_name_order() -> None:
    # H = 2: y (s = 1) at 2, 4, 6, 8; x (s = 1.5) at 3, 6, 9: at 6 both, and x sorts first.
    order = push_order({"y": 1.0, "x": 1.5}, inner_steps=2, updates=7)
    assert order == [
        Push(Fraction(t), name) for t, name in [(2, "y"), (3, "x"), (4, "y"), (6, "x"), (6, "y"), (8, "y"), (9, "x")]
    ]


def test_equally_fast_islands_are_each_m_minus_one_stale_after_the_first_round() -> None:
    order = push_order({"a": 1.0, "b": 1.0, "c": 1.0}, inner_steps=5, updates=9)
    assert [p.island for p in order] == ["a", "b", "c"] * 3
    assert staleness(order) == [0, 1, 2, 2, 2, 2, 2, 2, 2]


# -- the driver: simulate with train.mode = "async" -------------------------------------------------------------

H = 4
ASYNC = ["train.mode=async", f"train.inner_steps={H}"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_simulate_applies_the_pushes_in_virtual_time_order(tiny_config: Path, tmp_path: Path) -> None:
    overrides = [
        *ASYNC,
        "train.rounds=7",
        "train.checkpoint_every=0",
        "islands.count=3",
        "islands.slowdown=['island-2=2']",
        "outer.kind=delayed_nesterov",
    ]
    result = run_simulation(load_config(tiny_config, overrides), tmp_path / "run", show_progress=False)
    rounds = read_events(tmp_path / "run" / "metrics.jsonl", "round")
    expected = push_order(SLOW, H, 7)
    taus = staleness(expected)
    assert [(e["round"], e["island"], e["islands"], e["vtime"], e["staleness"]) for e in rounds] == [
        (u, p.island, [p.island], float(p.time), tau) for u, (p, tau) in enumerate(zip(expected, taus, strict=True))
    ]
    assert [e["weight"] for e in rounds] == [round((1 + tau) ** -0.5, 6) for tau in taus]
    inner = read_events(tmp_path / "run" / "metrics.jsonl", "inner")
    assert {(e["round"], e["island"]) for e in inner} == {(u, p.island) for u, p in enumerate(expected)}
    assert tuple(result) == SUMMARY_KEYS and result["mode"] == "async"
    assert result["rounds"] == result["syncs"] == 7
    assert result["tokens"] == 7 * H * 8 * 16  # seven pushes of H steps of 8 x 16 tokens
    assert result["inner_steps_per_island"] == 7 * H // 3
    assert result["bytes_up"] == 7 * 4 * result["param_count"]  # fp32: one Δ per update
    # Each update is pulled by its island together with the τ updates it missed: (τ + 1) fp32 updates.
    assert result["bytes_down"] == sum(tau + 1 for tau in taus) * 4 * result["param_count"]
    assert result["final_eval_loss"] < result["initial_eval_loss"]


@pytest.fixture
def two_sources(tmp_path: Path) -> tuple[Path, Path]:
    return write_corpus(tmp_path / "a.txt", seed=1), write_corpus(tmp_path / "b.txt", seed=2)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "outer",
    [["outer.kind=nesterov"], ["outer.kind=delayed_nesterov", "outer.momentum_every=1"]],
    ids=["nesterov", "dn1"],
)
def test_the_first_async_update_is_a_plain_diloco_outer_step(
    tiny_config: Path, tmp_path: Path, two_sources: tuple[Path, Path], outer: list[str]
) -> None:
    """Equal speeds: island-0 pushes first (the tie at H goes to it), 0 stale, weight 1. The same island alone in a
    plain DiLoCo run (the same data source, non-IID sources keep it its own) takes the same Δ, and one Nesterov step
    on it (DN with N = 1 is Nesterov bit for bit) commits the same θ_1."""
    a, b = two_sources
    common = ["train.rounds=1", f"train.inner_steps={H}", "train.checkpoint_every=0", "data.path=''"]
    plain = load_config(tiny_config, [*common, "islands.count=1", f"data.paths=['{a}']"])
    async_ = load_config(tiny_config, [*common, *outer, "train.mode=async", f"data.paths=['{a}', '{b}']"])
    reference = run_simulation(plain, tmp_path / "plain", show_progress=False)
    first = run_simulation(async_, tmp_path / "async", show_progress=False)
    (event,) = read_events(tmp_path / "async" / "metrics.jsonl", "round")
    assert (event["island"], event["staleness"], event["weight"]) == ("island-0", 0, 1.0)
    assert first["params_digest"] == reference["params_digest"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_with_one_island_async_is_plain_diloco_bit_for_bit(tiny_config: Path, tmp_path: Path) -> None:
    """One island is never stale (τ = 0, w = 1), always pulls the θ it pushed against, and its schedule spans the
    run's rounds × H: every update is a round of plain DiLoCo, lossy codecs and their residuals included."""
    common = [
        "islands.count=1",
        "train.rounds=3",
        f"train.inner_steps={H}",
        "train.checkpoint_every=0",
        "codec.uplink=int8",
        "codec.downlink=int8",
    ]
    plain = run_simulation(load_config(tiny_config, common), tmp_path / "plain", show_progress=False)
    async_ = run_simulation(
        load_config(tiny_config, [*common, "train.mode=async"]), tmp_path / "a", show_progress=False
    )
    assert async_["params_digest"] == plain["params_digest"]
    assert (async_["bytes_up"], async_["bytes_down"], async_["tokens"]) == (
        plain["bytes_up"],
        plain["bytes_down"],
        plain["tokens"],
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_async_simulate_resumes_bit_identically(tiny_config: Path, tmp_path: Path) -> None:
    """A kill right after update 2's checkpoint: the islands' pushes, staleness, DN's buffer and momentum and the
    codecs' residuals all carry on from the checkpoint and the push order."""
    overrides = [
        *ASYNC,
        "train.rounds=6",
        "train.checkpoint_every=2",
        "islands.slowdown=['island-1=2']",
        "outer.kind=delayed_nesterov",
        "outer.momentum_every=2",
        "codec.uplink=int8",
        "codec.downlink=int8",
    ]
    cfg = load_config(tiny_config, overrides)
    run_dir = tmp_path / "run"
    reference = run_simulation(cfg, run_dir, show_progress=False)
    for store in (run_dir / "checkpoints").iterdir():
        for step in store.iterdir():
            if step.name.isdigit() and int(step.name) > 2:
                shutil.rmtree(step)
    (run_dir / "summary.json").unlink()
    resumed = run_simulation(cfg, run_dir, show_progress=False)
    events = read_events(run_dir / "metrics.jsonl")
    assert [e["round"] for e in events if e["event"] == "resumed"] == [2]
    expected = push_order({"island-0": 1.0, "island-1": 2.0}, H, 6)
    assert [(e["round"], e["island"]) for e in events if e["event"] == "round"] == [
        (u, p.island) for u, p in enumerate(expected)
    ]
    assert resumed["params_digest"] == reference["params_digest"]
    assert resumed["final_eval_loss"] == reference["final_eval_loss"]
    assert resumed["tokens"] == reference["tokens"] == 6 * H * 8 * 16


# -- configs that cannot work ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["train.mode=async", "train.round_seconds=5"], "train.round_seconds cannot be set with it"),
        (["train.mode=async", "stream.fragments=2"], "stream.fragments / stream.overlap_steps cannot be set"),
        (["outer.momentum_every=0"], "outer.momentum_every must be >= 1 (got 0)"),
        (["outer.staleness_exponent=-1"], "outer.staleness_exponent must be a finite number >= 0 (got -1.0)"),
        (["outer.kind=delayed_nesterov", "outer.momentum=0"], "outer.momentum must be > 0 for outer.kind = 'delayed"),
        (["train.mode=lockstep"], "train.mode must be 'diloco', 'sync' or 'async' (got 'lockstep')"),
        (["outer.max_staleness=-1"], "outer.max_staleness must be >= 0 (got -1)"),
    ],
)
def test_an_async_setting_that_cannot_work_is_one_line(tiny_config: Path, overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tiny_config, overrides)
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_simulate_refuses_a_slowdown_whose_pushes_the_coordinator_would_refuse(
    tiny_config: Path, tmp_path: Path
) -> None:
    # island-1 is 8x slower: 8 pushes of island-0 come before its first, which is 8 updates stale (over 4).
    cfg = load_config(
        tiny_config, ["train.mode=async", "train.rounds=12", 'islands.slowdown=["island-1=8"]', "outer.max_staleness=4"]
    )
    with pytest.raises(ConfigError) as info:
        run_simulation(cfg, tmp_path / "run", show_progress=False)
    message = str(info.value)
    assert "island island-1's pushes would be up to 8 updates stale, over outer.max_staleness = 4" in message, message
