"""Operational lines through `logging` (diloco/ops/logs.py): text as a person reads it, or one JSON object per line.

The formatters on records made here; the CLI in child processes, as a user runs it: a user error is one line
in either format, a training run's progress lines are JSON records with their fields, the level is honoured, and
the choice reaches the processes a command starts through the environment.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.ops.logs import FORMAT_VAR, LEVEL_VAR, JsonFormatter, LogSettingError, TextFormatter, configure, settings
from tests.conftest import run_cli


@pytest.fixture
def restored_env() -> Iterator[None]:
    """`configure` passes its choice to child processes through the environment: undo it for the other tests."""
    before = {k: os.environ.get(k) for k in (FORMAT_VAR, LEVEL_VAR)}
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    root.handlers[:] = handlers
    root.setLevel(level)


def _emit(formatter: logging.Formatter, name: str, level: int, msg: str, **extra: object) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.propagate, before = False, logger.level
    logger.setLevel(logging.DEBUG)
    try:
        logger.log(level, msg, extra=extra or None)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(before)
    return out.getvalue()


@pytest.mark.parametrize(
    ("name", "level", "line"),
    [
        ("diloco.coordinator.serve", logging.INFO, "listening on 127.0.0.1:5"),  # diloco's info: the line as it is
        ("diloco", logging.WARNING, "diloco: warning: listening on 127.0.0.1:5"),
        ("diloco.cli", logging.ERROR, "diloco: error: listening on 127.0.0.1:5"),
        ("absl", logging.WARNING, "absl: warning: listening on 127.0.0.1:5"),  # a library's: who says it
        ("orbax", logging.INFO, "orbax: info: listening on 127.0.0.1:5"),
    ],
)
def test_text_lines_read_as_before(name: str, level: int, line: str) -> None:
    assert _emit(TextFormatter(), name, level, "listening on 127.0.0.1:5") == line + "\n"


def test_a_json_record_is_one_line_with_its_fields_even_with_newlines() -> None:
    text = _emit(
        JsonFormatter(), "diloco.coordinator.serve", logging.WARNING, "two\nlines", fields={"round": 3, "eval": 2.5}
    )
    assert text.count("\n") == 1
    record = json.loads(text)
    assert (
        record["level"] == "warning"
        and record["logger"] == "diloco.coordinator.serve"
        and record["msg"] == "two\nlines"
    )
    assert record["round"] == 3 and record["eval"] == 2.5 and record["t"].endswith("Z")


def test_settings_come_from_the_command_line_then_the_environment(
    monkeypatch: pytest.MonkeyPatch, restored_env: None
) -> None:
    monkeypatch.delenv(FORMAT_VAR, raising=False)
    monkeypatch.delenv(LEVEL_VAR, raising=False)
    assert settings(None, None) == ("text", "info")
    monkeypatch.setenv(FORMAT_VAR, "json")
    assert settings(None, "error") == ("json", "error")
    assert settings("text", None) == ("text", "info")
    monkeypatch.setenv(LEVEL_VAR, "loud")
    with pytest.raises(LogSettingError, match=r"^DILOCO_LOG_LEVEL must be one of debug, info, warning, error"):
        settings(None, None)
    configure("json", "warning")  # and the choice is passed on to children
    assert (os.environ[FORMAT_VAR], os.environ[LEVEL_VAR]) == ("json", "warning")
    assert logging.getLogger("diloco").level == logging.getLogger().level == logging.WARNING
    configure("text", "info")  # diloco's info lines; the libraries' only from warning up
    assert (logging.getLogger("diloco").level, logging.getLogger().level) == (logging.INFO, logging.WARNING)


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.slow
def test_a_user_error_is_one_line_in_either_format(tmp_path: Path, fmt: str) -> None:
    missing = tmp_path / "nope.toml"
    result = run_cli("simulate", str(missing), "--log-format", fmt)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    if fmt == "text":
        assert lines[0].startswith("diloco: error: ") and "nope.toml" in lines[0]
    else:
        record = json.loads(lines[0])
        assert record["level"] == "error" and "nope.toml" in record["msg"], record


@pytest.mark.slow
def test_a_run_logs_json_records_and_honours_the_level(tiny_config: Path, tmp_path: Path) -> None:
    rounds = ["train.rounds=2", "train.inner_steps=2"]
    loud = run_cli("simulate", str(tiny_config), "--run-dir", str(tmp_path / "a"), "--log-format", "json", *rounds)
    assert loud.returncode == 0, loud.stderr
    records = [json.loads(line) for line in loud.stderr.splitlines()]  # every line is a JSON record
    progress = [r for r in records if r["logger"] == "diloco.ops.progress"]
    assert [r["round"] for r in progress] == [1, 2] and all("eval_loss" in r for r in progress), records
    json.loads(loud.stdout)  # the result stays on stdout, as it was
    quiet = run_cli("simulate", str(tiny_config), "--run-dir", str(tmp_path / "b"), "--log-level", "warning", *rounds)
    assert quiet.returncode == 0 and "round 1/2" not in quiet.stderr, quiet.stderr
