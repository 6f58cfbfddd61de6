"""The root of every user-facing error.

``UserError`` is the one base class of "the user got something wrong" (a config key, a data file, an island
name, a coordinator that refuses the config): the CLI catches exactly this type and prints its message as one
line with exit code 2, never a traceback. It lives in the floor, at the bottom of the import graph, so that
every package can subclass it without a hub module that imports them all (docs/architecture.md, "Errors").

``WaitedTooLong`` is the one other way a process ends with one line: a wait whose bound ran out (a coordinator that
did not answer for the island's patience, a checkpoint that was never written). Its line names what was waited for,
and its exit code, 69 (sysexits' EX_UNAVAILABLE), tells a supervisor to start the process again, which it never does
for a user error.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; its message is one line that names the config key, file, island or tensor."""

    exit_code = 2


class WaitedTooLong(UserError):
    """A bounded wait ran out; its message is one line naming what the process waited for and for how long."""

    exit_code = 69
