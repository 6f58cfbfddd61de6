"""Fault injection at named points (diloco/faults.py): the spec as a table, and a pause as a thread sees it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import pytest

from diloco import faults
from diloco.faults import FaultSpecError, Pause, Pauses, from_env, parse
from diloco.harness.procs import wait_until
from tests.conftest import fails

WAIT_S = 30.0
T = TypeVar("T")


@pytest.mark.parametrize(
    ("spec", "pauses"),
    [
        ("", ()),
        (" , ", ()),
        ("island-1:before_push:3", (Pause("island-1", "before_push", 3),)),
        ("island-0:after_adopt:0+", (Pause("island-0", "after_adopt", 0, or_later=True),)),
        (
            "island-1:before_push:3, coordinator:after_commit:2",
            (Pause("island-1", "before_push", 3), Pause("coordinator", "after_commit", 2)),
        ),
        (
            "coordinator:before_commit:1,coordinator:before_commit:1+",
            (Pause("coordinator", "before_commit", 1), Pause("coordinator", "before_commit", 1, or_later=True)),
        ),
    ],
)
def test_spec(spec: str, pauses: tuple[Pause, ...]) -> None:
    assert parse(spec) == pauses


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("island-1:before_push", "DILOCO_PAUSE_AT: 'island-1:before_push' is not WHO:POINT:ROUND"),
        ("island-1:before_push:3:4", "'island-1:before_push:3:4' is not WHO:POINT:ROUND"),
        (":before_push:3", "':before_push:3' is not WHO:POINT:ROUND"),
        (
            "island-1:before_commit:3",
            "'island-1:before_commit:3': island-1's points are before_lease, before_push, after_adopt",
        ),
        (
            "coordinator:before_push:3",
            "'coordinator:before_push:3': coordinator's points are before_restore, before_commit, after_commit",
        ),
        ("island-1:before_push:-1", "'island-1:before_push:-1': the round must be a number >= 0"),
        ("island-1:before_push:three", "the round must be a number >= 0, with + for 'or later'"),
        ("island-1:before_push:+", "the round must be a number >= 0"),
        ("island-1:before_push:²", "the round must be a number >= 0"),
        ("island-1:before_push:3,island-1:before_push:3", "'island-1:before_push:3' is named twice"),
    ],
)
def test_a_malformed_spec_is_one_line_naming_it(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        parse(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_pauses_need_a_directory() -> None:
    assert from_env({}) == ((), None)
    with pytest.raises(FaultSpecError, match="DILOCO_PAUSE_AT is set but DILOCO_PAUSE_DIR"):
        from_env({"DILOCO_PAUSE_AT": "island-0:before_push:1"})


@pytest.mark.parametrize(
    ("pause", "reached", "stops"),
    [
        (Pause("island-1", "before_push", 3), ("island-1", "before_push", 3), True),
        (Pause("island-1", "before_push", 3), ("island-1", "before_push", 4), False),
        (Pause("island-1", "before_push", 3), ("island-0", "before_push", 3), False),
        (Pause("island-1", "before_push", 3), ("island-1", "after_adopt", 3), False),
        (Pause("island-1", "before_push", 3, or_later=True), ("island-1", "before_push", 5), True),
        (Pause("island-1", "before_push", 3, or_later=True), ("island-1", "before_push", 2), False),
    ],
)
def test_which_points_stop(pause: Pause, reached: tuple[str, str, int], stops: bool) -> None:
    assert pause.matches(*reached) is stops


@pytest.fixture
def armed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pauses]:
    """This process armed with two pauses (its environment is read once: the cache is cleared around the test)."""
    monkeypatch.setenv("DILOCO_PAUSE_AT", "island-1:before_push:3,coordinator:after_commit:2+")
    monkeypatch.setenv("DILOCO_PAUSE_DIR", str(tmp_path / "pauses"))
    faults.armed.cache_clear()
    yield Pauses(tmp_path / "pauses")
    faults.armed.cache_clear()


def _reach(who: str, point: str, round_: int) -> threading.Thread:
    thread = threading.Thread(target=faults.at, args=(who, point, round_), daemon=True)
    thread.start()
    return thread


def test_a_thread_stops_at_its_point_until_released_and_only_once(
    armed: Pauses, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked: list[float] = []  # each time the stopped thread looked for its release and went back to waiting
    monkeypatch.setattr(faults, "time", SimpleNamespace(sleep=lambda s: (looked.append(s), time.sleep(s))))
    faults.at("island-1", "before_push", 2)  # not its round: returns at once
    faults.at("island-0", "before_push", 3)  # not its process
    assert armed.reached("island-1:before_push:3") is None and not looked
    stopped = _reach("island-1", "before_push", 3)
    marker = wait_until(lambda: armed.reached("island-1:before_push:3"), "island-1:before_push:3", WAIT_S)
    assert marker == {"round": 3, "pid": os.getpid()}
    seen = len(looked)
    wait_until(lambda: len(looked) >= seen + 3, "the stopped thread to look for its release again", WAIT_S)
    assert stopped.is_alive()  # it found none, and waits for the test, however long the test takes
    armed.release("island-1:before_push:3")
    stopped.join(WAIT_S)
    assert not stopped.is_alive()
    faults.at("island-1", "before_push", 3)  # fired once: a restart with the same environment passes


def test_or_later_stops_at_the_first_round_reached_from_there(armed: Pauses) -> None:
    faults.at("coordinator", "after_commit", 1)
    stopped = _reach("coordinator", "after_commit", 4)
    assert (
        wait_until(lambda: armed.reached("coordinator:after_commit:2+"), "coordinator:after_commit:2+", WAIT_S)["round"]
        == 4
    )
    armed.release("coordinator:after_commit:2+")
    stopped.join(WAIT_S)
    assert not stopped.is_alive()


def test_a_release_before_the_point_lets_it_pass(armed: Pauses) -> None:
    armed.release("island-1:before_push:3")
    faults.at("island-1", "before_push", 3)
    assert armed.reached("island-1:before_push:3") is not None


def test_without_a_spec_a_point_costs_a_cached_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DILOCO_PAUSE_AT", raising=False)
    faults.armed.cache_clear()
    try:
        faults.at("island-1", "before_push", 3)
        assert faults.armed() == ((), None) and faults.armed.cache_info().hits >= 1
    finally:
        faults.armed.cache_clear()


def test_the_cli_refuses_a_malformed_spec_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_PAUSE_AT", "island-1:befor_push:3")
    faults.armed.cache_clear()
    try:
        fails(capsys, ["status", "127.0.0.1:1"], "DILOCO_PAUSE_AT: 'island-1:befor_push:3': island-1's points are")
    finally:
        faults.armed.cache_clear()
