"""`BenchError`: a benchmark that cannot run or did not finish, reported as one line by the CLI (exit 2).

A module of its own, free of heavy imports (no JAX), so that every benchmark module and the bench CLI can raise it.
"""

from __future__ import annotations

from collections.abc import Sequence

from floor.errors import UserError


class BenchError(UserError, ValueError):
    """The benchmark cannot run with these arguments or this config, or its run failed (the message says which).

    A UserError, so the CLI prints it as one line.
    """


def parse_names(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `allowed`; otherwise a one-line BenchError naming the flag ("bench byzantine
    --attacks")."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise BenchError(f"{flag} takes a comma-separated list of {', '.join(allowed)} (got {text!r})")
    return names
