"""A live progress line on the terminal: round, loss, tokens/s, ETA (rich; log lines when not a TTY)."""

from __future__ import annotations

import logging
import sys
import time

from rich.console import Console
from rich.live import Live
from rich.text import Text

log = logging.getLogger("diloco.ops.progress")


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total_rounds: int, label: str, enabled: bool = True) -> None:
        self.total = total_rounds
        self.label = label
        self.enabled = enabled
        self._t0 = time.monotonic()
        self._start_round: int | None = None
        self._console = Console(file=sys.stderr)
        self._live: Live | None = None
        if enabled and self._console.is_terminal:
            self._live = Live(Text(f"{label}: starting"), console=self._console, refresh_per_second=4)
            self._live.start()

    def update(self, round_done: int, loss: float, eval_loss: float | None, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self._start_round is None:
            self._start_round, self._t0 = round_done - 1, time.monotonic() - 1e-9
        done_here = round_done - self._start_round
        per_round = (time.monotonic() - self._t0) / max(done_here, 1)
        eta = per_round * (self.total - round_done)
        ev = f" eval {eval_loss:.4f}" if eval_loss is not None else ""
        line = (
            f"{self.label}: round {round_done}/{self.total} loss {loss:.4f}{ev} "
            f"{tokens_per_s:,.0f} tok/s ETA {format_eta(eta)}"
        )
        if self._live is not None:
            self._live.update(Text(line))
        else:  # a log line, so that --log-format json makes it JSON (diloco/ops/logs.py)
            log.info("%s", line, extra={"fields": {"round": round_done, "loss": loss, "eval_loss": eval_loss}})

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
