"""Model zoo: shapes, loss at init, causality, training, MoE routing and load balancing, config errors."""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from islands.models import moe, transformer
from islands.models.base import Model, param_count
from islands.models.config import ModelConfig, ModelError
from islands.models.registry import MODELS, build_model

TINY = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64, n_experts=4, top_k=2)
FORWARD = {"transformer": transformer.forward, "moe": moe.forward}


@functools.cache
def tiny(kind: str) -> tuple[ModelConfig, Model, dict]:
    """(config, model, params at init) of the tiny model of this kind, built once per test session."""
    cfg = replace(TINY, kind=kind)
    model = build_model(cfg)
    return cfg, model, jax.jit(model.init)(jax.random.key(0))


def random_batch(cfg: ModelConfig, batch: int = 8, seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32)


def train(model: Model, batch: jax.Array, steps: int, lr: float = 1e-2) -> tuple[float, float]:
    """(loss before, loss after) `steps` AdamW steps on one repeated batch."""
    params = jax.jit(model.init)(jax.random.key(0))
    opt = optax.adamw(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        (loss, _), grads = jax.value_and_grad(model.loss, has_aux=True)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    first = None
    for _ in range(steps):
        params, state, loss = step(params, state)
        first = float(loss) if first is None else first
    return first, float(jax.jit(model.loss)(params, batch)[0])


def test_registry_covers_every_kind():
    from islands.models.config import KINDS

    assert set(MODELS) == set(KINDS)


@pytest.mark.slow
def test_transformer_shapes_and_param_count():
    cfg, _, params = tiny("transformer")
    assert params["embed"]["tok"].shape == (cfg.vocab_size, cfg.d_model)
    assert params["embed"]["pos"].shape == (cfg.seq_len, cfg.d_model)
    assert len(params["blocks"]) == cfg.n_layers
    assert params["blocks"][0]["attn"]["wqkv"].shape == (cfg.d_model, 3 * cfg.d_model)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))
    d, f, v, t, n = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len, cfg.n_layers
    per_block = 2 * 2 * d + (3 * d * d + d * d) + (d * f + f + f * d + d)
    assert param_count(params) == v * d + t * d + n * per_block + 2 * d
    assert param_count(jax.eval_shape(build_model(cfg).init, jax.random.key(0))) == param_count(params)
    logits, aux = jax.jit(transformer.forward, static_argnums=2)(params, random_batch(cfg)[:, :-1], cfg)
    assert logits.shape == (8, cfg.seq_len, cfg.vocab_size) and logits.dtype == jnp.float32
    assert aux.shape == (cfg.n_layers,) and float(jnp.abs(aux).sum()) == 0.0


@pytest.mark.slow
def test_moe_shapes():
    cfg, _, params = tiny("moe")
    ff = params["blocks"][1]["ff"]
    assert ff["router"].shape == (cfg.d_model, cfg.n_experts)
    assert ff["w1"].shape == (cfg.n_experts, cfg.d_model, cfg.d_ff)
    assert ff["w2"].shape == (cfg.n_experts, cfg.d_ff, cfg.d_model)
    logits, aux = jax.jit(moe.forward, static_argnums=2)(params, random_batch(cfg)[:, :5], cfg)
    assert logits.shape == (8, 5, cfg.vocab_size) and aux.shape == (cfg.n_layers,)


@pytest.mark.parametrize("kind", ["transformer", "moe"])
@pytest.mark.slow
def test_loss_at_init_is_about_log_vocab(kind):
    cfg, model, params = tiny(kind)
    loss, metrics = jax.jit(model.loss)(params, random_batch(cfg))
    assert abs(float(metrics["ce"]) - math.log(cfg.vocab_size)) < 0.05
    if kind == "moe":
        assert set(metrics) == {"ce", "aux"}
        expected = float(metrics["ce"]) + cfg.aux_loss_weight * float(metrics["aux"])
        assert float(loss) == pytest.approx(expected)
    else:
        assert set(metrics) == {"ce"} and float(loss) == float(metrics["ce"])


@pytest.mark.parametrize("kind", ["transformer", "moe"])
@pytest.mark.slow
def test_causal_future_tokens_do_not_change_the_past(kind):
    cfg, _, params = tiny(kind)
    tokens = random_batch(cfg)[:, :-1]
    j = 9
    changed = tokens.at[:, j].set((tokens[:, j] + 1) % cfg.vocab_size)
    forward = jax.jit(FORWARD[kind], static_argnums=2)
    before, _ = forward(params, tokens, cfg)
    after, _ = forward(params, changed, cfg)
    np.testing.assert_allclose(before[:, :j], after[:, :j], atol=1e-5)
    assert float(jnp.abs(before[:, j:] - after[:, j:]).max()) > 1e-4


@pytest.mark.slow
def test_jit_matches_eager():
    cfg, model, params = tiny("transformer")
    # Bit-identical: an island that inits eagerly and one that jits the init agree on the θ_0 digest.
    eager = model.init(jax.random.key(0))
    assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(jnp.array_equal, params, eager)))
    batch = random_batch(cfg)
    (jl, jm), (el, em) = jax.jit(model.loss)(params, batch), model.loss(params, batch)
    assert float(jl) == pytest.approx(float(el), rel=1e-5)
    assert jm.keys() == em.keys()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["transformer", "moe"])
def test_adamw_steps_reduce_the_loss(kind):
    cfg = replace(TINY, kind=kind)
    before, after = train(build_model(cfg), random_batch(cfg), steps=25)
    assert after < before - 1.0


@pytest.mark.slow
def test_uniform_router_has_aux_one_and_collapse_has_aux_n_experts():
    combine, aux = moe.route(jnp.zeros((50, 4)), top_k=2, normalize=True)
    assert float(aux) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(combine.sum(-1), 1.0, rtol=1e-6)
    assert (np.count_nonzero(np.asarray(combine), axis=-1) == 2).all()
    # Everything sent to expert 0 (top-1): f = (1, 0, 0, 0), P -> (1, 0, 0, 0), aux -> n_experts.
    collapsed = jnp.tile(jnp.array([30.0, 0.0, 0.0, 0.0]), (50, 1))
    _, aux = moe.route(collapsed, top_k=1, normalize=False)
    assert float(aux) == pytest.approx(4.0, rel=1e-6)


@pytest.mark.slow
def test_top1_gate_is_the_router_probability():
    logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    combine, _ = moe.route(logits, top_k=1, normalize=False)
    probs = jax.nn.softmax(logits)
    np.testing.assert_allclose(combine, jnp.where(combine > 0, probs, 0.0), rtol=1e-6)
    assert (np.count_nonzero(np.asarray(combine), axis=-1) == 1).all()


@pytest.mark.slow
def test_moe_aux_at_init_is_near_balanced():
    cfg, model, params = tiny("moe")
    _, metrics = jax.jit(model.loss)(params, random_batch(cfg))
    assert 1.0 - 1e-3 <= float(metrics["aux"]) < 1.1


@pytest.mark.slow
def test_custom_model_builds_and_trains():
    cfg = ModelConfig(kind="custom", entry="tests.custom_model:build", vocab_size=32, seq_len=8)
    model = build_model(cfg)
    assert isinstance(model, Model)
    before, after = train(model, random_batch(cfg), steps=30, lr=0.1)
    assert abs(before - math.log(32)) < 0.1
    assert after < before - 1.0


@pytest.mark.slow
def test_custom_entry_found_in_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_model_for_test.py").write_text(
        "from tests.custom_model import build as make\n\ndef build(cfg):\n    return make(cfg)\n"
    )
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    model = build_model(ModelConfig(kind="custom", entry="cwd_model_for_test:build"))
    assert "table" in model.init(jax.random.key(0))


@pytest.mark.slow
def test_input_longer_than_seq_len_is_an_error():
    _, _, params = tiny("transformer")
    with pytest.raises(ModelError, match=r"model.seq_len \(16\)"):
        transformer.forward(params, jnp.zeros((2, 17), jnp.int32), TINY)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kind": "foo"}, "model.kind must be one of transformer, moe, llama, llama_moe, custom (got 'foo')"),
        ({"d_model": 130}, "model.d_model (130) must be divisible by model.n_heads (4)"),
        ({"top_k": 5}, "model.top_k (5) must be <= model.n_experts (4)"),
        ({"vocab_size": 0}, "model.vocab_size must be >= 1 (got 0)"),
        ({"seq_len": -3}, "model.seq_len must be >= 1 (got -3)"),
        ({"n_layers": 0}, "model.n_layers must be >= 1 (got 0)"),
        ({"d_ff": "512"}, "model.d_ff must be an integer (got '512')"),
        ({"n_heads": True}, "model.n_heads must be an integer (got True)"),
        ({"n_experts": 2.0}, "model.n_experts must be an integer (got 2.0)"),
        ({"init_scale": 0}, "model.init_scale must be a finite number > 0 (got 0)"),
        ({"aux_loss_weight": -0.5}, "model.aux_loss_weight must be a finite number >= 0 (got -0.5)"),
        ({"aux_loss_weight": float("nan")}, "model.aux_loss_weight must be a finite number >= 0 (got nan)"),
        ({"kind": "custom"}, 'model.entry must name the builder ("package.module:function") for kind custom'),
        (
            {"kind": "custom", "entry": "mymodel"},
            "model.entry 'mymodel' must have the form 'package.module:function'",
        ),
        ({"kind": "custom", "entry": "a:b:c"}, "model.entry 'a:b:c' must have the form"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ModelError) as err:
        ModelConfig(**overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_config_normalises_numbers():
    cfg = ModelConfig(init_scale=1, aux_loss_weight=0)
    assert isinstance(cfg.init_scale, float) and cfg == ModelConfig(init_scale=1.0, aux_loss_weight=0.0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "nosuch.mod:build",
            "model.entry 'nosuch.mod:build': cannot import module 'nosuch.mod' (No module named 'nosuch')",
        ),
        (
            "tests.custom_model:nope",
            "model.entry 'tests.custom_model:nope': module 'tests.custom_model' has no",
        ),
        ("tests.custom_model:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is not callable (it is a int)"),
        (
            "tests.custom_model:build_without_loss",
            "callable init and loss (got a SimpleNamespace without loss)",
        ),
    ],
)
def test_custom_entry_errors(entry, message):
    with pytest.raises(ModelError) as err:
        build_model(ModelConfig(kind="custom", entry=entry))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_custom_entry_whose_import_raises(tmp_path, monkeypatch):
    (tmp_path / "broken_model_for_test.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError) as err:
        build_model(ModelConfig(kind="custom", entry="broken_model_for_test:build"))
    assert str(err.value) == (
        "model.entry 'broken_model_for_test:build': cannot import module 'broken_model_for_test' "
        "(RuntimeError: boom second line)"
    )
