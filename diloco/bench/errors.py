"""`BenchError`: a benchmark that cannot run or did not finish, reported as one line by the CLI (exit 2).

A module of its own, free of heavy imports (no JAX), so that every benchmark module and the bench CLI can raise it.
"""

from __future__ import annotations

from floor.errors import UserError


class BenchError(UserError, ValueError):
    """The benchmark cannot run with these arguments or this config, or its run failed (the message says which).

    A UserError, so the CLI prints it as one line.
    """
