"""Outer optimizers against hand-computed updates, the aggregation, and the FedAvg invariant."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco.run.rounds import OuterLoop, RoundError
from floor.codec import CodecSpec
from outer_optimizer.aggregate import pseudo_gradient, weighted_mean
from outer_optimizer.config import KINDS, OuterConfig
from outer_optimizer.optimizers import OUTER_OPTIMIZERS, apply_update, build_optimizer, make_outer_step

FP32 = CodecSpec(kind="fp32")


def _steps(cfg: OuterConfig, grads: list[np.ndarray], theta0: np.ndarray) -> list[np.ndarray]:
    tx = build_optimizer(cfg)
    step = make_outer_step(tx)
    params = {"w": jnp.asarray(theta0)}
    state = tx.init(params)
    out = []
    for g in grads:
        update, state = step(params, state, {"w": jnp.asarray(g)})
        params = apply_update(params, update)
        out.append(np.asarray(params["w"]))
    return out


def test_every_kind_the_config_accepts_has_a_builder() -> None:
    assert list(OUTER_OPTIMIZERS) == list(KINDS)


def test_nesterov_matches_hand_computation() -> None:
    lr, mu = 0.7, 0.9
    theta = np.array([1.0, -2.0], np.float32)
    grads = [np.array([0.5, -1.0], np.float32), np.array([0.25, 0.5], np.float32)]
    got = _steps(OuterConfig(kind="nesterov", lr=lr, momentum=mu), grads, theta)
    # Nesterov (Sutskever form, as optax): m_t = g_t + μ m_{t-1};  θ_t = θ_{t-1} - lr (g_t + μ m_t)
    m = np.zeros(2)
    expected = theta.astype(np.float64)
    for g, result in zip(grads, got, strict=True):
        m = g + mu * m
        expected = expected - lr * (g + mu * m)
        np.testing.assert_allclose(result, expected, rtol=1e-6)


def test_sgd_lr1_is_fedavg() -> None:
    theta = np.array([3.0, 4.0], np.float32)
    locals_ = [np.array([1.0, 2.0], np.float32), np.array([2.0, 0.0], np.float32)]
    deltas = [pseudo_gradient({"w": theta}, {"w": x}) for x in locals_]
    mean = weighted_mean(deltas, [1, 1])
    (after,) = _steps(OuterConfig(kind="sgd", lr=1.0, momentum=0.0), [np.asarray(mean["w"])], theta)
    np.testing.assert_allclose(after, np.mean(locals_, axis=0), rtol=1e-6)


def test_adam_first_step_is_signed_lr() -> None:
    theta = np.zeros(3, np.float32)
    g = np.array([1e-3, -5.0, 2.0], np.float32)
    (after,) = _steps(OuterConfig(kind="adam", lr=0.1, b1=0.9, b2=0.99, eps=1e-8), [g], theta)
    # Bias-corrected first step: m̂ = g, v̂ = g², so the update is -lr * g / (|g| + ε).
    np.testing.assert_allclose(after, -0.1 * g / (np.abs(g) + 1e-8), rtol=1e-5)


def test_clipping_chains_in_front() -> None:
    g = np.array([3.0, 4.0], np.float32)  # norm 5
    (after,) = _steps(OuterConfig(kind="sgd", lr=1.0, momentum=0.0, clip_norm=1.0), [g], np.zeros(2, np.float32))
    np.testing.assert_allclose(after, -g / 5.0, rtol=1e-6)


def test_weighted_mean_weights_by_tokens_in_given_order() -> None:
    a, b = {"w": jnp.array([1.0])}, {"w": jnp.array([4.0])}
    np.testing.assert_allclose(weighted_mean([a, b], [3, 1])["w"], [1.75])
    with pytest.raises(ValueError, match="positive sum"):
        weighted_mean([a], [0])
    with pytest.raises(ValueError, match="2 pseudo-gradients but 1 weights"):
        weighted_mean([a, b], [1])


def test_outer_loop_commits_in_name_order_and_guards_rounds() -> None:
    params = {"w": jnp.array([1.0, 1.0])}
    tx = build_optimizer(OuterConfig(kind="sgd", lr=1.0, momentum=0.0))
    loop_a, loop_b = OuterLoop.fresh(params, tx, FP32), OuterLoop.fresh(params, tx, FP32)
    deltas = {
        "z": {"w": jnp.array([0.1, 0.3])},
        "a": {"w": jnp.array([0.7, 1e-8])},
        "m": {"w": jnp.array([3.0, 1.0])},
    }
    for name in ["z", "a", "m"]:
        loop_a.submit(name, 0, deltas[name], tokens=10)
    for name in ["m", "z", "a"]:
        loop_b.submit(name, 0, deltas[name], tokens=10)
    ca, cb = loop_a.commit(), loop_b.commit()
    assert ca.digest == cb.digest and ca.islands == ("a", "m", "z") and loop_a.round == 1
    with pytest.raises(RoundError, match="round 0; round 1 is open"):
        loop_a.submit("a", 0, deltas["a"], tokens=10)
    loop_a.submit("a", 1, deltas["a"], tokens=10)
    with pytest.raises(RoundError, match="already contributed"):
        loop_a.submit("a", 1, deltas["a"], tokens=10)
    with pytest.raises(RoundError, match="no contributions"):
        OuterLoop.fresh(params, tx, FP32).commit()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "nesterov", "momentum": 0.0}, "must be > 0"),
        ({"lr": -1.0}, "outer.lr must be > 0"),
        ({"momentum": 1.0}, "outer.momentum must be in [0, 1)"),
    ],
)
def test_outer_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        OuterConfig(**kwargs)
    assert message in str(err.value)


def test_optax_chain_composes() -> None:
    tx = optax.chain(optax.clip(0.1), build_optimizer(OuterConfig()))
    state = tx.init({"w": jnp.zeros(2)})
    updates, _ = tx.update({"w": jnp.array([5.0, -5.0])}, state, {"w": jnp.zeros(2)})
    assert np.all(np.abs(np.asarray(updates["w"])) <= 0.7 * 0.1 * (1 + 0.9) + 1e-6)
