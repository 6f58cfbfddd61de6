"""The model registry: build a `Model` (pure init/loss functions over a float32 pytree) from a `ModelConfig`.

`build_model` dispatches on `cfg.kind` through the `MODELS` registry: the dense decoder-only transformer (GPT-2
shape), its mixture-of-experts variant, the Llama family (dense and with routed experts), or a user model imported
from `cfg.entry` ("package.module:function"). `ARCHITECTURES` holds the built-in kinds' shared-block functions, for
what runs them outside `loss` (the sampler's cached forward, log-probabilities, a checkpoint's logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import jax

from islands.models import llama, moe, transformer
from islands.models.axes import axis_units
from islands.models.base import Model, param_count
from islands.models.config import ModelConfig, ModelError
from islands.user_code import load_callable


def build_custom(cfg: ModelConfig) -> Model:
    """Import `cfg.entry` ("package.module:function"), call it with cfg, wrap its init/loss in a Model.

    Import problems (islands/user_code.py) and a result without callable `init` and `loss` are ModelErrors naming
    model.entry; an exception raised inside the user's builder propagates unchanged (its traceback is the user's).
    """
    where = f"model.entry {cfg.entry!r}"
    _, _, attr = cfg.entry.partition(":")
    built = load_callable(cfg.entry, where, ModelError)(cfg)
    missing = [name for name in ("init", "loss") if not callable(getattr(built, name, None))]
    if missing:
        raise ModelError(
            f"{where}: {attr}(cfg) must return an object with callable init and loss "
            f"(got a {type(built).__name__} without {' and '.join(missing)})"
        )
    return built if isinstance(built, Model) else Model(init=built.init, loss=built.loss)


MODELS: dict[str, Callable[[ModelConfig], Model]] = {
    "transformer": transformer.build,
    "moe": moe.build,
    "llama": llama.build,
    "llama_moe": llama.build_moe,
    "custom": build_custom,
}
"""kind -> builder. Every kind in KINDS has an entry here."""


ARCHITECTURES: dict[str, transformer.Architecture] = {
    "transformer": transformer.GPT2,
    "moe": moe.GPT2_MOE,
    "llama": llama.LLAMA,
    "llama_moe": llama.LLAMA_MOE,
}
"""kind -> its blocks' functions (transformer.forward / forward_cached run them): every kind but custom."""


def build_model(cfg: ModelConfig) -> Model:
    """The Model that cfg describes (cfg is validated when it is constructed), with the units of its logical axes
    where it is a built-in kind."""
    model = MODELS[cfg.kind](cfg)
    return model if cfg.kind == "custom" else replace(model, axis_units=axis_units(cfg))


def parameter_count(cfg: ModelConfig) -> int:
    """The scalars of the model `cfg` describes, from its abstract init (shapes only: nothing is allocated)."""
    return param_count(jax.eval_shape(build_model(cfg).init, jax.random.key(0)))
