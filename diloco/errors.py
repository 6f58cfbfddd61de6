"""The exception types that mean "the user got something wrong": the CLI prints them as one line, exit 2.

Each package raises its own (islands cannot import diloco); this is the one place that lists them all.
"""

from __future__ import annotations

from diloco.bench_federation import BenchError
from diloco.config import ConfigError
from diloco.island_worker import CoordinatorAway, IslandError
from diloco.launch import LaunchError
from diloco.rundir import RunDirError
from diloco.serve import ListenError
from islands.data import DataError
from islands.mesh import MeshError
from islands.models import ModelError
from transport.auth import SecretError
from transport.errors import TransportError

USER_ERRORS: tuple[type[Exception], ...] = (
    BenchError, ConfigError, CoordinatorAway, DataError, IslandError, LaunchError, ListenError, MeshError, ModelError,
    RunDirError, SecretError, TransportError,
)  # fmt: skip
