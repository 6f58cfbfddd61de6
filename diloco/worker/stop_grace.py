"""A stop by signal with a bound: SIGTERM or Ctrl+C asks the process to stop at its next sync point, and it exits
within a grace wherever it is (docs/architecture.md, "No silent hang").

    signal ──> Python handler ──> on_request(name)          the main loop sees it at its next sync point
          └──> wakeup fd ──> watch thread: grace_s ──> on_forced(name), exit 0
                                          + BACKSTOP_S ──> every thread's stack on stderr, exit 1 (faulthandler)

A Python signal handler runs only when the main thread next runs Python: a main thread blocked inside a C call
never runs it, so a grace timer started by the handler would never start. The watch thread hears the signal from
the interpreter's C-level handler instead (`signal.set_wakeup_fd`), which writes the signal's number to a pipe
whatever the main thread is doing, and starts the grace itself. If `on_forced` cannot finish either (a lock held by a
stuck thread), faulthandler's own C thread, which needs no interpreter lock, dumps every thread's stack and exits.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
BACKSTOP_S = 5.0
"""How long `on_forced` may take before faulthandler ends the process (exit 1, every thread's stack on stderr)."""


class StopGrace:
    """Turns SIGTERM / SIGINT into a stop request (`on_request`, with the signal's name) and, `grace_s` after the
    first, ends the process (`on_forced`, then exit code 0: it was asked to stop) unless it has exited by then.
    Install it from the main thread; it lasts for the process's life."""

    def __init__(
        self, grace_s: float, on_request: Callable[[str], None], on_forced: Callable[[str], None] | None = None
    ) -> None:
        self.grace_s = grace_s
        self._on_request, self._on_forced = on_request, on_forced
        self._read, write = os.pipe()
        os.set_blocking(write, False)  # the interpreter's C handler must never block on it
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for s in SIGNALS:
            signal.signal(s, self._handle)
        threading.Thread(target=self._watch, name="stop-grace", daemon=True).start()

    def _handle(self, signum: int, frame: object) -> None:
        self._on_request(signal.Signals(signum).name)

    def _watch(self) -> None:
        """Wait for the first stop signal on the wakeup pipe, then give the process its grace."""
        while True:
            numbers = os.read(self._read, 64)
            stops = [n for n in numbers if n in SIGNALS]
            if stops:
                break
        name = signal.Signals(stops[0]).name
        self._on_request(name)  # the main thread may never run the Python handler
        threading.Event().wait(self.grace_s)
        faulthandler.dump_traceback_later(BACKSTOP_S, exit=True)
        if self._on_forced is not None:
            self._on_forced(name)
        os._exit(0)
