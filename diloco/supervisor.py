"""The island's supervisor: run the island worker as a child process and restart it when it crashes.

A crash (a non-zero exit that is not a user error, or death by a signal the supervisor did not send) restarts the
worker after a backoff; the new worker resumes from the island's own checkpoint and rejoins the current round. A
worker restarted on fewer devices (a device lost) builds its mesh on the devices it sees and keeps the island's batch
by gradient accumulation. Exit code 2 (a user mistake, a diverged island) is never retried: it would only fail
again.

A worker that dies is noticed at once (the supervisor is its parent): before the backoff, `on_death` tells the
coordinator that this island is gone (`diloco island` sends a Leave with the island's own credentials), so the
others' round closes now instead of when the dead worker's lease runs out (quorum.lease_s). Only the lease covers
a host that dies with its supervisor, or a partition.

The worker, not the supervisor, holds the run directory's lock (diloco/rundir.py): a dead worker's lock is gone
with it, so its restart takes the directory at once. Before each start the supervisor checks that no one else
holds it (an island started twice on one --run-dir), so that it refuses with one line naming the holder instead
of spawning a worker that would be refused, and without overwriting the holder's worker.pid.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from diloco.rundir import check_free

log = logging.getLogger("diloco.supervisor")


USER_ERROR = 2


def supervise(
    worker_argv: Sequence[str],
    run_dir: Path,
    max_restarts: int = 5,
    backoff_s: float = 1.0,
    on_death: Callable[[str], None] | None = None,
) -> int:
    restarts = 0
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    run_dir.mkdir(parents=True, exist_ok=True)
    while True:
        check_free(run_dir)
        child = subprocess.Popen([sys.executable, "-m", "diloco.cli", *worker_argv])
        (run_dir / "worker.pid").write_text(str(child.pid))
        code = child.wait()
        why = f"signal {-code}" if code < 0 else f"exit code {code}"
        if on_death is not None and not stopping and code not in (0, USER_ERROR):  # a user error left by itself
            on_death(f"worker died ({why})")
        if stopping or code in (0, USER_ERROR) or restarts >= max_restarts:
            return code if code >= 0 else 128 - code
        restarts += 1
        log.warning("island worker died (%s); restart %d/%d", why, restarts, max_restarts)
        time.sleep(backoff_s * restarts)
