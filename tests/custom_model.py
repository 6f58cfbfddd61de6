"""A tiny user model for the model-zoo tests: a bigram table, built through `model.kind = "custom"`.

It shows the whole contract a user model must meet: `build(cfg)` returns any object with `init(key) ->
params` and `loss(params, batch) -> (loss, metrics)` over a pytree of float32 arrays.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp

from islands.models.config import ModelConfig


def build(cfg: ModelConfig) -> SimpleNamespace:
    """Bigram model: logits for the next token are a row of a [vocab, vocab] table."""

    def init(key: jax.Array) -> dict[str, jax.Array]:
        return {"table": cfg.init_scale * jax.random.normal(key, (cfg.vocab_size, cfg.vocab_size))}

    def loss(params: dict[str, jax.Array], batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        logp = jax.nn.log_softmax(params["table"][batch[:, :-1]], axis=-1)
        ce = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1).mean()
        return ce, {"ce": ce}

    return SimpleNamespace(init=init, loss=loss)


def build_without_loss(cfg: ModelConfig) -> SimpleNamespace:
    """A broken builder: its result has no loss function."""
    return SimpleNamespace(init=lambda key: {})


NOT_A_FUNCTION = 3
"""A broken entry point: not callable."""
