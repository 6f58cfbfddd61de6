"""One writer per run directory (diloco/run/rundir.py, RunDirLock): a second one is refused with one line naming the
holder, and a holder that died, even by SIGKILL, never blocks a restart.

Holders run in other processes (subprocesses), because that is the case the lock exists for and because a flock
taken by this very process would prove nothing about another.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.config import RunConfig, load_config
from diloco.harness.procs import wait_until
from diloco.run.rundir import (
    LAUNCH_LOCK_FILE,
    LOCK_FILE,
    RunDir,
    RunDirBusy,
    check_free,
    process_role,
    read_events,
    read_holder,
    redacted_command,
)
from tests.conftest import REPO, child_env, run_cli

HOLDER = """
import sys, time
from pathlib import Path
from diloco.config import load_config
from diloco.run.rundir import RunDir, RunDirLock
run_dir, kind = Path(sys.argv[1]), sys.argv[2]
if kind == "rundir":
    held = RunDir(run_dir, load_config(None, ["data.kind=synthetic"]), role="test-holder")
else:
    run_dir.mkdir(parents=True, exist_ok=True)
    held = RunDirLock(run_dir, role="launch", name=kind)
print("held", flush=True)  # only now is the run dir whole (its lock is taken before config.toml is written)
time.sleep(600)
"""


def _cfg() -> RunConfig:
    return load_config(None, ["data.kind=synthetic"])


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes that hold a run dir; whatever a test leaves alive is killed."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _hold(procs: list[subprocess.Popen[bytes]], run_dir: Path, lock_file: str = LOCK_FILE) -> subprocess.Popen[bytes]:
    """Start a process that holds `run_dir` (its RunDir, or only `lock_file`) and return once it does."""
    kind = "rundir" if lock_file == LOCK_FILE else lock_file
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), kind], env=child_env(), cwd=REPO, stdout=subprocess.PIPE
    )
    procs.append(proc)
    assert proc.stdout is not None
    ready = proc.stdout.readline()  # the test's timeout bounds a holder that hangs
    assert ready == b"held\n", f"the holder exited with {proc.wait()}"
    assert read_holder(run_dir / lock_file, wait_s=0).get("pid") == proc.pid
    return proc


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_second_writer_in_another_process_is_refused_with_the_holder_named(tmp_path: Path, holders: list) -> None:
    run_dir = tmp_path / "run"
    holder = _hold(holders, run_dir)
    before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(RunDirBusy) as refused:
        RunDir(run_dir, _cfg())
    message = str(refused.value)
    assert message == (
        f"run dir '{run_dir}' is in use by test-holder pid {holder.pid}; stop it or use another --run-dir"
    ), message
    # Refused before touching anything: the holder's files are as it left them, and it still holds the lock.
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    assert read_holder(run_dir / LOCK_FILE)["pid"] == holder.pid
    with pytest.raises(RunDirBusy):
        check_free(run_dir)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_sigkilled_holder_does_not_block_a_restart(tmp_path: Path, holders: list) -> None:
    run_dir = tmp_path / "run"
    holder = _hold(holders, run_dir)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    # The dead holder's info is still in the file (stale); only the lock decides, and the kernel dropped it.
    assert read_holder(run_dir / LOCK_FILE)["pid"] == holder.pid
    check_free(run_dir)
    rd = RunDir(run_dir, _cfg())
    try:
        assert rd.resuming  # the same run, taken over
        assert read_holder(run_dir / LOCK_FILE)["pid"] == os.getpid()
    finally:
        rd.close()
    RunDir(run_dir, _cfg()).close()  # close() let go: the directory opens again


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_one_process_cannot_open_one_run_dir_twice(tmp_path: Path) -> None:
    """flock belongs to an open file, not a process: two RunDirs in one process would also mix their writes."""
    first = RunDir(tmp_path / "run", _cfg(), role="first")
    try:
        with pytest.raises(RunDirBusy, match=rf"in use by first pid {os.getpid()};"):
            RunDir(tmp_path / "run", _cfg())
    finally:
        first.close()


@pytest.mark.timeout(60)
def test_the_address_and_the_role_reach_the_message(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run", _cfg(), role="coordinator")
    try:
        rd.set_address("127.0.0.1:5555")
        with pytest.raises(RunDirBusy, match=r"in use by coordinator pid \d+ listening on 127\.0\.0\.1:5555; stop it"):
            check_free(tmp_path / "run")
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["address"] == "127.0.0.1:5555"
    finally:
        rd.close()


def test_role_from_the_command_line() -> None:
    assert process_role(["diloco", "coordinator", "c.toml", "--listen", "0.0.0.0:1"]) == ("coordinator", {})
    assert process_role(["cli.py", "island", "c.toml", "--name", "us-east", "--coordinator=h:1"]) == (
        "island us-east",
        {"coordinator": "h:1"},
    )
    assert process_role(["x/diloco", "simulate", "c.toml"]) == ("simulate", {})
    assert process_role(["pytest", "tests/test_rundir_lock.py"]) == (None, {})
    assert process_role(["python"]) == (None, {})


def test_secrets_never_reach_the_lock_file() -> None:
    argv = ["diloco", "island", "c.toml", "--secret", "hunter2", 'network.secrets=["s1", "s2"]', "outer.lr=1"]
    assert redacted_command(argv) == "diloco island c.toml --secret <redacted> network.secrets=<redacted> outer.lr=1"
    kept = ["diloco", "island", "--secret", "env:S", "network.secrets=env:X"]
    assert redacted_command(kept) == "diloco island --secret env:S network.secrets=env:X"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_supervisor_refuses_a_held_run_dir_before_starting_a_worker(tmp_path: Path, holders: list) -> None:
    from diloco.worker.supervisor import supervise

    run_dir = tmp_path / "island"
    holder = _hold(holders, run_dir)
    with pytest.raises(RunDirBusy, match=rf"in use by test-holder pid {holder.pid};"):
        supervise(["island", "never-started.toml"], run_dir)
    assert not (run_dir / "worker.pid").exists()  # the holder's worker.pid (were it an island) is not overwritten


def _free(run_dir: Path) -> bool:
    try:
        check_free(run_dir)
    except RunDirBusy:
        return False
    return True


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_worker_does_not_outlive_its_supervisor(tmp_path: Path, tiny_config: Path, holders: list) -> None:
    """A SIGKILLed supervisor forwards nothing; its worker (here waiting for a coordinator that never answers) must
    notice and stop rather than hold the island's run dir against the island's next supervisor."""
    run_dir, supervisor_log = tmp_path / "island", tmp_path / "island.log"
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diloco.cli",
            "island",
            str(tiny_config),
            "--name",
            "island-0",
            "--coordinator",
            "127.0.0.1:9",
            "--run-dir",
            str(run_dir),
            "network.coordinator_wait_s=600",
        ],
        stdout=subprocess.DEVNULL,
        stderr=supervisor_log.open("wb"),
        env=child_env(),
        cwd=REPO,
    )
    holders.append(supervisor)
    wait_until(lambda: (run_dir / "worker.pid").exists() and (run_dir / LOCK_FILE).exists(), "the worker's lock", 90)
    worker = int((run_dir / "worker.pid").read_text())
    wait_until(lambda: read_holder(run_dir / LOCK_FILE, 0.0).get("pid") == worker, "the worker to hold the run dir", 90)
    supervisor.kill()
    supervisor.wait(timeout=30)
    wait_until(lambda: not _running(worker), "the orphaned worker to stop", 60)
    wait_until(lambda: _free(run_dir), "the run dir to be free", 60)  # the next supervisor may take it
    assert b"supervisor (pid" in supervisor_log.read_bytes()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_second_launch_is_refused_before_it_touches_the_run_dir(
    tmp_path: Path, tiny_config: Path, holders: list
) -> None:
    from diloco.harness.launch import launch

    run_dir = tmp_path / "run"
    holder = _hold(holders, run_dir, LAUNCH_LOCK_FILE)
    with pytest.raises(RunDirBusy, match=rf"^run dir '{run_dir}' is in use by launch pid {holder.pid}; stop it"):
        launch(str(tiny_config), [], run_dir, progress=False)
    assert sorted(p.name for p in run_dir.iterdir()) == [LAUNCH_LOCK_FILE]  # no tls/, logs/, coordinator.addr


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_second_coordinator_on_a_run_dir_exits_2_with_one_line(tmp_path: Path, tiny_config: Path) -> None:
    run_dir = tmp_path / "run"
    addr_file = run_dir / "coordinator.addr"

    def start() -> subprocess.Popen[bytes]:
        argv = ["coordinator", str(tiny_config), "--listen", "127.0.0.1:0", "--run-dir", str(run_dir), "--quiet"]
        return subprocess.Popen(
            [sys.executable, "-m", "diloco.cli", *argv],
            env=child_env(jax_cache=True),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    first = start()
    try:
        wait_until(lambda: first.poll() is not None or addr_file.exists(), "the first coordinator", 240)
        assert first.poll() is None, f"the first coordinator exited with {first.returncode}"
        address = addr_file.read_text()
        second = run_cli(
            "coordinator",
            str(tiny_config),
            "--listen",
            "127.0.0.1:0",
            "--run-dir",
            str(run_dir),
            "--quiet",
            timeout=240,
        )
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip() == (
            f"diloco: error: run dir '{run_dir}' is in use by coordinator pid {first.pid} listening on {address}; "
            "stop it or use another --run-dir"
        )
        assert second.stdout == ""
        assert first.poll() is None and addr_file.read_text() == address
        assert len(read_events(run_dir / "metrics.jsonl", "eval")) == 1  # the second never wrote to the run

        # A coordinator killed with SIGKILL leaves its lock file behind, and no lock: a restart takes over.
        first.kill()
        first.wait(timeout=30)
        addr_file.unlink()
        restarted = start()
        try:
            wait_until(lambda: restarted.poll() is not None or addr_file.exists(), "the restarted coordinator", 240)
            assert restarted.poll() is None, f"the restarted coordinator exited with {restarted.returncode}"
            assert read_holder(run_dir / LOCK_FILE)["pid"] == restarted.pid
        finally:
            restarted.terminate()
            restarted.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)


def test_a_run_that_saved_nothing_gives_its_dir_to_a_corrected_config(tmp_path: Path) -> None:
    """A first attempt refused at start (e.g. a step too big for memory) leaves config.toml and nothing to resume:
    the corrected command takes the directory; once a round is committed another config is refused."""
    from diloco.config import load_config
    from diloco.run.rundir import RunDir, RunDirError

    base = ["data.kind=synthetic"]
    first, fixed = load_config(None, [*base, "train.batch_size=64"]), load_config(None, [*base, "train.batch_size=8"])
    RunDir(tmp_path / "r", first).close()
    rd = RunDir(tmp_path / "r", fixed)
    assert "batch_size = 8" in (tmp_path / "r" / "config.toml").read_text()
    rd.log("round", round=0, eval_loss=1.0)
    rd.close()
    with pytest.raises(RunDirError, match=r"holds another run \(config differs in: train.batch_size\)"):
        RunDir(tmp_path / "r", first)


SUPERVISOR = """
import logging, sys
from pathlib import Path
from diloco.worker.supervisor import supervise
logging.basicConfig(level=logging.INFO, format="%(message)s")
sys.exit(supervise(sys.argv[2:], Path(sys.argv[1]), backoff_s=600))
"""
"""A supervisor whose restart backoff is long, so that a stop lands in it for sure."""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_stop_in_the_restart_backoff_starts_no_worker(tiny_config: Path, tmp_path: Path) -> None:
    """A worker that gave up (exit 69: a follower with no process 0 to lead its island) and a SIGTERM while its
    supervisor waits to restart it: the supervisor ends then, with the worker's code, and starts no other worker
    (one that started after the stop would run on, untold, until its own patience ran out)."""
    run_dir = tmp_path / "island"
    worker = ["island", str(tiny_config), "--name", "island-0", "--no-supervise", "--run-dir", str(run_dir)]
    worker += ["--process-id", "1", "--num-processes", "2", "--island-coordinator", "127.0.0.1:1"]
    worker += ["network.coordinator_wait_s=0.2"]
    err = tmp_path / "supervisor.err"
    with err.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(run_dir), *worker], env=child_env(), stderr=sink)
    try:
        wait_until(lambda: "restart 1/5" in err.read_text(), "the supervisor's first restart backoff", 90)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 69, err.read_text()
    finally:
        proc.kill()
    text = err.read_text()
    assert "before its worker's restart" in text and text.count("no place in the island") == 1, text
