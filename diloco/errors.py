"""The exception types that mean "the user got something wrong": the CLI prints them as one line, exit 2.

Each package raises its own (islands cannot import diloco); this is the one place that lists them all.
"""

from __future__ import annotations

from diloco.config import ConfigError
from diloco.rundir import RunDirError
from islands.data import DataError
from islands.mesh import MeshError
from islands.models import ModelError

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, DataError, MeshError, ModelError, RunDirError)
