"""The run directory (README.md, "Reading a run directory"): config.toml, metrics.jsonl, summary.json, checkpoints/.

metrics.jsonl holds one JSON object per line with at least `event` and `t` (seconds since the run started,
continued across resumes). A run directory belongs to one run: opening it with a different config is refused
with the differing keys named, so two runs never mix their metrics or checkpoints.

It also has one writer at a time: `RunDir` holds an exclusive lock on RUN_DIR/run.lock for as long as it is open
(`RunDirLock`), and a second process that opens the same directory (a second coordinator on another port, a
second `simulate`, an island started twice) is refused with one line naming the holder, instead of both appending
to one metrics.jsonl and checkpointing over each other.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from diloco.config import RunConfig, diff_keys, dump_toml, from_dict, to_dict
from diloco.ops.tensorboard import open_tensorboard
from diloco.run.resume_rules import SAME_CONTENT, ResumeRefused, lookup, resume_changes
from floor.errors import UserError
from floor.files import file_sha256, write_atomically
from islands.memory import peak_resident
from islands.models.hf.checkpoint import kept_tokenizer_file

log = logging.getLogger("diloco.run.rundir")


class DiskFullError(UserError, OSError):
    """A checkpoint or a metrics line cannot be written for want of disk space: one line saying where, how much and
    what to do; the last complete checkpoint is intact, and the same command resumes from it once space is freed
    (diloco/run/checkpoint.py checks the free space before each save)."""


class RunDirError(UserError, ValueError):
    """The run directory is unusable (another run's, unreadable, not a directory)."""


class RunDirBusy(RunDirError):
    """Another live process holds the run directory (its lock file names it)."""


DURABLE_EVENTS = frozenset({"island_admitted", "island_retired"})
"""Events of changes kept outside the checkpoint (the roster, RUN_DIR/roster.json): a resumed run keeps them whatever
their round, since the roster does not go back with θ (docs/architecture.md, "Elastic federation")."""
LOCK_FILE = "run.lock"
"""Held by the process that writes the directory: the coordinator (launch's too), an island worker, simulate."""
LAUNCH_LOCK_FILE = "launch.lock"
"""Held by `diloco launch` beside its coordinator's run.lock: a second launch is refused before it rewrites
anything of the first (its TLS files, its coordinator's address, its logs)."""
PROBE_GRACE_S = 0.2
"""How long `check_free` waits for a lock held by another probe (an instant) before it names the holder."""
COMMANDS = ("coordinator", "island", "simulate", "launch", "bench")
"""`diloco` commands whose name (argv[1]) becomes the holder's role when the caller does not give one."""


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in argv, if present."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def redacted_command(argv: Sequence[str]) -> str:
    """The command line as it may be written to disk: `--secret VALUE` and `*secret*=...` overrides can hold a
    literal secret, so their values are replaced (an `env:`/`file:` reference is kept: it only says where)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if i > 0 and argv[i - 1] == "--secret":
            arg = arg if arg.startswith(("env:", "file:")) else "<redacted>"
        elif eq and "secret" in key.lower() and not value.startswith(("env:", "file:")):
            arg = f"{key}=<redacted>"
        out.append(arg)
    return " ".join(out)


def process_role(argv: Sequence[str] | None = None) -> tuple[str | None, dict[str, str]]:
    """What this process is, from its command line (`diloco island --name us-east ...` -> "island us-east").

    The drivers open their RunDir without saying who they are, and the CLI is the one place that knows; reading
    argv keeps every caller unchanged. A process that is not the `diloco` CLI (a test, a notebook) has no role and
    is named by its command line instead.
    """
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in COMMANDS:
        return None, {}
    role, extra = argv[1], {}
    if role == "island":
        name, coordinator = _flag(argv, "--name"), _flag(argv, "--coordinator")
        role = f"island {name}" if name else role
        if coordinator:
            extra["coordinator"] = coordinator
    return role, extra


class RunDirLock:
    """An exclusive `flock` on RUN_DIR/run.lock (or `name`), held until `release()` or the holder's death.

    Why an OS lock and not a pid file: the kernel drops a flock when the last descriptor of its open file goes away,
    however the process ends (SIGKILL, OOM killer, power to the container), so a crashed run never leaves a lock
    that blocks its own restart, and no one has to guess whether a recorded pid is still the same process. The
    file's content (pid, role, command line, host, address) only serves the refusal message; the lock alone decides,
    so a stale content after a SIGKILL is simply overwritten by the next holder.

    The descriptor is close-on-exec (Python's default), so a child the holder spawns never inherits the lock.
    Opening the same directory twice in one process is refused too: flock locks belong to open files, not processes.
    """

    def __init__(self, run_dir: Path, role: str | None = None, wait_s: float = 1.0, name: str = LOCK_FILE) -> None:
        self.path = run_dir / name
        self.run_dir = run_dir
        inferred, extra = process_role()
        self.info: dict[str, Any] = {
            "pid": os.getpid(),
            "role": role or inferred,
            "host": socket.gethostname(),
            "command": redacted_command(sys.argv)[:500],
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **({} if role else extra),
        }
        self.name = name
        self._file: IO[str] | None = _open_lock_file(self.path, run_dir)
        # A short grace: a holder that is exiting (a supervisor restarting its worker, `check_free` probing) lets go
        # within moments; a live run never does.
        deadline = time.monotonic() + wait_s
        try:
            while not self._try_lock():
                if time.monotonic() >= deadline:
                    raise RunDirBusy(busy_message(run_dir, read_holder(self.path), name))
                time.sleep(0.05)
        except BaseException:
            self.release()
            raise
        self._write()

    def _try_lock(self) -> bool:
        assert self._file is not None
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                # A filesystem without locks (some network or FUSE mounts): run unprotected rather than not at all.
                self.info["unlocked"] = exc.strerror or str(exc)
                return True
            raise RunDirError(f"run dir '{self.run_dir}': cannot lock {self.name} ({exc.strerror or exc})") from None
        return True

    @property
    def held(self) -> bool:
        return self._file is not None and "unlocked" not in self.info

    def update(self, **fields: Any) -> None:
        """Add to what the lock file says about the holder (the coordinator's listen address, once it is known)."""
        self.info.update(fields)
        self._write()

    def _write(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(self.info) + "\n")
        self._file.flush()

    def release(self) -> None:
        """Let go of the directory (closing the file drops the flock). The file stays: it is not the lock."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _open_lock_file(path: Path, run_dir: Path) -> IO[str]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunDirError(f"run dir '{run_dir}': cannot open {path.name} ({exc.strerror or exc})") from None
    return os.fdopen(fd, "r+")


def read_holder(path: Path, wait_s: float = 1.0) -> dict[str, Any]:
    """The holder's info from a lock file; {} when it names no one (retried briefly: the holder may be writing)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(path.read_text())
            if isinstance(info, dict) and "pid" in info:
                return info
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return {}
        time.sleep(0.05)


def busy_message(run_dir: Path, holder: dict[str, Any], name: str = LOCK_FILE) -> str:
    """One line: who holds the run directory, and what to do about it."""
    if not holder:
        who = f"another process ({name} names no holder)"
    else:
        who = f"{holder.get('role') or 'another process'} pid {holder.get('pid')}"
        if holder.get("address"):
            who += f" listening on {holder['address']}"
        if holder.get("coordinator"):
            who += f" (coordinator {holder['coordinator']})"
        if holder.get("host") and holder["host"] != socket.gethostname():
            who += f" on host {holder['host']}"
        if not holder.get("role") and holder.get("command"):
            who += f" ({str(holder['command'])[:120]})"
    return f"run dir '{run_dir}' is in use by {who}; stop it or use another --run-dir"


def live_holder(path: Path) -> dict[str, Any] | None:
    """What the lock file at `path` says about its holder while one holds it ({} while it is being written); None
    when the file is absent or its lock is free (its content is then a dead process's). Writes nothing: the probe
    holds a free lock for an instant, and a process taking it at that very moment waits for it (`RunDirLock`'s grace,
    `check_free`'s) instead of failing. On a filesystem without locks the content is taken as it is."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    with os.fdopen(fd, "r+") as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(path, wait_s=0.0)
        except OSError:
            return read_holder(path, wait_s=0.0)  # no locks here (RunDirLock runs unprotected): trust the content
        return None  # closing the file lets go of the probe's lock


def check_free(run_dir: Path, name: str = LOCK_FILE) -> None:
    """Raise RunDirBusy when a live process holds `run_dir`; take nothing (the lock is let go at once).

    For the island supervisor: it refuses a second island on the same directory before spawning a worker (and
    before overwriting the first one's worker.pid). The probe holds the lock for an instant; a worker opening the
    directory at that very moment waits for it (`RunDirLock`'s grace) instead of failing, and this probe waits out
    another's (`live_holder`: a multi-process island's process 0 looks at its followers' locks) for PROBE_GRACE_S.
    """
    if run_dir.is_dir():
        RunDirLock(run_dir, wait_s=PROBE_GRACE_S, name=name).release()


class RunDir:
    def __init__(self, path: Path, cfg: RunConfig, role: str | None = None, lock: RunDirLock | None = None) -> None:
        """Open (create or resume) the run directory and lock it for this process until `close()`.

        `role` names the holder in another process's refusal ("coordinator", "island us-east"); by default it is
        read from the `diloco` command line. `lock`: run.lock already taken by this process (a multi-process
        island's new leader takes it when it is elected, diloco/worker/island_formation.py), held from now on.
        """
        self.path = path
        self.config_path = path / "config.toml"
        self.metrics_path = path / "metrics.jsonl"
        self.summary_path = path / "summary.json"
        self.checkpoints = path / "checkpoints"
        # First: a missing tensorboardX is refused before the directory is created or locked.
        self.tensorboard = open_tensorboard(cfg, path)
        if path.exists() and not path.is_dir():
            raise RunDirError(f"run dir '{path}' exists and is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"run dir '{path}' cannot be created ({exc.strerror or exc})") from None
        # Before anything is read or written: a second writer is refused with the directory untouched.
        self.lock = lock if lock is not None else RunDirLock(path, role)
        try:
            self.resuming = self.config_path.exists()
            changes = self._check_same_run(cfg) if self.resuming else {}
            if not self.resuming:
                self.config_path.write_text(dump_toml(to_dict(cfg)))
            self.checkpoints.mkdir(exist_ok=True)
            self._t_offset = self._last_t()
            self._t0 = time.monotonic()
            self._metrics = self.metrics_path.open("a", buffering=1)
            self._write_lock = threading.Lock()
            self.observers: list[Callable[[str, dict[str, Any]], None]] = []
            """Told every event after it is written (diloco/ops/metrics.py feeds Prometheus from them): one source for
            both, so a metric and its event never disagree."""
            if self.tensorboard is not None:  # run.tensorboard: curves from the same events (diloco/ops/tensorboard.py)
                self.observers.append(self.tensorboard.observe)
            if changes:
                self.log("config_changed", changes=changes)
        except BaseException:
            self.lock.release()
            raise
        if not self.lock.held:
            self.log("run_dir_unlocked", reason=self.lock.info.get("unlocked"))

    def set_address(self, address: str) -> None:
        """Record where this run's coordinator listens, so that a refused second writer is told where it is."""
        self.lock.update(address=address)

    def _check_same_run(self, cfg: RunConfig) -> dict[str, list[Any]]:
        """`{key: [old, new]}` of the keys a resumed config changes (diloco/run/resume_rules.py; config.toml is
        rewritten with them); RunDirError naming the keys that may not change."""
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
        resumed = to_dict(cfg)
        differing = diff_keys(stored, resumed)
        if differing and self._never_started():
            # A run refused at start (a step too big for memory, a bad data path found late) saved nothing to resume:
            # the corrected command may take its directory, as it could before the first attempt made it.
            log.warning(
                "run dir '%s' holds a run that saved nothing (it differs in: %s); starting afresh with this config",
                self.path,
                ", ".join(differing[:8]),
            )
            self.config_path.write_text(dump_toml(resumed))
            self.metrics_path.unlink(missing_ok=True)
            return {}
        try:
            changes = resume_changes(stored, resumed, differing, self._same_content(stored, resumed, differing))
        except ResumeRefused as exc:
            raise RunDirError(
                f"run dir '{self.path}' holds another run (config differs in: {', '.join(exc.keys[:8])}); a resumed "
                "run may not change these keys (README, 'What a resumed run may change'): use a new --run-dir"
            ) from None
        if changes:
            write_atomically(self.config_path, dump_toml(resumed))
        return changes

    def _same_content(self, stored: dict[str, Any], resumed: dict[str, Any], differing: list[str]) -> set[str]:
        """The keys of `SAME_CONTENT` among `differing` whose files hold the same bytes under both configs: the stored
        file read where the run kept it (RUN/hf/ for its checkpoint's tokenizer), else at its stored path."""
        same = set()
        for key in SAME_CONTENT.keys() & set(differing):
            old, new = lookup(stored, key), lookup(resumed, key)
            if not (isinstance(old, str) and old and isinstance(new, str) and new):
                continue
            before = kept_tokenizer_file(self.path, old, lookup(stored, "init.from") or "") or Path(old).expanduser()
            after = Path(new).expanduser()
            if before.is_file() and after.is_file() and file_sha256(before) == file_sha256(after):
                same.add(key)
        return same

    def _never_started(self) -> bool:
        """Nothing here can be resumed: no checkpoint step, no summary and no committed round or sync event."""
        saved = any(self.checkpoints.rglob("_CHECKPOINT_METADATA")) if self.checkpoints.is_dir() else False
        committed = any(e.get("event") in ("round", "sync") for e in read_events(self.metrics_path))
        return not (saved or committed or self.summary_path.exists())

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
        line = json.dumps({"event": event, "t": round(self.elapsed(), 4), **fields}) + "\n"
        with self._write_lock:  # threads log too (an island's wire thread, the coordinator's settle thread)
            try:
                self._metrics.write(line)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise DiskFullError(
                    f"no disk space left to write {self.metrics_path}; free some space, then run "
                    "the same command again: it resumes from the last complete checkpoint"
                ) from None
        for observe in self.observers:
            observe(event, fields)

    def log_memory_peak(self, **fields: Any) -> None:
        """A `memory_peak` event: this process's peak resident memory so far (VmHWM), logged as it ends, so that a
        run's processes can be held against their memory plan (islands/memory.py). Nothing where the kernel does not
        say."""
        peak = peak_resident()
        if peak is not None:
            self.log("memory_peak", rss_peak_bytes=peak, **fields)

    def log_inner(
        self,
        round: int,
        island: str,
        first_step: int,
        losses: Sequence[float],
        every: int,
        figures: Mapping[str, Sequence[float]] | None = None,
    ) -> None:
        """An `inner` event for each inner step (counted from 1) that is a multiple of `every`: the same steps
        however the losses come, a round at a time or (streaming) a few steps between two syncs. `figures`: the
        workload's own per-step values (rl's training reward and KL, dpo's accuracy), each a field beside the loss."""
        for i, loss in enumerate(losses):
            if (first_step + i + 1) % every == 0:
                shown = {name: float(values[i]) for name, values in (figures or {}).items()}
                self.log("inner", round=round, island=island, step=first_step + i + 1, loss=float(loss), **shown)

    def truncate_after_round(self, completed_rounds: int) -> None:
        """On resume, drop events of rounds that the restored checkpoint does not contain (they will rerun), but for
        the `DURABLE_EVENTS`: what they record outlives the checkpoint, and no rerun logs it again."""
        self._metrics.close()
        kept = [
            json.dumps(r)
            for r in read_events(self.metrics_path)
            if r.get("round", -1) < completed_rounds or r.get("event") in DURABLE_EVENTS
        ]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.metrics_path)
        self._metrics = self.metrics_path.open("a", buffering=1)

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.summary_path)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()  # flushed before the lock goes: a finished run's event files are complete
        self._metrics.close()
        self.lock.release()


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
