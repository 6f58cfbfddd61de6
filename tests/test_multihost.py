"""Multi-host islands (diloco/worker/island_group.py): one island = N processes driven as one JAX program.

With real processes, sockets and signals, on CPU over gloo, in one federation: island-0 as 2 processes x 2 devices
trains as one process of 4 devices does (the same losses as `simulate`, within float tolerance: the cross-process
all-reduce adds in another order), even though one of its followers is SIGKILLed mid-run: the island goes down as a
whole, its supervisor restarts it, it resumes from its checkpoint and redoes the round it lost. Every island's θ
equals the coordinator's after every round. A user mistake is one line and exit code 2.
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
from diloco.harness.procs import Federation, devices_env
from diloco.run.rundir import read_events
from tests.conftest import ENV, FAST, JAX_CACHE, REPO, child_env
from tests.test_federation import _finished_checkpoints, check_run

ROUNDS = 3
KILL_AT = "island-0:before_push:1"
"""island-0's leader stops after training round 1, before its push (diloco/faults.py), and the follower's SIGKILL
lands there once round 1's checkpoint is complete on disk: the restarted island redoes the same round from that
checkpoint on the same batches, and the curve stays simulate's."""
RUN = [*FAST, "quorum.min_islands=2", f"train.rounds={ROUNDS}", "codec.uplink=fp32", "codec.downlink=fp32"]
"""Every round holds both islands (min_islands = count), so the two runs take the same steps; fp32 both ways: no
error-feedback residual, so a redone push is the lost one, bit for bit."""
WAIT_S = 240.0


@pytest.fixture
def feds(tmp_path: Path, tiny_config: Path) -> Iterator[list[Federation]]:
    made: list[Federation] = []
    yield made
    for fed in made:
        fed.stop(grace_s=0.0)


def _curve(rounds: list[dict]) -> list[float]:
    """A run's curve as the coordinator and `simulate` both log it: each round's mean island loss and eval loss."""
    return [x for r in rounds for x in (r["loss"], r["eval_loss"])]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_island_trains_as_one_process_island_through_a_killed_follower(
    tmp_path: Path, tiny_config: Path, feds: list
) -> None:
    """island-0 as 2 processes x 2 devices against the one-process run of the same config: `diloco simulate` with
    every island on 4 devices, which a federation of one-process islands matches bit for bit
    (tests/test_federation.py::test_launch_equals_simulate). Only the order of float sums differs."""
    reference = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "diloco.cli",
            "simulate",
            str(tiny_config),
            *RUN,
            "islands.devices=4",
            "--run-dir",
            str(tmp_path / "simulate"),
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(4, jax_cache=True),
        cwd=REPO,
    )
    try:
        fed = Federation(
            tiny_config,
            [*RUN, "islands.devices=2"],
            tmp_path / "multi",
            cwd=REPO,
            env=ENV,
            jax_cache=JAX_CACHE,
            pause_at=[KILL_AT],
        )
        feds.append(fed)
        fed.start_coordinator()
        fed.start_island("island-0", args=fed.group_args("island-0", 2), supervised=True)
        fed.start_island("island-1", env=devices_env(2))
        killed_in = fed.paused(KILL_AT, WAIT_S)["round"]
        fed.wait_for(lambda: "1" in _finished_checkpoints(fed, "island-0"), WAIT_S, "island-0's checkpoint 1")
        island = fed.island_dir("island-0")
        leader, follower = (int((island / f).read_text()) for f in ("worker.pid", "process-1.pid"))
        os.kill(follower, signal.SIGKILL)
        fed.wait_done(WAIT_S)
        fed.stop(linger_s=20.0)
        _, err = reference.communicate(timeout=WAIT_S)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    assert reference.returncode == 0, err[-2000:]
    check_run(fed, ROUNDS, list(fed.names))  # every island's θ is the coordinator's after every round
    # The whole island restarted: a new leader process, resumed from its checkpoint of the round it was training,
    # joined again; the follower kept its own lock and pid file beside the leader's run.lock.
    assert int((island / "worker.pid").read_text()) != leader
    assert [e["round"] for e in fed.events("resumed", island="island-0")] == [killed_in]
    assert len(fed.events("joined", island="island-0")) == 2
    assert "restart 1/5" in fed.log_path("island-0").read_text()
    assert (island / "process-1.lock").exists() and (island / "process-1.pid").exists()
    a, b = _curve(fed.rounds()), _curve(read_events(tmp_path / "simulate" / "metrics.jsonl", "round"))
    assert len(a) == len(b) == 2 * ROUNDS
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    print(f"killed in round {killed_in}; loss curves differ by at most {worst:.3g}")
    assert worst < 1e-4, (a, b)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--process-id", "2", "--num-processes", "2", "--island-coordinator", "127.0.0.1:1234"],
            "--process-id must be in 0 .. 1 for --num-processes 2 (got 2)",
        ),
        (["--num-processes", "2"], "--island-coordinator HOST:PORT is needed"),
        (["--num-processes", "2", "--island-coordinator", "nowhere"], "--island-coordinator must be HOST:PORT"),
        (
            ["--num-processes", "2", "--island-coordinator", "127.0.0.1:1234", "stream.fragments=2"],
            "stream.fragments > 1 (streaming) is not supported with islands.processes > 1",
        ),
        (["islands.processes=0"], "islands.processes must be >= 1"),
    ],
)
def test_island_group_mistakes_are_one_line(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    base = [
        "island",
        str(tiny_config),
        "--name",
        "island-0",
        "--coordinator",
        "127.0.0.1:50051",
        "--no-supervise",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_simulate_refuses_several_processes(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(tiny_config), "islands.processes=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "islands.processes = 2: simulate runs every island in this one process" in err
    assert len(err.splitlines()) == 1, err
