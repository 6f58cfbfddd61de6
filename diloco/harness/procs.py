"""A federation (coordinator + island processes) as child processes: start, watch, kill, restart, stop.

The one harness for everything that runs a federation of real processes: `diloco launch` (start it, show its
progress, stop it on Ctrl+C), the fault tests and the fault benchmarks (SIGKILL one island at a chosen round, start
it again with the very same command line, read each process's metrics.jsonl while the run goes on). Every process
is `python -m diloco.cli coordinator|island ...`, the command a user types, logging to RUN_DIR/logs/NAME.log; the
coordinator's run dir is RUN_DIR, island NAME's is RUN_DIR/islands/NAME.

Options, for the callers that need them: `supervise` runs islands under their supervisor (launch; a test's
supervised island), else `--no-supervise` so that a SIGKILL kills the island and not a supervisor that restarts it
behind our back; `wrap` prefixes every command (`Namespace.wrap`: the whole federation inside a kernel-shaped
network namespace, diloco/harness/netns.py); `jax_cache` shares one persistent XLA compilation cache so restarted
processes load their compiled steps instead of compiling again; `new_session` puts each child in its own process group
so that a final SIGKILL also reaches what it started (a supervisor's worker); `hide_env` names variables of this
process that no child may inherit (launch: secrets, so that each process gets only its own). Per process,
`start_coordinator` and `start_island` take extra arguments (`--secret`, `--tls-*`) and environment (a secret,
`devices_env(1)`: a restart on fewer devices); a coordinator restarted after a kill listens on the address it
had, so its islands find it again. `pause_at` names the points where processes stop and wait (diloco/faults.py,
WHO:POINT:ROUND): a test waits for one (`paused`), then SIGKILLs the process there or lets it go on (`release`).
An island of several processes (islands.processes, or `group_args` for one island) runs as one supervised group on
a port of its own for jax.distributed (diloco/worker/island_group.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from diloco import faults
from diloco.config import RunConfig, load_config
from diloco.faults import Pauses
from diloco.run.rundir import read_events

T = TypeVar("T")
Wrap = Callable[[list[str]], list[str]]
COORDINATOR = "coordinator"
STACK_HEADER = "(most recent call first)"
"""What faulthandler writes above each thread's stack (`Federation.dump_stacks`)."""
STACKS_S = 20.0
"""How long `Federation.dump_stacks` waits for the stacks it asked for."""
STACK_LINES = 80
"""Lines of each log a failure shows once the stacks are in it."""


def as_text(line: str) -> str:
    """A log line as --log-format text would print it (diloco/ops/logs.py): a JSON record of diloco's becomes
    "diloco: LEVEL: msg" (or its msg alone at info); any other line is returned as it is."""
    if not line.startswith("{"):
        return line
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict) or not isinstance(record.get("msg"), str):
        return line
    level = record.get("level")
    return record["msg"] if level == "info" else f"diloco: {level}: {record['msg']}"


class FederationError(RuntimeError):
    """A process of the federation died or a wait timed out; `process` names the process that died, if one did."""

    def __init__(self, message: str, process: str | None = None) -> None:
        super().__init__(message)
        self.process = process


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def devices_env(devices: int, xla_flags: str | None = None) -> dict[str, str]:
    """The environment that gives a child JAX process `devices` CPU devices (read once, when JAX starts).

    The user's own XLA flags (`xla_flags`, default: this process's XLA_FLAGS) are kept, less any device count:
    replacing them all would silently drop, say, a thread limit set in the launching shell.
    """
    given = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    kept = [flag for flag in given.split() if not flag.startswith(DEVICE_COUNT_FLAG)]
    return {"XLA_FLAGS": " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])}


MALLOC_ARENAS = "2"
"""glibc's malloc arenas in each child (MALLOC_ARENA_MAX) unless the environment sets them. By default every thread
that allocates may get an arena of its own (up to 8 per core), and what one frees is not reused by another: the
coordinator's commit, which runs on whichever gRPC thread took the round's last push, left its resident memory a
commit higher each time a new thread ran it. With 2 arenas a 10-layer launch's coordinator peaked at 4,783 MiB, not
5,777, and its islands at 3,880-4,034, not 4,089-4,226 (BENCHMARKS.md, "Bigger on one host")."""


MMAP_THRESHOLD = str(1 << 20)
"""glibc's mmap threshold in each child (MALLOC_MMAP_THRESHOLD_) unless the environment sets it: every allocation of
1 MiB or more (θ's tensors, their copies, a step's temporaries, a checkpoint's buffers) is its own mapping, handed back
to the system when freed. With glibc's default (a threshold that grows to 32 MiB as such blocks are freed) a freed
block stays in the process's heap: each process's resident memory stays at its high water, and the processes of one
host, which peak at different times (the islands at their checkpoints, the coordinator at a sync), hold their peaks
together. With it the 30-layer SmolLM2-135M shape runs under `launch` on a 24 GiB host, which it did not without; it
costs some speed (BENCHMARKS.md, "Bigger on one host"). `diloco island` and `diloco coordinator` started on hosts of
their own keep glibc's default."""


def child_env(cfg: RunConfig, extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment, islands.devices CPU devices, CPU JAX unless chosen otherwise, glibc's arenas
    bounded (`MALLOC_ARENAS`) and its freed large blocks given back (`MMAP_THRESHOLD`) unless chosen otherwise, then
    `extra`."""
    env = {**os.environ, **devices_env(cfg.islands.devices)}
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
    env.update(extra)
    return env


def compilation_cache_env(directory: Path) -> dict[str, str]:
    """The environment that makes a child JAX process share `directory` as its persistent compilation cache, every
    program kept however quick its compilation or small its executable: a process that compiles what another did
    loads the executable instead (the same executable the compiler would produce)."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(directory),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the kernel's pick; another process may take it before it is used)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def log_lines(path: Path) -> list[str]:
    try:
        return [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return []


class WaitTimeout(TimeoutError):
    """A `wait_until` ran past its bound; the message names what it waited for."""


def wait_until(
    condition: Callable[[], T | None],
    what: str,
    timeout: float,
    poll_s: float = 0.02,
    check: Callable[[], None] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy, and return that. `check` runs between polls and raises
    to end the wait early (a process that died). After `timeout` seconds, `WaitTimeout` naming `what`: the bound is
    for a system that hangs, never the measure of one that is merely slow, so it is generous. The one polling loop
    of the harness and the tests: a test waits for a condition or a named point (`Federation.paused`), never for a
    time."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll_s)


def tail(path: Path, n: int = 3) -> str:
    return " | ".join(log_lines(path)[-n:]) or "(empty log)"


class Federation:
    """Coordinator and islands of one run as child processes; a context manager that stops them all on exit."""

    def __init__(
        self,
        config: str | Path,
        overrides: Sequence[str],
        run_dir: Path,
        *,
        wrap: Wrap | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        supervise: bool = False,
        quiet: bool = True,
        jax_cache: Path | None = None,
        new_session: bool = True,
        hide_env: Collection[str] = (),
        pause_at: Sequence[str] = (),
    ) -> None:
        self.config = str(config)
        self.overrides = list(overrides)
        self.cfg: RunConfig = load_config(self.config, self.overrides)
        self.run_dir = run_dir
        self.wrap = wrap or (lambda argv: argv)
        extra = dict(env or {})
        if jax_cache is not None:
            extra |= compilation_cache_env(jax_cache)
        self.pauses = Pauses(Path(extra.get(faults.ENV_DIR) or os.environ.get(faults.ENV_DIR) or run_dir / "pauses"))
        """Where its processes stop at the named points of `pause_at` (diloco/faults.py): wait for one with
        `paused`, then kill the process or `release` it."""
        extra[faults.ENV_DIR] = str(self.pauses.directory)
        if pause_at:
            faults.parse(",".join(pause_at))  # a malformed entry fails here, in the test, not in every child
            extra[faults.ENV_AT] = ",".join(pause_at)
        self.env = {k: v for k, v in child_env(self.cfg, extra).items() if k not in hide_env or k in extra}
        self.cwd = cwd
        self.supervise = supervise
        self.quiet = quiet
        self.new_session = new_session
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.islands: dict[str, subprocess.Popen[bytes]] = {}
        self.others: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()  # processes SIGKILLed on purpose: their exit is no failure
        self.island_ports: dict[str, int] = {}
        """Each multi-process island's jax.distributed port: chosen once, the same for its restarts."""
        self.address = ""
        run_dir.mkdir(parents=True, exist_ok=True)

    # -- paths, events, logs -----------------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return self.cfg.islands.island_names

    def island_dir(self, name: str) -> Path:
        return self.run_dir / "islands" / name

    def log_path(self, name: str = COORDINATOR) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def events(self, event: str | None = None, island: str | None = None) -> list[dict[str, Any]]:
        """Events of the coordinator's metrics.jsonl, or of `island`'s own."""
        where = self.run_dir if island is None else self.island_dir(island)
        return read_events(where / "metrics.jsonl", event)

    def rounds(self) -> list[dict[str, Any]]:
        """The coordinator's committed rounds (`round` events), in order."""
        return self.events("round")

    def last_line(self, name: str = COORDINATOR) -> str:
        """The last `diloco: error:` line of a process's log (the CLI's one-line user error; with --log-format json
        the message of its last error record), else its last line."""
        lines = [as_text(ln) for ln in log_lines(self.log_path(name))]
        errors = [ln for ln in lines if ln.startswith("diloco: error:")]
        return (errors or lines or [""])[-1]

    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """The latest process of each name (a restart replaces the one before)."""
        first = {COORDINATOR: self.coordinator} if self.coordinator is not None else {}
        return {**first, **self.islands, **self.others}

    def logs(self, n: int = 12) -> str:
        """The last `n` lines of every log with its process's exit code: the context for a failure message."""
        return "\n".join(
            f"  {name}.log (rc {proc.poll()}):\n" + "\n".join(f"    {ln}" for ln in log_lines(self.log_path(name))[-n:])
            for name, proc in self.processes().items()
        )

    # -- processes ---------------------------------------------------------------------------------------------

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`python -m diloco.cli *argv` logging to logs/NAME.log (appended across restarts), environment + `env`."""
        log = self.log_path(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        self.killed.discard(name)
        with log.open("ab") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                self.wrap([sys.executable, "-m", "diloco.cli", *argv]),
                env={**self.env, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                start_new_session=self.new_session,
            )
        if name == COORDINATOR:
            self.coordinator = proc
        elif name in self.names:
            self.islands[name] = proc
        else:
            self.others[name] = proc
        return proc

    def island_argv(self, name: str, args: Sequence[str] = (), supervised: bool | None = None) -> list[str]:
        """The island's command line (after `python -m diloco.cli`): the same for its first start and restarts."""
        supervised = self.supervise if supervised is None else supervised
        processes = self.cfg.islands.processes
        group = self.group_args(name, processes) if processes > 1 and "--num-processes" not in args else []
        return [
            "island",
            self.config,
            "--name",
            name,
            "--coordinator",
            self.address,
            "--run-dir",
            str(self.island_dir(name)),
            *group,
            *args,
            *([] if supervised else ["--no-supervise"]),
            *self.overrides,
        ]

    def group_args(self, name: str, processes: int) -> list[str]:
        """`diloco island` flags that make island `name` a group of `processes` processes on this host, joined on
        a loopback port of its own (run them supervised: the supervisor starts the group)."""
        port = self.island_ports.setdefault(name, free_port())
        return ["--num-processes", str(processes), "--island-coordinator", f"127.0.0.1:{port}"]

    def start_coordinator(
        self, timeout_s: float = 180.0, env: Mapping[str, str] | None = None, args: Sequence[str] = ()
    ) -> str:
        """Start the coordinator and return the address it wrote to RUN_DIR/coordinator.addr: on port 0 the first
        time, on the address it had when restarted (its islands keep retrying that one). `args` are extra CLI
        arguments (`--tls-cert ...`), `env` extra environment (the islands' secrets)."""
        addr_file = self.run_dir / "coordinator.addr"
        addr_file.unlink(missing_ok=True)
        listen = self.address or "127.0.0.1:0"
        argv = ["coordinator", self.config, "--listen", listen, "--run-dir", str(self.run_dir), *args]
        self.spawn(COORDINATOR, [*argv, *(["--quiet"] if self.quiet else []), *self.overrides], env)
        self.address = self.wait_for(
            lambda: addr_file.read_text().strip() if addr_file.exists() else None, timeout_s, "coordinator address"
        )
        return self.address

    def start_island(
        self,
        name: str,
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        supervised: bool | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start (or restart) island `name`; `args` are extra CLI arguments (`--secret S`), `env` extra environment
        (`devices_env(1)`), `supervised` overrides the federation's `supervise` for this island."""
        if not self.address:
            raise FederationError("start the coordinator before the islands")
        if name in self.islands and self.islands[name].poll() is None:
            raise FederationError(f"island {name} is already running")
        return self.spawn(name, self.island_argv(name, args, supervised), env)

    def reconfigure(self, overrides: Sequence[str]) -> None:
        """Start the next processes with `overrides` instead (the run resumed with a change the resume table
        permits: another roster, another length); the processes running now keep the config they started with."""
        self.overrides = list(overrides)
        self.cfg = load_config(self.config, self.overrides)

    def start(
        self,
        timeout_s: float = 180.0,
        *,
        coordinator_env: Mapping[str, str] | None = None,
        island_env: Mapping[str, str] | None = None,
    ) -> None:
        """Coordinator, then every island of the config; `coordinator_env` and `island_env` are extra environment of
        each (islands on an accelerator with their share of its memory, the coordinator on the host's CPU)."""
        self.start_coordinator(timeout_s, env=coordinator_env)
        for name in self.names:
            self.start_island(name, env=island_env)

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to one process (SIGSTOP/SIGCONT: a hung island), if it still runs."""
        proc = self.processes()[name]
        if proc.poll() is None:
            proc.send_signal(sig)

    def kill(self, name: str = COORDINATOR, *, whole_group: bool = False) -> None:
        """SIGKILL: no handler runs, no checkpoint flush, no leave; sockets just vanish (peers notice by timeouts).
        With `whole_group` (and `new_session`), its process group too: a supervisor and its worker at once, as a
        host that dies takes both."""
        self.killed.add(name)
        proc = self.processes()[name]
        if whole_group and self.new_session:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            self.signal(name, signal.SIGKILL)
        proc.wait(timeout=30)

    def check_alive(self) -> None:
        """Raise if a process that was not killed on purpose exited with an error."""
        for name, proc in self.processes().items():
            code = proc.poll()
            if code not in (None, 0) and name not in self.killed:
                raise FederationError(
                    f"{name} exited with code {code}: {tail(self.log_path(name))}\n{self.logs()}", name
                )

    def wait_for(
        self,
        probe: Callable[[], T | None],
        timeout_s: float,
        what: str,
        poll_s: float = 0.05,
        *,
        coordinator_needed: bool = True,
    ) -> T:
        """`wait_until` `probe` returns something truthy, and return that; fail fast when a process crashed, or (with
        `coordinator_needed`) when the coordinator exited, which no longer-running wait can survive."""

        def check() -> None:
            self.check_alive()
            coordinator = self.coordinator
            if coordinator_needed and coordinator is not None and COORDINATOR not in self.killed:
                if coordinator.poll() is not None:
                    raise FederationError(
                        f"coordinator exited while waiting for {what}: {tail(self.log_path())}", COORDINATOR
                    )

        try:
            return wait_until(probe, what, timeout_s, poll_s, check)
        except WaitTimeout as exc:
            dumped = self.dump_stacks()
            raise FederationError(f"{exc}\n{self.logs(STACK_LINES if dumped else 12)}") from None

    def dump_stacks(self) -> bool:
        """Ask every live process for its threads' stacks (SIGUSR1: `diloco.cli.run`), written to its log: where each
        one waits when a wait of the test ran out. True once every one that was asked wrote them (bounded: a
        process still starting, before it listens for the signal, ends by it, which its exit code then says)."""
        asked = {}
        for name, proc in self.processes().items():
            if proc.poll() is None:
                asked[name] = self.log_path(name).stat().st_size if self.log_path(name).exists() else 0
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGUSR1)

        def written() -> bool:
            return all(
                self.processes()[name].poll() is not None or STACK_HEADER in self._log_since(name, offset)
                for name, offset in asked.items()
            )

        try:
            return wait_until(written, "the stacks", STACKS_S)
        except WaitTimeout:
            return False

    def _log_since(self, name: str, offset: int) -> str:
        with contextlib.suppress(OSError), self.log_path(name).open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
        return ""

    def paused(self, entry: str, timeout_s: float) -> dict[str, Any]:
        """Wait until a process stopped at `entry` of `pause_at` (WHO:POINT:ROUND); returns its marker, {"round":
        the round reached, "pid": the process that stopped, a supervised island's worker}."""
        return self.wait_for(lambda: self.pauses.reached(entry), timeout_s, f"a stop at {entry}", poll_s=0.02)

    def release(self, entry: str) -> None:
        """Let the process stopped at `entry` go on."""
        self.pauses.release(entry)

    def release_together(self, entries: Sequence[str], timeout_s: float) -> None:
        """Wait until a process stands at each of `entries`, then let them all go on: islands that start together
        (one slower to start on a loaded host would otherwise join rounds behind, a late joiner, while the others
        close the first rounds alone)."""
        for entry in entries:
            self.paused(entry, timeout_s)
        for entry in entries:
            self.release(entry)

    def wait_rounds(self, n: int, timeout_s: float) -> list[dict[str, Any]]:
        """Block until the coordinator has committed at least `n` rounds; returns the `round` events."""
        return self.wait_for(lambda: r if len(r := self.rounds()) >= n else None, timeout_s, f"{n} committed rounds")

    def wait_exit(self, timeout_s: float) -> None:
        """Every current process ends by itself with exit code 0 (the run completed); raise otherwise."""
        procs = self.processes()
        self.wait_for(
            lambda: all(p.poll() is not None for p in procs.values()),
            timeout_s,
            "every process to finish",
            poll_s=0.1,
            coordinator_needed=False,
        )
        codes = {name: p.poll() for name, p in procs.items()}
        if any(code != 0 for code in codes.values()):
            raise FederationError(f"exit codes {codes}\n{self.logs()}")

    def wait_done(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the coordinator to finish and return its summary.json."""
        coordinator = self.coordinator
        assert coordinator is not None
        summary = self.run_dir / "summary.json"

        def finished() -> dict[str, Any] | None:
            if coordinator.poll() is None:
                return None
            if not summary.exists():
                raise FederationError(f"coordinator exited without a summary: {tail(self.log_path())}", COORDINATOR)
            return json.loads(summary.read_text())

        # The probe itself reads the coordinator's exit: wait_for's own check could see it exit just after the probe
        # found it running and fail a run that finished.
        return self.wait_for(finished, timeout_s, "the run to finish", 0.2, coordinator_needed=False)

    def stop(self, grace_s: float = 10.0, linger_s: float = 0.0) -> None:
        """Give every live process `linger_s` to end on its own (islands leave after the last round), then SIGTERM
        (checkpoints flush), then SIGKILL what is left after `grace_s` (its whole process group, with
        `new_session`: a supervisor's worker too)."""
        procs = [p for p in self.processes().values() if p.poll() is None]
        deadline = time.monotonic() + linger_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
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
        for proc in self.processes().values() if self.new_session else ():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # what it started and left behind (a supervisor's worker)

    def __enter__(self) -> Federation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
