"""Operational lines of every diloco process go through Python `logging`, in one format chosen once per command.

    text (default)  what a person reads: an INFO line as it is ("diloco coordinator listening on ..."), a warning
                    or an error with its prefix ("diloco: warning: ...", "diloco: error: ..."); another library's
                    line (orbax, absl) prefixed with its logger ("absl: warning: ...")
    json            one JSON object per line, for log collectors: {"t": ISO-8601 UTC, "level", "logger", "msg"}
                    plus the record's `fields` (`log.info(msg, extra={"fields": {...}})`); a traceback, when there
                    is one, is a "traceback" string in the same line

Chosen with `--log-format text|json` and `--log-level debug|info|warning|error` on any command, or the environment
(DILOCO_LOG_FORMAT, DILOCO_LOG_LEVEL). `configure` writes the choice back into the environment, so the processes
a command starts (launch's coordinator and islands, a supervisor's worker) log the same way. Everything goes to
stderr. A command's *result* (a summary's JSON, `status` output, a plot's path) is not a log line: it stays on
stdout.

No log line is ever built from a secret's value: secrets are resolved in one place (transport/auth.py) and only
their references (env:NAME, file:PATH) are named in messages (tests/test_secure_defaults.py, tests/test_logs.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from floor.errors import UserError

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
FORMAT_VAR, LEVEL_VAR = "DILOCO_LOG_FORMAT", "DILOCO_LOG_LEVEL"
HANDLER_NAME = "diloco"


class LogSettingError(UserError, ValueError):
    """DILOCO_LOG_FORMAT / DILOCO_LOG_LEVEL hold a value that is not one of the choices."""


class TextFormatter(logging.Formatter):
    """A person's line: diloco's INFO as it is, anything else prefixed with who says it and how loud."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        who = "diloco" if record.name == "diloco" or record.name.startswith("diloco.") else record.name
        if who == "diloco" and record.levelno == logging.INFO:
            return message
        return f"{who}: {record.levelname.lower()}: {message}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (json.dumps escapes the newlines of a message or traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line: dict[str, Any] = {
            "t": stamp,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def settings(fmt: str | None, level: str | None) -> tuple[str, str]:
    """The format and level in force: the command line's, else the environment's, else text and info."""
    fmt = fmt or os.environ.get(FORMAT_VAR) or "text"
    level = level or os.environ.get(LEVEL_VAR) or "info"
    if fmt not in FORMATS:
        raise LogSettingError(f"{FORMAT_VAR} must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if level not in LEVELS:
        raise LogSettingError(f"{LEVEL_VAR} must be one of {', '.join(LEVELS)} (got {level!r})")
    return fmt, level


def configure(fmt: str | None = None, level: str | None = None) -> None:
    """Send every logger's records (diloco's and the libraries') to stderr in the chosen format; pass the choice
    on to child processes through the environment."""
    fmt, level = settings(fmt, level)
    os.environ[FORMAT_VAR], os.environ[LEVEL_VAR] = fmt, level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.set_name(HANDLER_NAME)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:  # a previous in-process main() call's
        root.removeHandler(old)
    root.addHandler(handler)
    # diloco's own lines at the chosen level; the libraries' (orbax, absl, jax) at warning or louder, unless debug:
    # their info lines are many and not the operator's business.
    logging.getLogger("diloco").setLevel(level.upper())
    root.setLevel(
        level.upper() if level in ("debug", "error") else max(logging.WARNING, logging.getLevelName(level.upper()))
    )
