"""User code named in a config as "package.module:function": a model's builder (`model.entry`), a reward
(`workload.reward`).

One loader for every such key, so each imports user code alike: the module is looked for on sys.path and then in the
working directory (a user's file next to their config is the common case), and every way it can fail to give a
callable is one line naming the key. JAX-free: a reward loads without JAX, and so do its tests.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from floor.errors import UserError


def entry_form_ok(spec: str) -> bool:
    """Whether spec has the form "package.module:function" (one colon, text on both sides)."""
    module, sep, attr = spec.partition(":")
    return bool(sep and module and attr and ":" not in attr)


def one_line(err: BaseException) -> str:
    """An exception as one line of text: its type and its message with every run of whitespace made one space."""
    text = " ".join(str(err).split())
    return text if isinstance(err, ModuleNotFoundError) else f"{type(err).__name__}: {text}"


def import_module(module_name: str) -> object:
    """`importlib.import_module`, and if the top-level package is not found, again with the working directory on
    sys.path."""
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


def load_callable(spec: str, where: str, error: type[UserError]) -> Callable[..., Any]:
    """The callable that spec ("package.module:function", its form already checked) names.

    A module that does not import (whatever it raises while importing), a missing attribute and one that is not
    callable are each an `error` whose one-line message starts with `where` (the config key and its value).
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = import_module(module_name)
    except Exception as err:  # any failure while importing user code is a config problem to report
        raise error(f"{where}: cannot import module {module_name!r} ({one_line(err)})") from err
    found = getattr(module, attr, None)
    if found is None:
        raise error(f"{where}: module {module_name!r} has no attribute {attr!r}")
    if not callable(found):
        raise error(f"{where}: {attr!r} is not callable (it is a {type(found).__name__})")
    return found
