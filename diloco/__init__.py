"""diloco: DiLoCo across regions over slow, unreliable links (README.md; docs/architecture.md)."""

from __future__ import annotations

from importlib import metadata


def _release() -> str:
    """The installed distribution's version (pyproject.toml), or "unknown" for a checkout that was never installed."""
    try:
        return metadata.version("diloco")
    except metadata.PackageNotFoundError:
        return "unknown"


RELEASE = _release()
"""This process's diloco release. An island sends it with its join, and the coordinator refuses a different one:
θ's digest, the codecs and the outer step are only bit-identical within a release (`Coordinator.join`)."""
