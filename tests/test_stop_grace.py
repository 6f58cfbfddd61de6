"""diloco/worker/stop_grace.py: a process asked to stop ends within its grace wherever its main thread is, with its
last line saying why, and a stop that cannot even write that line still ends the process (faulthandler)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = """
import ctypes, sys, threading, time
from diloco.worker.stop_grace import StopGrace

requested = []
held = threading.Lock()

def forced(name):
    if sys.argv[1] == "forced-blocks":
        held.acquire()
        held.acquire()  # never returns: the backstop must end the process
    print(f"forced after {name}", flush=True)

StopGrace(0.5, requested.append, forced)
if sys.argv[1] == "sync-point":
    print("ready", flush=True)
    while not requested:  # the main loop reaching its sync points
        time.sleep(0.01)
    print(f"stopped at a sync point: {requested[0]}", flush=True)
    sys.exit(0)
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # a glibc pthread_mutex_t (40 bytes), zeros: PTHREAD_MUTEX_INITIALIZER
assert libc.pthread_mutex_lock(mutex) == 0
print("ready", flush=True)
# The main thread blocked inside a C call that a signal does not end (a normal mutex locked twice): no Python signal
# handler runs while it lasts.
libc.pthread_mutex_lock(mutex)
print("the main thread ran on", flush=True)
"""


def stop(case: str, sig: int = signal.SIGTERM) -> subprocess.CompletedProcess[str]:
    """Start the child in `case`, wait for its "ready" line, send `sig`, and wait for it to end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, case], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=50)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "ready\n" + out, err)


def test_a_main_loop_at_its_sync_points_stops_there() -> None:
    done = stop("sync-point")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "stopped at a sync point: SIGTERM"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_main_thread_stuck_in_c_is_ended_after_the_grace_with_its_line(sig: int) -> None:
    """A grace timer started by the Python handler would never start here: the handler waits for the main thread."""
    done = stop("stuck", sig)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"forced after {signal.Signals(sig).name}"


def test_a_forced_stop_that_cannot_finish_dumps_every_stack_and_exits() -> None:
    done = stop("forced-blocks")
    assert done.returncode == 1
    assert "forced after" not in done.stdout
    assert "Timeout (0:00:05)!" in done.stderr
    assert "in forced" in done.stderr  # the stuck thread's frame, so the log says where it hung


class Worker:
    """What an island's worker does with a stop (diloco/worker/island_worker.py, `IslandWorker`): a note of it."""

    def __init__(self) -> None:
        self.requested: list[str] = []
        self.forced: list[str] = []

    def request_stop(self, reason: str) -> None:
        self.requested.append(reason)

    def forced_stop(self, reason: str) -> None:
        self.forced.append(reason)


def test_a_stop_while_the_island_starts_reaches_its_worker(capsys: pytest.CaptureFixture[str]) -> None:
    """A SIGTERM before the worker exists (the model compiling, the checkpoint restoring) is kept and handed to the
    worker, which stops at its first sync point; a grace that ends first ends the process with the island's line."""
    from diloco.worker.island_worker import StartingStop

    early = StartingStop("us-east")
    early.request("SIGTERM")
    worker = Worker()
    early.attach(worker)  # type: ignore[arg-type]
    assert worker.requested == ["SIGTERM"]
    early.forced("SIGTERM")
    assert worker.forced == ["SIGTERM"] and capsys.readouterr().out == ""
    never = StartingStop("eu-west")
    never.request("SIGINT")
    never.forced("SIGINT")
    (line,) = capsys.readouterr().out.splitlines()
    assert '"island": "eu-west"' in line and "SIGINT (forced after 10 s: while starting)" in line


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_stop_while_the_coordinator_starts_stops_it_once_started(federation) -> None:
    """A SIGTERM while the coordinator restores (held at before_restore) is kept: once started it stops at once, with
    its `stopped` record and exit code 0, never the signal's default death (-15)."""
    from tests.conftest import WAIT_S

    fed = federation(pause_at=["coordinator:before_restore:0"])
    argv = ["coordinator", fed.config, "--listen", "127.0.0.1:0", "--run-dir", str(fed.run_dir), "--quiet"]
    fed.spawn("coordinator", [*argv, *fed.overrides])  # its address comes after the restore: not waited for
    fed.paused("coordinator:before_restore:0", WAIT_S)
    fed.signal("coordinator", signal.SIGTERM)
    fed.release("coordinator:before_restore:0")
    fed.wait_exit(WAIT_S)
    assert [(e["event"], e["reason"]) for e in fed.events("stopped")] == [("stopped", "SIGTERM")]
    assert not (fed.run_dir / "summary.json").exists()  # stopped, not done
