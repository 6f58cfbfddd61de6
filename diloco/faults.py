"""Fault injection at named points: a process stops where a test says, and waits there until the test acts.

A test names the points in the environment of the processes it starts (`DILOCO_PAUSE_AT`), as torchft's
`FailureInjector.fail_at(rank, step)` names a rank and a step:

    DILOCO_PAUSE_AT=island-1:before_push:3,coordinator:after_commit:2
    DILOCO_PAUSE_DIR=/run/dir/pauses

Each entry is WHO:POINT:ROUND. WHO is `coordinator` or an island's name; ROUND is a round, or ROUND+ for the first
time the process reaches the point at that round or a later one (an island that restarts may resync past a round).
The points, each a one-line `at(...)` call in the product code:

  island       before_lease   it holds θ_r and is about to lease round r's chunks (data.sampling = "chunks"): it
                              has read nothing of round r, and the ledger has handed it nothing for it
               before_push    it trained round r and has not taken its Δ yet: nothing of round r has left it
               after_adopt    it adopted the commit that gives it θ_r (its pull is done, the local θ merged, the
                              save of round r's checkpoint started), before it trains round r
  coordinator  before_restore it listens (health NOT_SERVING) and is about to build its state and restore its
                              checkpoint (round: 0, the round is what the restore finds)
               before_commit  round r's pushes are in and it is about to commit them, holding the round's lock:
                              nothing of round r is committed, and nothing else moves in the coordinator
               after_commit   round r is committed and served (θ_{r+1}), its evaluation and checkpoint not begun
                              (the settle thread stops; rounds go on)

At a point the thread that reached it writes a marker, DIR/WHO@POINT@ROUND.paused (atomically: a JSON object with
the round reached and the process's pid), and waits until DIR/WHO@POINT@ROUND.go exists. The test waits for the
marker (`Pauses.reached`), then SIGKILLs the process (the kill lands exactly there) or lets it go on
(`Pauses.release`). Each entry fires once per directory: a process restarted with the same environment passes a
point whose marker exists. Only the thread at the point waits; the process's other threads (heartbeats, presence,
checkpoint saves, the gRPC server) go on.

No entry: `at` returns at once (the environment is read once per process). JAX-free and gRPC-free: the CLI checks
the environment before any command starts (`armed`), so a malformed entry is one line naming it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_AT = "DILOCO_PAUSE_AT"
ENV_DIR = "DILOCO_PAUSE_DIR"
COORDINATOR = "coordinator"
ISLAND_POINTS = ("before_lease", "before_push", "after_adopt")
COMMIT_POINTS = ("before_commit", "after_commit")
"""The coordinator's points in a round (a kill there lands at a commit); `before_restore` is at its start."""
COORDINATOR_POINTS = ("before_restore", *COMMIT_POINTS)
POLL_S = 0.01
"""How often a paused thread looks for its release: the test waits on it, nobody else does."""


class FaultSpecError(ValueError):
    """A malformed DILOCO_PAUSE_AT or a missing DILOCO_PAUSE_DIR; the message is one line naming it."""


@dataclass(frozen=True)
class Pause:
    """One entry of DILOCO_PAUSE_AT: `who` stops at `point` of round `round` (or later, with `or_later`)."""

    who: str
    point: str
    round: int
    or_later: bool = False

    @property
    def key(self) -> str:
        """The stem of its files in the pause directory."""
        return f"{self.who}@{self.point}@{self.round}{'+' if self.or_later else ''}"

    def matches(self, who: str, point: str, round_: int) -> bool:
        at_round = round_ >= self.round if self.or_later else round_ == self.round
        return (who, point) == (self.who, self.point) and at_round


def parse(spec: str) -> tuple[Pause, ...]:
    """DILOCO_PAUSE_AT's entries (comma-separated WHO:POINT:ROUND[+]); an empty spec is none."""
    pauses = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) != 3 or not all(parts):
            raise FaultSpecError(f"{ENV_AT}: {entry!r} is not WHO:POINT:ROUND")
        who, point, round_text = parts
        points = COORDINATOR_POINTS if who == COORDINATOR else ISLAND_POINTS
        if point not in points:
            raise FaultSpecError(f"{ENV_AT}: {entry!r}: {who}'s points are {', '.join(points)}")
        digits = round_text.removesuffix("+")
        if not (digits.isascii() and digits.isdigit()):
            raise FaultSpecError(f"{ENV_AT}: {entry!r}: the round must be a number >= 0, with + for 'or later'")
        pause = Pause(who, point, int(digits), round_text.endswith("+"))
        if pause in pauses:
            raise FaultSpecError(f"{ENV_AT}: {entry!r} is named twice")
        pauses.append(pause)
    return tuple(pauses)


def from_env(env: Mapping[str, str]) -> tuple[tuple[Pause, ...], Path | None]:
    """The pauses and the directory an environment names; a pause without a directory is an error."""
    pauses = parse(env.get(ENV_AT, ""))
    directory = env.get(ENV_DIR, "")
    if pauses and not directory:
        raise FaultSpecError(f"{ENV_AT} is set but {ENV_DIR} (where the pause markers go) is not")
    return pauses, Path(directory) if directory else None


@functools.cache
def armed() -> tuple[tuple[Pause, ...], Path | None]:
    """This process's pauses, read from its environment once."""
    return from_env(os.environ)


def at(who: str, point: str, round_: int) -> None:
    """The hook at a named point: stop here if this process's environment names the point, else return at once."""
    pauses, directory = armed()
    if not pauses:
        return
    for pause in pauses:
        if pause.matches(who, point, round_):
            assert directory is not None  # from_env refuses pauses without one
            _stop(directory, pause, round_)


def _stop(directory: Path, pause: Pause, round_: int) -> None:
    marker = directory / f"{pause.key}.paused"
    if marker.exists():
        return  # fired already, in this process or in an earlier one with the same environment
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{pause.key}.{os.getpid()}"
    partial.write_text(json.dumps({"round": round_, "pid": os.getpid()}))
    os.replace(partial, marker)  # the marker appears whole: the test may read it as soon as it exists
    release = directory / f"{pause.key}.go"
    while not release.exists():
        time.sleep(POLL_S)


class Pauses:
    """The test's side of a pause directory: wait for a marker, then kill the process or release it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def reached(self, entry: str) -> dict[str, Any] | None:
        """The marker of `entry` (WHO:POINT:ROUND[+]), {"round": reached, "pid": ...}, once its process stopped
        there; else None."""
        (pause,) = parse(entry)
        try:
            return dict(json.loads((self.directory / f"{pause.key}.paused").read_text()))
        except FileNotFoundError:
            return None

    def release(self, entry: str) -> None:
        """Let the process stopped at `entry` go on (before it gets there: it writes its marker and goes on)."""
        (pause,) = parse(entry)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{pause.key}.go").touch()
