"""The model registry: build a `Model` (pure init/loss functions over a float32 pytree) from a `ModelConfig`.

`build_model` dispatches on `cfg.kind` through the `MODELS` registry: the dense decoder-only transformer,
its mixture-of-experts variant, or a user model imported from `cfg.entry` ("package.module:function").
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from islands.models import moe, transformer
from islands.models.base import Model
from islands.models.config import ModelConfig, ModelError


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if isinstance(err, ModuleNotFoundError) else f"{type(err).__name__}: {text}"


def _import(module_name: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Console scripts do not put the working directory on sys.path, yet a user's model file next to
        # their config is the common case; look there too (appended, so it never shadows a package).
        top = module_name.split(".")[0]
        if err.name != top or os.getcwd() in sys.path or "" in sys.path:
            raise
        sys.path.append(os.getcwd())
        return importlib.import_module(module_name)


def build_custom(cfg: ModelConfig) -> Model:
    """Import `cfg.entry` ("package.module:function"), call it with cfg, wrap its init/loss in a Model.

    Import problems and a result without callable `init` and `loss` are ModelErrors naming model.entry;
    an exception raised inside the user's builder propagates unchanged (its traceback is the user's).
    """
    module_name, _, attr = cfg.entry.partition(":")
    where = f"model.entry {cfg.entry!r}"
    try:
        module = _import(module_name)
    except Exception as err:  # any failure while importing user code is a config problem to report
        raise ModelError(f"{where}: cannot import module {module_name!r} ({_one_line(err)})") from err
    builder = getattr(module, attr, None)
    if builder is None:
        raise ModelError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    if not callable(builder):
        raise ModelError(f"{where}: {attr!r} is not callable (it is a {type(builder).__name__})")
    built = builder(cfg)
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
    "custom": build_custom,
}
"""kind -> builder. Every kind in KINDS has an entry here."""


def build_model(cfg: ModelConfig) -> Model:
    """The Model that cfg describes (cfg is validated when it is constructed)."""
    return MODELS[cfg.kind](cfg)
