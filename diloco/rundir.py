"""The run directory (README.md, "Reading a run directory"): config.toml, metrics.jsonl, summary.json, checkpoints/.

metrics.jsonl holds one JSON object per line with at least `event` and `t` (seconds since the run started,
continued across resumes). A run directory belongs to one run: opening it with a different config is refused
with the differing keys named, so two runs never mix their metrics or checkpoints.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco.config import RunConfig, diff_keys, dump_toml, from_dict, to_dict
from transport.errors import UserError


class RunDirError(UserError, ValueError):
    """The run directory is unusable (another run's, unreadable, not a directory)."""


class RunDir:
    def __init__(self, path: Path, cfg: RunConfig) -> None:
        self.path = path
        self.config_path = path / "config.toml"
        self.metrics_path = path / "metrics.jsonl"
        self.summary_path = path / "summary.json"
        self.checkpoints = path / "checkpoints"
        if path.exists() and not path.is_dir():
            raise RunDirError(f"run dir '{path}' exists and is not a directory")
        self.resuming = self.config_path.exists()
        if self.resuming:
            self._check_same_run(cfg)
        else:
            path.mkdir(parents=True, exist_ok=True)
            self.config_path.write_text(dump_toml(to_dict(cfg)))
        self.checkpoints.mkdir(exist_ok=True)
        self._t_offset = self._last_t()
        self._t0 = time.monotonic()
        self._metrics = self.metrics_path.open("a", buffering=1)

    def _check_same_run(self, cfg: RunConfig) -> None:
        import tomllib

        try:
            stored = tomllib.loads(self.config_path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise RunDirError(f"run dir '{self.path}': config.toml is unreadable ({exc})") from None
        try:
            # Through the loader, so that keys a newer diloco added (absent from an older config.toml) take their
            # defaults instead of counting as differences: upgrading diloco does not orphan a run directory.
            stored = to_dict(from_dict(RunConfig, stored))
        except ValueError as exc:
            raise RunDirError(f"run dir '{self.path}': its config.toml no longer loads ({exc})") from None
        differing = diff_keys(stored, to_dict(cfg))
        if differing:
            raise RunDirError(
                f"run dir '{self.path}' holds another run (config differs in: {', '.join(differing[:8])}); "
                "use a new --run-dir"
            )

    def _last_t(self) -> float:
        last = 0.0
        for record in read_events(self.metrics_path):
            try:
                last = max(last, float(record.get("t", 0.0)))
            except (TypeError, ValueError):
                continue
        return last

    def elapsed(self) -> float:
        return self._t_offset + time.monotonic() - self._t0

    def log(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": round(self.elapsed(), 4), **fields}
        self._metrics.write(json.dumps(record) + "\n")

    def log_inner(self, round: int, island: str, first_step: int, losses: Sequence[float], every: int) -> None:
        """One `inner` event every `every` steps of a round's inner losses (steps are counted from 1)."""
        for i in range(every - 1, len(losses), every):
            self.log("inner", round=round, island=island, step=first_step + i + 1, loss=float(losses[i]))

    def truncate_after_round(self, completed_rounds: int) -> None:
        """On resume, drop events of rounds that the restored checkpoint does not contain (they will rerun)."""
        self._metrics.close()
        kept = [json.dumps(r) for r in read_events(self.metrics_path) if r.get("round", -1) < completed_rounds]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.metrics_path)
        self._metrics = self.metrics_path.open("a", buffering=1)

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.summary_path)

    def close(self) -> None:
        self._metrics.close()


def read_events(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a metrics.jsonl file (only the `event` ones when given), in order.

    Tolerant, because it also reads files that a live or SIGKILLed process is writing: a missing file is no events
    yet, and a line torn mid-write (or anything that is not a JSON object) is skipped.
    """
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and (event is None or record.get("event") == event):
            out.append(record)
    return out
