"""Muon inside the islands (`inner.kind = "muon"`, islands/inner.py) and the schedule's span (`inner.schedule_steps`).

Which parameter goes to which optimizer is a pure function of names and shapes (`muon_dimensions`), tested as a
table; one real update shows each side does what it says (Muon's update orthogonalized, AdamW's that of optax's
AdamW on those leaves alone); a Muon run resumes from its checkpoints to the uninterrupted run's digest, as AdamW's
does (tests/test_simulate.py, tests/test_vectorized.py).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco.config import load_config
from diloco.run.rundir import read_events
from diloco.simulator.simulate import run_simulation
from islands.config import InnerConfig
from islands.inner import MuonError, learning_rate_schedule, make_inner_optimizer, muon_dimensions
from islands.models.config import ModelConfig
from islands.models.registry import build_model
from pytrees.naming import flatten_named, path_name
from tests.conftest import cut_after_round, fails
from tests.custom_model import build as build_bigram

SMALL = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "vocab_size": 64}


def params_of(kind: str) -> dict:
    return build_model(ModelConfig(kind=kind, **SMALL)).init(jax.random.key(0))


def split(params: dict) -> dict[str, tuple[int, int] | None]:
    """Leaf name -> Muon's (reduction, output) axes, or None for the leaves AdamW takes."""
    is_spec = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)  # noqa: E731
    specs = jax.tree_util.tree_flatten_with_path(muon_dimensions(params), is_leaf=is_spec)[0]
    taken = {path_name(path): None if s is None else (s.reduction_axis, s.output_axis) for path, s in specs}
    assert taken.keys() == flatten_named(params).keys()  # every parameter has one optimizer
    return taken


# -- which parameters Muon takes -------------------------------------------------------------------------------------


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest() -> None:
    taken = split(params_of("transformer"))
    muon = {name for name, axes in taken.items() if axes is not None}
    assert muon == {f"blocks/{i}/{m}" for i in (0, 1) for m in ("attn/wqkv", "attn/wo", "ff/w1", "ff/w2")}
    assert all(taken[name] == (0, 1) for name in muon)
    # The embeddings (the token table is the tied output head), norms and biases stay on AdamW.
    assert {"embed/tok", "embed/pos", "final_norm/scale", "blocks/0/ff/b1", "blocks/1/ln2/bias"} <= {
        name for name, axes in taken.items() if axes is None
    }


@pytest.mark.slow
def test_a_mixture_of_experts_gives_muon_its_router_and_each_experts_matrices() -> None:
    taken = split(params_of("moe"))
    assert taken["blocks/0/ff/router"] == (0, 1)
    assert taken["blocks/0/ff/w1"] == taken["blocks/0/ff/w2"] == (1, 2)  # [E, D, F]: E matrices, one at a time
    assert taken["blocks/0/ff/b1"] is None and taken["blocks/0/ff/b2"] is None  # per-expert biases [E, F]: vectors


def test_a_model_with_nothing_for_muon_is_refused_in_one_line() -> None:
    table = build_bigram(ModelConfig(**SMALL)).init(jax.random.key(0))
    with pytest.raises(MuonError, match=r'^inner\.kind = "muon" finds no hidden-layer weight matrix') as exc:
        muon_dimensions(table)
    assert "\n" not in str(exc.value)


# -- one update ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_update_orthogonalizes_the_matrices_and_steps_the_rest_with_adamw() -> None:
    """Past its warmup, Muon's update of a matrix is lr · sqrt(max(1, fan_out / fan_in)) times a near-orthogonal
    matrix (its singular values near 1, whatever the gradient's); every other leaf moves as optax's (Nesterov) AdamW
    moves it alone, with inner.lr."""
    params = params_of("transformer")
    model = build_model(ModelConfig(**SMALL))
    batch = jax.random.randint(jax.random.key(1), (8, SMALL["seq_len"] + 1), 0, SMALL["vocab_size"])
    grads = jax.grad(lambda p: model.loss(p, batch)[0])(params)
    cfg = InnerConfig(kind="muon", lr=1e-3, muon_lr=0.05, warmup_steps=0, clip_norm=0.0, weight_decay=0.1)
    tx = make_inner_optimizer(cfg, 100)
    updates = flatten_named(tx.update(grads, tx.init(params), params)[0])

    lr0 = float(learning_rate_schedule(cfg, 100, cfg.muon_lr)(0))
    w1 = updates["blocks/0/ff/w1"]  # [32, 64]: fan_out / fan_in = 2
    singular = np.linalg.svd(w1 / (-lr0 * np.sqrt(2.0)), compute_uv=False)
    raw = np.linalg.svd(np.asarray(grads["blocks"][0]["ff"]["w1"]), compute_uv=False)
    kept = raw > 1e-3 * raw.max()  # the gradient's null directions (a layer norm's mean) stay null
    assert kept.sum() >= 30 and 0.5 < singular[kept].min() and singular[kept].max() < 1.5
    assert raw[kept].max() / raw[kept].min() > 10  # the gradient itself is far from orthogonal

    adamw = optax.adamw(learning_rate_schedule(cfg, 100), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.1)
    alone = {"tok": params["embed"]["tok"]}
    nesterov = optax.adamw(
        learning_rate_schedule(cfg, 100), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.1, nesterov=True
    )
    g = {"tok": grads["embed"]["tok"]}
    expected = nesterov.update(g, nesterov.init(alone), alone)[0]["tok"]
    np.testing.assert_allclose(updates["embed/tok"], np.asarray(expected), rtol=1e-5, atol=1e-9)  # the same to rounding
    plain = adamw.update(g, adamw.init(alone), alone)[0]["tok"]
    assert not np.allclose(updates["embed/tok"], np.asarray(plain), rtol=1e-3)  # optax's Muon gives its AdamW Nesterov


@pytest.mark.slow
def test_adamw_is_the_optimizer_it_always_was() -> None:
    """inner.kind = "adamw" (the default) builds clip + optax.adamw on the cosine: the digests of every AdamW run
    stay as they were."""
    params = params_of("transformer")
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    cfg = InnerConfig(warmup_steps=2)
    ours = make_inner_optimizer(cfg, 20)
    before = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, cfg.lr, 2, 20, cfg.lr * cfg.min_lr_ratio),
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=0.1,
        ),
    )
    s1, s2 = ours.init(params), before.init(params)
    for _ in range(3):
        u1, s1 = ours.update(grads, s1, params)
        u2, s2 = before.update(grads, s2, params)
        jax.tree.map(np.testing.assert_array_equal, u1, u2)


# -- the schedule's span ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_schedule_steps_sets_the_span_whatever_the_runs_length() -> None:
    """Two runs on one inner.schedule_steps have one schedule: a pretraining of 8 steps and its continuation of 24
    see the rates of a single run of 32 (the count they step at is what the warm start carries over)."""
    spanned = InnerConfig(warmup_steps=2, schedule_steps=32)
    plain = InnerConfig(warmup_steps=2)
    grads = {"w": jnp.ones((3,))}
    for total in (8, 24):
        tx, whole = make_inner_optimizer(spanned, total), make_inner_optimizer(plain, 32)
        s1, s2 = tx.init(grads), whole.init(grads)
        for _ in range(32):
            u1, s1 = tx.update(grads, s1, grads)
            u2, s2 = whole.update(grads, s2, grads)
            np.testing.assert_array_equal(u1["w"], u2["w"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["inner.kind=lion"], "inner.kind must be one of adamw, muon (got 'lion')"),
        (["inner.muon_lr=0"], "inner.muon_lr must be > 0"),
        (["inner.muon_momentum=1"], "inner.muon_momentum must be in [0, 1)"),
        (["inner.muon_weight_decay=-1"], "inner.muon_weight_decay must be >= 0"),
        (["inner.schedule_steps=-1"], "inner.schedule_steps must be >= 0"),
        (["inner.schedule_steps=11"], "inner.schedule_steps (11) is shorter than the run's"),
        (["inner.kind=muon", "model.kind=custom", "model.entry=tests.custom_model:build"], "finds no hidden-layer"),
    ],
)
def test_bad_inner_keys_are_one_line(
    overrides: list[str], expected: str, tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fails(capsys, ["simulate", str(tiny_config), "--run-dir", str(tmp_path / "run"), *overrides], expected)


# -- simulate --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("vectorize", [False, True])
def test_a_muon_run_learns_and_resumes_to_the_same_parameters(
    tiny_config: Path, tmp_path: Path, vectorize: bool
) -> None:
    """Muon's state (its momentum, Newton-Schulz coefficients, the AdamW side's moments, every count) goes through
    orbax like AdamW's: a run cut back to its round-1 checkpoint ends with the uninterrupted run's digest."""
    cfg = load_config(
        tiny_config, ["inner.kind=muon", "codec.uplink=int8", f"train.vectorize={str(vectorize).lower()}"]
    )
    run_dir = tmp_path / "run"
    reference = run_simulation(cfg, run_dir, show_progress=False)
    assert reference["final_eval_loss"] < reference["initial_eval_loss"] - 1.0
    cut_after_round(run_dir, 1)
    resumed = run_simulation(cfg, run_dir, show_progress=False)
    assert [e["round"] for e in read_events(run_dir / "metrics.jsonl", "resumed")] == [1]
    assert resumed["params_digest"] == reference["params_digest"]
    assert resumed["final_eval_loss"] == reference["final_eval_loss"]
