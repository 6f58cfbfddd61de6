"""How an island process reaches its devices (`islands.backend`): the host's own, or a Pathways slice.

"local" (the default) is whatever JAX finds on this host: CPU devices, this machine's GPUs, this VM's TPU chips.
Nothing is done and nothing extra is imported.

"pathways" makes one island process the single controller of a TPU slice that Pathways on Cloud manages: JAX
reaches the slice through the Pathways IFRT proxy, and `pathwaysutils.initialize()` (the `pathways` extra)
registers that "proxy" backend with JAX. pathwaysutils reads where the proxy is from JAX's own settings, set by the
environment: JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET=grpc://HOST:PORT (a PathwaysJob's controller puts both in
its main container; docs/pathways.md). Everything else of the island (mesh, inner step, checkpoints, the wire) is
the same code: the slice's chips are what `jax.devices()` returns.

Two steps, because they fail differently:

* `check_backend` is cheap and imports nothing. `diloco island` runs it before it supervises, so a missing extra or
  environment variable is one line and exit code 2 from the command the user typed, not a worker failing at every
  restart. Without JAX_PLATFORMS=proxy, pathwaysutils.initialize() would quietly change nothing and the island
  would train on the host's CPU: that is refused, not allowed to happen silently.
* `initialize_backend` runs in the worker before anything asks JAX for a device: the proxy backend must be
  registered before JAX initializes its backends. A proxy that does not answer is JAX's own error at the first
  device query, left to the supervisor to retry (the proxy may still be starting next to the island).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from floor.errors import UserError

BACKENDS = ("local", "pathways")
"""The values of islands.backend."""

PATHWAYS_ENV = ("JAX_PLATFORMS", "JAX_BACKEND_TARGET")
"""The environment a Pathways island needs: JAX's platform ("proxy") and the proxy's grpc:// address."""


class BackendError(UserError, RuntimeError):
    """An island backend that cannot start as configured; one line naming the key, the extra or the variable."""


def check_backend(backend: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse, in one line, a backend this process cannot use: an unknown one, or "pathways" without the
    `pathways` extra or without the proxy's environment (`environ`, default os.environ)."""
    if backend not in BACKENDS:
        raise BackendError(f"islands.backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    if backend == "local":
        return
    if importlib.util.find_spec("pathwaysutils") is None:
        raise BackendError(
            "islands.backend = 'pathways' needs the pathways extra (pathwaysutils is not installed): "
            "pip install 'diloco[pathways]'"
        )
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS", "").split(",")
    if "proxy" not in platforms or not env.get("JAX_BACKEND_TARGET"):
        raise BackendError(
            "islands.backend = 'pathways' needs JAX_PLATFORMS=proxy and JAX_BACKEND_TARGET=grpc://HOST:PORT (the "
            "Pathways proxy) in the environment; a PathwaysJob sets both in its main container (docs/pathways.md)"
        )


def initialize_backend(backend: str) -> None:
    """Make JAX's devices those of `backend`; call it in an island process before anything asks JAX for a device.
    "local" does nothing (pathwaysutils is never imported); "pathways" checks, then runs
    `pathwaysutils.initialize()`, which registers the "proxy" backend JAX then connects through."""
    check_backend(backend)
    if backend == "local":
        return
    import pathwaysutils  # the pathways extra, checked above

    pathwaysutils.initialize()
