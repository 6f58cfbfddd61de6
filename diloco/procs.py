"""A federation (coordinator + island processes) driven from a test or a benchmark: start, watch, kill, restart.

`diloco launch` runs a whole federation and only returns at the end; fault tests and benchmarks need to act in
between: SIGKILL one island at a chosen round, start it again with the very same command line, and read each
process's metrics.jsonl while the run goes on. `Federation` does that with the same command lines `launch`
uses (`python -m diloco.cli coordinator|island ...`, the same child environment from `launch.child_env`), with
two differences: islands run `--no-supervise` (a SIGKILL must kill the island, not a supervisor that would
restart it behind our back), and an optional `wrap` prefixes every command, e.g. `Namespace.wrap` to run the
whole federation inside a kernel-shaped network namespace (diloco.netns).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from diloco.config import RunConfig, load_config
from diloco.launch import child_env

T = TypeVar("T")
Wrap = Callable[[list[str]], list[str]]


class FederationError(RuntimeError):
    """A process of the federation died or a wait timed out; the message carries the last lines of its log."""


def read_events(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The JSON objects of a metrics.jsonl (only `event` ones when given); a line torn mid-write is skipped."""
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


def tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:]) or "(empty log)"


class Federation:
    """Coordinator and islands of one run as child processes; a context manager that stops them all on exit."""

    def __init__(
        self,
        config: str | Path,
        overrides: Sequence[str],
        run_dir: Path,
        *,
        wrap: Wrap | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.config = str(config)
        self.overrides = list(overrides)
        self.cfg: RunConfig = load_config(self.config, self.overrides)
        self.run_dir = run_dir
        self.wrap = wrap or (lambda argv: argv)
        self.env = child_env(self.cfg, env or {})
        self.cwd = cwd
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.islands: dict[str, subprocess.Popen[bytes]] = {}
        self.address = ""
        run_dir.mkdir(parents=True, exist_ok=True)

    # -- paths and events --------------------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return self.cfg.islands.island_names

    def island_dir(self, name: str) -> Path:
        return self.run_dir / "islands" / name

    def log_path(self, name: str = "coordinator") -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def events(self, event: str | None = None, island: str | None = None) -> list[dict[str, Any]]:
        """Events of the coordinator's metrics.jsonl, or of `island`'s own."""
        where = self.run_dir if island is None else self.island_dir(island)
        return read_events(where / "metrics.jsonl", event)

    def rounds(self) -> list[dict[str, Any]]:
        """The coordinator's committed rounds (`round` events), in order."""
        return self.events("round")

    # -- processes ---------------------------------------------------------------------------------------------

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = self.log_path(log_name)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                self.wrap([sys.executable, "-m", "diloco.cli", *argv]),
                env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd,
            )  # fmt: skip

    def island_argv(self, name: str) -> list[str]:
        """The island's command line (after `python -m diloco.cli`): the same for its first start and restarts."""
        return [
            "island", self.config, "--name", name, "--coordinator", self.address,
            "--run-dir", str(self.island_dir(name)), "--no-supervise", *self.overrides,
        ]  # fmt: skip

    def start_coordinator(self, timeout_s: float = 180.0) -> str:
        """Start the coordinator on port 0 and return the address it wrote to RUN_DIR/coordinator.addr."""
        addr_file = self.run_dir / "coordinator.addr"
        addr_file.unlink(missing_ok=True)
        argv = ["coordinator", self.config, "--listen", "127.0.0.1:0", "--run-dir", str(self.run_dir), "--quiet"]
        self.coordinator = self._spawn([*argv, *self.overrides], "coordinator")
        self.address = self.wait_for(
            lambda: addr_file.read_text().strip() if addr_file.exists() else None, timeout_s, "coordinator address"
        )
        return self.address

    def start_island(self, name: str) -> subprocess.Popen[bytes]:
        if not self.address:
            raise FederationError("start the coordinator before the islands")
        if name in self.islands and self.islands[name].poll() is None:
            raise FederationError(f"island {name} is already running")
        self.islands[name] = self._spawn(self.island_argv(name), name)
        return self.islands[name]

    def start(self, timeout_s: float = 180.0) -> None:
        """Coordinator, then every island of the config."""
        self.start_coordinator(timeout_s)
        for name in self.names:
            self.start_island(name)

    def kill_island(self, name: str) -> None:
        """SIGKILL: no checkpoint flush, no leave; the coordinator only notices when its lease expires."""
        proc = self.islands[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def check_alive(self) -> None:
        """Raise if the coordinator, or an island that was not killed on purpose, exited with an error."""
        procs = {"coordinator": self.coordinator, **self.islands} if self.coordinator else dict(self.islands)
        for name, proc in procs.items():
            code = proc.poll() if proc is not None else None
            if code not in (None, 0, -signal.SIGKILL):
                raise FederationError(f"{name} exited with code {code}: {tail(self.log_path(name))}")

    def wait_for(self, probe: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
        """Poll `probe` until it returns something other than None; fail fast when a process crashed."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = probe()
            if value is not None:
                return value
            self.check_alive()
            if self.coordinator is not None and self.coordinator.poll() is not None:
                raise FederationError(f"coordinator exited while waiting for {what}: {tail(self.log_path())}")
            if time.monotonic() > deadline:
                raise FederationError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(poll_s)

    def wait_rounds(self, n: int, timeout_s: float) -> list[dict[str, Any]]:
        """Block until the coordinator has committed at least `n` rounds; returns the `round` events."""
        return self.wait_for(lambda: r if len(r := self.rounds()) >= n else None, timeout_s, f"{n} committed rounds")

    def wait_done(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the coordinator to finish and return its summary.json."""
        assert self.coordinator is not None
        summary = self.run_dir / "summary.json"

        def finished() -> dict[str, Any] | None:
            if self.coordinator is not None and self.coordinator.poll() is not None and summary.exists():
                return json.loads(summary.read_text())
            return None

        deadline = time.monotonic() + timeout_s
        while (result := finished()) is None:
            self.check_alive()
            if self.coordinator.poll() is not None and not summary.exists():
                raise FederationError(f"coordinator exited without a summary: {tail(self.log_path())}")
            if time.monotonic() > deadline:
                raise FederationError(f"run not finished after {timeout_s:.0f}s ({len(self.rounds())} rounds)")
            time.sleep(0.2)
        return result

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every live process (checkpoints flush), SIGKILL what is left after `grace_s`."""
        procs = [p for p in (self.coordinator, *self.islands.values()) if p is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Federation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
