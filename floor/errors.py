"""The root of every user-facing error.

``UserError`` is the one base class of "the user got something wrong" (a config key, a data file, an island
name, a coordinator that refuses the config): the CLI catches exactly this type and prints its message as one
line with exit code 2, never a traceback. It lives in the floor, at the bottom of the import graph, so that
every package can subclass it without a hub module that imports them all (docs/architecture.md, "Errors").
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; its message is one line that names the config key, file, island or tensor."""
