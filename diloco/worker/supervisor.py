"""The island's supervisor: run the island worker as a child process and restart it when it crashes.

A crash (a non-zero exit that is not a user error, or death by a signal the supervisor did not send) restarts the
worker after a backoff; the new worker resumes from the island's own checkpoint and rejoins the current round. A
worker restarted on fewer devices (a device lost) builds its mesh on the devices it sees and keeps the island's batch
by gradient accumulation. Exit code 2 (a user mistake, a diverged island) is never retried: it would only fail
again. A stop (SIGTERM, Ctrl+C) reaches every worker, also one that starts as it comes, and a stop during the
backoff ends the supervisor there: no worker starts after it.

A worker that dies is noticed at once (the supervisor is its parent): before the backoff, `on_death` tells the
coordinator that this island is gone (`diloco island` sends a Leave with the island's own credentials), so the
others' round closes now instead of when the dead worker's lease runs out (quorum.lease_s). Only the lease covers
a host that dies with its supervisor, or a partition.

A worker outlives no supervisor: the supervisor names itself in the worker's environment (SUPERVISOR_PID_ENV), and
the worker's `follow_supervisor` watches its parent; when the supervisor is gone (SIGKILLed with its host's
session, say), the worker stops as on SIGTERM, at its next sync point, instead of training on as an orphan that
holds the run directory's lock and would race the island's next supervisor.

The worker, not the supervisor, holds the run directory's lock (diloco/run/rundir.py): a dead worker's lock is gone
with it, so its restart takes the directory at once. Before each start the supervisor checks that no one else
holds it (an island started twice on one --run-dir), so that it refuses with one line naming the holder instead
of spawning a worker that would be refused, and without overwriting the holder's worker.pid.

A multi-process island on one host (islands.processes = N, diloco/worker/island_group.py) is supervised as a group: its
N workers start together (process I's pid in RUN_DIR/process-I.pid; worker.pid is process 0's), and when any of them
dies the others are SIGKILLed (they cannot go on without it: their collectives would hang or fail) and all N
restart together, after the same backoff, so the island re-forms and resumes from its checkpoint. The group ends
when process 0 ends (its followers follow it out: they are given FOLLOWERS_EXIT_S, then killed). On several hosts
each process of the island has a supervisor of its own, and the one whose worker led the island's newest formation
speaks for the island when that worker dies (`diloco island` wires `on_death` so).

A worker that exits with REGROUP ended on purpose so that its island re-forms on another set of processes (a lost
one is back: diloco/worker/island_formation.py): it is started again at once, and that is no crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diloco.run.rundir import LOCK_FILE, check_free

log = logging.getLogger("diloco.worker.supervisor")


USER_ERROR = 2
REGROUP = 75
"""The exit code of a worker that ends to re-form its island (a multi-process island whose lost process is back,
diloco/worker/island_formation.py): started again at once, not counted as a crash, no Leave sent for it (it left
by itself). 75 is sysexits' EX_TEMPFAIL: try again."""
FOLLOWERS_EXIT_S = 30.0
"""How long a group's other workers get to exit after its process 0 ended (they exit with it at once, normally)."""
POLL_S = 0.1
SUPERVISOR_PID_ENV = "DILOCO_SUPERVISOR_PID"
"""Set by the supervisor in each worker's environment: the pid the worker's parent must stay."""
ORPHAN_KILL_S = 120.0
"""A worker whose supervisor is gone stops cleanly (SIGTERM's path); if it has not exited after this long (a step or
a save that hangs), it is killed."""


@dataclass(frozen=True)
class Member:
    """One worker process: its `diloco` arguments, the environment it adds (its device count), its pid file."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    pid_file: str = "worker.pid"


def _start(members: Sequence[Member], run_dir: Path) -> list[subprocess.Popen[bytes]]:
    children = []
    for member in members:
        env = {**os.environ, **member.env, SUPERVISOR_PID_ENV: str(os.getpid())}
        children.append(subprocess.Popen([sys.executable, "-m", "diloco.cli", *member.argv], env=env))
        (run_dir / member.pid_file).write_text(str(children[-1].pid))
    return children


def _wait_group(children: list[subprocess.Popen[bytes]]) -> int:
    """The group's exit code: process 0's when it ends first with the others following, else the first failure's
    (a non-zero exit or a signal), the others then SIGKILLed."""
    if len(children) == 1:
        return children[0].wait()
    leader, deadline = children[0], None
    while True:
        failed = [c.returncode for c in children if c.poll() is not None and c.returncode != 0]
        if failed or all(c.returncode is not None for c in children):
            break
        if leader.returncode is not None and deadline is None:
            deadline = time.monotonic() + FOLLOWERS_EXIT_S
        if deadline is not None and time.monotonic() > deadline:
            log.warning("island processes did not exit with process 0; killing them")
            break
        time.sleep(POLL_S)
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            child.wait()
    if failed:
        return USER_ERROR if USER_ERROR in failed else failed[0]
    return leader.returncode


def supervise(
    worker_argv: Sequence[str] | Sequence[Member],
    run_dir: Path,
    max_restarts: int = 5,
    backoff_s: float = 1.0,
    on_death: Callable[[str], None] | None = None,
    lock_name: str = LOCK_FILE,
) -> int:
    """Run the worker (`diloco` arguments), or a group of workers (`Member`s, process 0 first), until done.
    `lock_name`: the run directory's lock the worker takes (a multi-process island's process I > 0 takes its own)."""
    given = list(worker_argv)
    group = given if given and isinstance(given[0], Member) else [Member([str(a) for a in given])]
    restarts = 0
    stopped_by: int | None = None
    """The signal that stops the island (SIGTERM, SIGINT): it reaches every worker, and no worker starts after it."""
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: object) -> None:
        nonlocal stopped_by
        stopped_by = signum
        _send(children, signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    run_dir.mkdir(parents=True, exist_ok=True)
    while True:
        check_free(run_dir, lock_name)
        children = _start(group, run_dir)
        if stopped_by is not None:  # it came while they started: forwarded to the workers before them
            _send(children, stopped_by)
        code = _wait_group(children)
        stopping = stopped_by is not None
        if code == REGROUP and not stopping:
            log.info("island worker ended to re-form its island; starting it again")
            continue
        why = f"signal {-code}" if code < 0 else f"exit code {code}"
        if on_death is not None and not stopping and code not in (0, USER_ERROR):  # a user error left by itself
            on_death(f"worker died ({why})")
        if stopped_by is not None or code in (0, USER_ERROR) or restarts >= max_restarts:  # a stop during on_death too
            return code if code >= 0 else 128 - code
        restarts += 1
        log.warning("island worker died (%s); restart %d/%d", why, restarts, max_restarts)
        backoff_ends = time.monotonic() + backoff_s * restarts
        while stopped_by is None and time.monotonic() < backoff_ends:  # a stop in the backoff restarts nothing
            time.sleep(POLL_S)
        if stopped_by is not None:
            log.info("island stopped (signal %d) before its worker's restart", stopped_by)
            return code if code >= 0 else 128 - code


def _send(children: Sequence[subprocess.Popen[bytes]], signum: int) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signum)


def follow_supervisor(poll_s: float = 0.5) -> threading.Thread | None:
    """In a supervised worker (SUPERVISOR_PID_ENV set): a daemon thread that stops this process as SIGTERM would
    once its parent is no longer the supervisor that started it (it died; the worker was re-parented), and kills
    it ORPHAN_KILL_S later if it is still alive. None when the worker runs unsupervised."""
    expected = os.environ.get(SUPERVISOR_PID_ENV, "")
    if not expected.isdigit():
        return None

    def watch() -> None:
        while os.getppid() == int(expected):
            time.sleep(poll_s)
        log.warning("the island's supervisor (pid %s) is gone; this worker stops", expected)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_KILL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="follow-supervisor", daemon=True)
    thread.start()
    return thread
