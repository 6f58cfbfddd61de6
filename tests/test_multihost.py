"""Multi-host islands (diloco/island_group.py): one island = N processes driven as one JAX program.

With real processes, sockets and signals, on CPU over gloo: island-0 as 2 processes x 2 devices trains as one process
of 4 devices does (the same losses as `simulate`, within float tolerance: the cross-process all-reduce adds in
another order), and every island's θ equals the coordinator's after every round; a follower SIGKILLed mid-run takes its
island down, the island's supervisor restarts it whole and it rejoins; a user mistake is one line and exit code 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.cli import main
from diloco.procs import Federation, devices_env
from diloco.rundir import read_events
from tests.conftest import JAX_CACHE, REPO, child_env
from tests.test_federation import ENV, FAST, check_run

ROUNDS = 3
RUN = [*FAST, "quorum.min_islands=2", f"train.rounds={ROUNDS}"]
"""Every round holds both islands (min_islands = count), so the two runs take the same steps."""
WAIT_S = 240.0


@pytest.fixture
def feds(tmp_path: Path, tiny_config: Path) -> Iterator[list[Federation]]:
    made: list[Federation] = []
    yield made
    for fed in made:
        fed.stop(grace_s=0.0)


def _federation(made: list[Federation], tiny_config: Path, run_dir: Path, *overrides: str) -> Federation:
    fed = Federation(tiny_config, [*RUN, *overrides], run_dir, cwd=REPO, env=ENV, jax_cache=JAX_CACHE)
    made.append(fed)
    return fed


def _curve(rounds: list[dict]) -> list[float]:
    """A run's curve as the coordinator and `simulate` both log it: each round's mean island loss and eval loss."""
    return [x for r in rounds for x in (r["loss"], r["eval_loss"])]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_island_trains_as_one_process_island(tmp_path: Path, tiny_config: Path, feds: list) -> None:
    """island-0 as 2 processes x 2 devices against the one-process run of the same config: `diloco simulate` with
    every island on 4 devices, which a federation of one-process islands matches bit for bit
    (tests/test_federation.py::test_launch_equals_simulate). Only the order of float sums differs."""
    reference = subprocess.Popen(
        [sys.executable, "-m", "diloco.cli", "simulate", str(tiny_config), *RUN, "islands.devices=4",
         "--run-dir", str(tmp_path / "simulate"), "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(4, jax_cache=True), cwd=REPO,
    )  # fmt: skip
    try:
        multi = _federation(feds, tiny_config, tmp_path / "multi", "islands.devices=2")
        multi.start_coordinator()
        multi.start_island("island-0", args=multi.group_args("island-0", 2), supervised=True)
        multi.start_island("island-1", env=devices_env(2))
        multi.wait_done(WAIT_S)
        multi.stop(linger_s=20.0)
        _, err = reference.communicate(timeout=WAIT_S)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    assert reference.returncode == 0, err[-2000:]
    check_run(multi, ROUNDS, list(multi.names))  # every island's θ is the coordinator's after every round
    assert multi.events("joined", island="island-0")[0]["event"] == "joined"
    a, b = _curve(multi.rounds()), _curve(read_events(tmp_path / "simulate" / "metrics.jsonl", "round"))
    assert len(a) == len(b) == 2 * ROUNDS
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    print(f"loss curves differ by at most {worst:.3g}")
    assert worst < 1e-4, (a, b)
    # The follower kept its own lock and pid file beside the leader's run.lock.
    island = multi.island_dir("island-0")
    assert (island / "process-1.lock").exists() and (island / "process-1.pid").exists()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_follower_restarts_the_island_as_a_whole(tmp_path: Path, tiny_config: Path, feds: list) -> None:
    fed = _federation(feds, tiny_config, tmp_path / "fed", "islands.devices=2")
    fed.start_coordinator()
    fed.start_island("island-0", args=fed.group_args("island-0", 2), supervised=True)
    fed.start_island("island-1", env=devices_env(2))
    fed.wait_rounds(2, WAIT_S)  # round 1's island checkpoint is on disk: the restart resumes from it
    island = fed.island_dir("island-0")
    leader, follower = (int((island / f).read_text()) for f in ("worker.pid", "process-1.pid"))
    os.kill(follower, signal.SIGKILL)
    fed.wait_done(WAIT_S)
    fed.stop(linger_s=20.0)
    check_run(fed, ROUNDS, list(fed.names))
    # The whole island restarted: a new leader process, resumed from its checkpoint, joined again.
    assert int((island / "worker.pid").read_text()) != leader
    assert fed.events("resumed", island="island-0")
    assert len(fed.events("joined", island="island-0")) >= 2
    assert "restart 1/5" in fed.log_path("island-0").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--process-id", "2", "--num-processes", "2", "--island-coordinator", "127.0.0.1:1234"],
         "--process-id must be in 0 .. 1 for --num-processes 2 (got 2)"),
        (["--num-processes", "2"], "--island-coordinator HOST:PORT is needed"),
        (["--num-processes", "2", "--island-coordinator", "nowhere"], "--island-coordinator must be HOST:PORT"),
        (["--num-processes", "2", "--island-coordinator", "127.0.0.1:1234", "stream.fragments=2"],
         "stream.fragments > 1 (streaming) is not supported with islands.processes > 1"),
        (["islands.processes=0"], "islands.processes must be >= 1"),
    ],
)  # fmt: skip
def test_island_group_mistakes_are_one_line(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    base = ["island", str(tiny_config), "--name", "island-0", "--coordinator", "127.0.0.1:50051", "--no-supervise",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_simulate_refuses_several_processes(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(tiny_config), "islands.processes=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "islands.processes = 2: simulate runs every island in this one process" in err
    assert len(err.splitlines()) == 1, err
