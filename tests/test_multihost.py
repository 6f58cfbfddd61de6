"""Multi-host islands (diloco/worker/island_group.py): one island = N processes driven as one JAX program.

With real processes, sockets and signals, on CPU over gloo, in one federation: island-0 as 2 processes x 2 devices
trains as one process of 4 devices does (the same losses as `simulate`, within float tolerance: the cross-process
all-reduce adds in another order), even though one of its followers is SIGKILLed mid-run: the island goes down as a
whole, its supervisor restarts it, it resumes from its checkpoint and redoes the round it lost. A process lost for
good is not waited for: the island goes on without it, on the same batches, and grows back when it returns
(diloco/worker/island_formation.py); a process 0 lost for good is replaced as the island's leader by process 1, and
takes the island back when it returns. Every island's θ equals the coordinator's after every round. A user mistake
is one line and exit code 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from diloco.cli import main
from diloco.harness.procs import Federation, devices_env
from diloco.run.rundir import read_events
from diloco.worker.island_formation import FormationFiles
from tests.conftest import ENV, FAST, JAX_CACHE, REPO, H, child_env
from tests.test_chunks import CHUNKS
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


@pytest.fixture
def simulated(tmp_path: Path, tiny_config: Path) -> Iterator[Callable[[Sequence[str]], subprocess.Popen[str]]]:
    """Starts `diloco simulate` of a run with every island on 4 devices in tmp_path/simulate: the one-process run that
    a federation of one-process islands matches bit for bit (tests/test_federation.py::test_launch_equals_simulate).
    Killed at teardown if it still runs."""
    started: list[subprocess.Popen[str]] = []

    def start(run: Sequence[str]) -> subprocess.Popen[str]:
        argv = ["simulate", str(tiny_config), *run, "islands.devices=4", "--run-dir", str(tmp_path / "simulate")]
        started.append(
            subprocess.Popen(
                [sys.executable, "-m", "diloco.cli", *argv, "--no-progress"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=child_env(4, jax_cache=True),
                cwd=REPO,
            )
        )
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _curve(rounds: list[dict]) -> list[float]:
    """A run's curve as the coordinator and `simulate` both log it: each round's mean island loss and eval loss."""
    return [x for r in rounds for x in (r["loss"], r["eval_loss"])]


def _same_curve(fed: Federation, reference: subprocess.Popen[str], rounds: int) -> float:
    """The federation's curve is the reference `simulate`'s within float tolerance (only the order of float sums
    differs: other device counts, a cross-process all-reduce): the same batches, the same steps. Returns the worst
    difference."""
    _, err = reference.communicate(timeout=WAIT_S)
    assert reference.returncode == 0, err[-2000:]
    a, b = _curve(fed.rounds()), _curve(read_events(Path(reference.args[-2]) / "metrics.jsonl", "round"))
    assert len(a) == len(b) == 2 * rounds
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst < 1e-4, (a, b)
    return worst


def _check_formations(
    fed: Federation, rounds: int, formations: list[tuple[list[int], int]], resumed: list[tuple[int, int]], stopped: str
) -> None:
    """After a run of island-0 (several processes) beside island-1: every island's θ is the coordinator's after every
    round and both took part in each; island-0 formed as `formations` ((processes, devices), epochs 1, 2, ...),
    resumed at `resumed` ((round, step)) and stopped once, for `stopped`."""
    check_run(fed, rounds, list(fed.names))
    assert all(sorted(r["islands"]) == ["island-0", "island-1"] for r in fed.rounds())
    formed = fed.events("formed", island="island-0")
    assert [(e["processes"], e["devices"]) for e in formed] == formations, formed
    assert [e["epoch"] for e in formed] == list(range(1, len(formations) + 1))
    assert [(e["round"], e["step"]) for e in fed.events("resumed", island="island-0")] == resumed
    reasons = [e["reason"] for e in fed.events("stopped", island="island-0")]
    assert reasons == [stopped], reasons


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [
        # The parameters split across the 2 processes (FSDP over the island's 4 devices), int8 up: each process forms,
        # error-feeds, encodes and checkpoints its own pieces; the leader pushes every process's.
        pytest.param(["islands.shard_params=true", "codec.uplink=int8"], id="fsdp-int8"),
        # And each process's 2 devices one tensor group: the island's mesh is 2 (data, across processes) x 2 (tensor).
        pytest.param([*CHUNKS, "islands.tensor=2"], id="chunks-tensor"),
    ],
)
def test_two_process_island_trains_as_one_process_island_through_a_killed_follower(
    tmp_path: Path,
    tiny_config: Path,
    feds: list,
    simulated: Callable[[Sequence[str]], subprocess.Popen[str]],
    sampling: list[str],
) -> None:
    """island-0 as 2 processes x 2 devices against the one-process run of the same config (`simulated`). With
    chunks, process 0 leases for the island and its follower reads the same spans: the restarted island leases its
    round again, reads the batches it lost, and the run consumes each sequence once. With islands.tensor = 2 each
    process holds its leaves split over its own two devices and forms the whole Δ from them."""
    reference = simulated([*RUN, *sampling])
    fed = Federation(
        tiny_config,
        [*RUN, *sampling, "islands.devices=2"],
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
    check_run(fed, ROUNDS, list(fed.names))  # every island's θ is the coordinator's after every round
    # The whole island restarted: a new leader process, resumed from its checkpoint of the round it was training,
    # joined again; the follower kept its own lock and pid file beside the leader's run.lock.
    assert int((island / "worker.pid").read_text()) != leader
    assert [e["round"] for e in fed.events("resumed", island="island-0")] == [killed_in]
    assert len(fed.events("joined", island="island-0")) == 2
    assert "restart 1/5" in fed.log_path("island-0").read_text()
    assert (island / "process-1.lock").exists() and (island / "process-1.pid").exists()
    worst = _same_curve(fed, reference, ROUNDS)
    print(f"killed in round {killed_in}; loss curves differ by at most {worst:.3g}")
    if "islands.shard_params=true" in sampling:
        pushes = [p for p in fed.events("push") if p["island"] == "island-0"]
        assert pushes and all(p.get("tensors_in_pieces", 0) > 0 for p in pushes), pushes
    if sampling == CHUNKS:
        leased = [e["spans"] for e in fed.events("leased", island="island-0") if e["round"] == killed_in]
        assert len(leased) == 2 and leased[0] == leased[1]  # what the lost round read is read again, by the same
        _each_sequence_once(fed, ROUNDS)


def _each_sequence_once(fed: Federation, rounds: int) -> None:
    """Under chunks: summary.json counts what every round of both islands read, once, none lost, and the rest of the
    pass unread."""
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    consumed = rounds * 2 * H * 8  # rounds x islands x inner steps x batch_size
    assert (summary["sequences_consumed"], summary["sequences_repeated"], summary["sequences_lost"]) == (
        consumed,
        0,
        0,
    )
    (layout,) = fed.events("chunks_layout")
    assert summary["sequences_unread"] == layout["sequences"] - consumed > 0


REFORM_ROUNDS = 4
LOST_AT = "island-0:before_push:1"
"""Both processes trained round 1; process 0 stops before its push, and process 1's host is lost there (its round-1
checkpoint complete)."""
ALONE_AT = "island-0:after_adopt:2"
"""Process 0 alone trained round 1 again and adopted its commit: a process 1 of another config comes here."""
BACK_AT = "island-0:after_adopt:3"
"""Process 0 alone trained round 2 too: the lost process 1 comes back here, and the island re-forms as two."""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.bench  # a minute: the suite's 15 minutes keep its sibling below (a killed follower) in CI
@pytest.mark.parametrize("sampling", [pytest.param([], id="windows"), pytest.param(CHUNKS, id="chunks")])
def test_an_island_goes_on_without_a_lost_process_and_grows_back(
    tmp_path: Path,
    tiny_config: Path,
    feds: list,
    simulated: Callable[[Sequence[str]], subprocess.Popen[str]],
    sampling: list[str],
) -> None:
    """island-0 as processes 0 and 1, each under its own supervisor as on two hosts. Process 1's host is lost for
    good (supervisor and worker SIGKILLed): process 0 restarts, waits islands.regroup_wait_s for it in vain, and the
    island goes on as one process on half the devices; its rounds commit. A process 1 of another config is refused
    in one line. The real process 1 comes back: at the round's end the island re-forms as two and trains the last
    round so. Every island's θ equals the coordinator's after every round, and the loss curve is the one-process
    reference's: the island of one process trained on the batches the whole island would have (with chunks, the
    spans process 0 leased, each sequence consumed once)."""
    run = [*RUN, *sampling, f"train.rounds={REFORM_ROUNDS}", "islands.regroup_wait_s=2"]  # a key's later value wins
    reference = simulated(run)
    fed = Federation(
        tiny_config,
        [*run, "islands.devices=2"],
        tmp_path / "fed",
        cwd=REPO,
        env=ENV,
        jax_cache=JAX_CACHE,
        pause_at=[LOST_AT, ALONE_AT, BACK_AT],
    )
    feds.append(fed)
    fed.start_coordinator()
    island = fed.island_dir("island-0")
    group = fed.group_args("island-0", 2)
    host_1 = fed.island_argv("island-0", [*group, "--process-id", "1"], supervised=True)
    at = host_1.index("--coordinator")
    del host_1[at : at + 2]  # a follower only: without the coordinator's address it never takes the island over
    ready = FormationFiles(island, 2).candidates  # process 1, alive and ready to join

    fed.spawn("island-0-host-1", host_1)
    fed.wait_for(ready, WAIT_S, "process 1 ready")  # the island's first formation is whole, not a race
    fed.start_island("island-0", args=[*group, "--process-id", "0"], supervised=True)
    fed.start_island("island-1", env=devices_env(2))
    fed.paused(LOST_AT, WAIT_S)
    fed.wait_for(lambda: "1" in _finished_checkpoints(fed, "island-0"), WAIT_S, "island-0's checkpoint 1")
    fed.kill("island-0-host-1", whole_group=True)
    fed.release(LOST_AT)  # its next collective fails: process 0 ends and its supervisor starts it again

    fed.paused(ALONE_AT, WAIT_S)
    formed = fed.events("formed", island="island-0")
    assert [(e["processes"], e["devices"]) for e in formed] == [([0, 1], 4), ([0], 2)], formed
    assert "island-0" in fed.wait_rounds(2, WAIT_S)[1]["islands"]  # the round process 0 trained alone committed
    other = [*fed.island_argv("island-0", [*group, "--process-id", "1"], supervised=False), "inner.lr=0.001"]
    refused = subprocess.Popen(
        [sys.executable, "-m", "diloco.cli", *other], env=fed.env, cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        fed.wait_for(ready, WAIT_S, "the other process 1 ready")
        fed.release(ALONE_AT)
        _, err = refused.communicate(timeout=WAIT_S)
    finally:
        if refused.poll() is None:
            refused.kill()
            refused.communicate()
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert refused.returncode == 2 and len(errors) == 1, err[-2000:]
    assert "process 0 refuses this process: process 1's config differs from process 0's in: inner.lr" in errors[0]

    fed.paused(BACK_AT, WAIT_S)
    fed.spawn("island-0-host-1", host_1)  # the lost host is back
    fed.wait_for(ready, WAIT_S, "process 1 ready again")
    fed.release(BACK_AT)
    fed.wait_done(WAIT_S)
    fed.stop(linger_s=20.0)

    # The island re-formed at round 3's start, from its checkpoint of round 3, and joined the coordinator again.
    _check_formations(
        fed,
        REFORM_ROUNDS,
        [([0, 1], 4), ([0], 2), ([0, 1], 4)],
        [(1, 4), (3, 12)],
        "re-forming: process 1 ready to join",
    )
    [refusal] = fed.events("process_refused", island="island-0")
    assert refusal["process"] == 1 and "inner.lr" in refusal["reason"]
    assert fed.processes()["island-0-host-1"].returncode == 0
    print(f"loss curves differ by at most {_same_curve(fed, reference, REFORM_ROUNDS):.3g}")
    if sampling:
        _each_sequence_once(fed, REFORM_ROUNDS)


TAKEOVER_ROUNDS = 4
LEADER_LOST_AT = "island-0:before_push:1"
"""Both processes trained round 1; process 0, the leader, stops before its push, and its host is lost there (its
round-1 checkpoint complete)."""
TAKEN_OVER_AT = "island-0:after_adopt:2"
"""Process 1 took the island over, trained round 1 again and adopted its commit: the old process 0 comes back here."""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_island_goes_on_under_process_1_when_process_0_is_lost_and_takes_it_back(
    tmp_path: Path, tiny_config: Path, feds: list, simulated: Callable[[Sequence[str]], subprocess.Popen[str]]
) -> None:
    """island-0 as processes 0 and 1, each under its own supervisor as on two hosts, both given the coordinator's
    address. Process 0's host is lost for good (supervisor and worker SIGKILLed at a named point): process 1's
    collective fails, its supervisor starts it again, it finds no leader and, after its islands.regroup_wait_s, takes
    the island over (run.lock), resumes from the island's checkpoint and data cursor, and the island's rounds commit
    as one process. The old process 0 comes back: run.lock is held, so it waits as a candidate and leads nothing; at
    the round's end process 1 names it successor and the island re-forms whole under it. Every island's θ equals
    the coordinator's after every round, and the loss curve is the one-process reference's: no batch was skipped or
    read twice."""
    run = [*RUN, f"train.rounds={TAKEOVER_ROUNDS}"]
    reference = simulated(run)
    fed = Federation(
        tiny_config,
        [*run, "islands.devices=2"],
        tmp_path / "fed",
        cwd=REPO,
        env=ENV,
        jax_cache=JAX_CACHE,
        pause_at=[LEADER_LOST_AT, TAKEN_OVER_AT],
    )
    feds.append(fed)
    fed.start_coordinator()
    island = fed.island_dir("island-0")
    files = FormationFiles(island, 2)
    group = fed.group_args("island-0", 2)
    # islands.regroup_wait_s is each process's own: process 0 waits for process 1 as long as it takes to start (it
    # forms as soon as it is there), process 1 waits 2 s for a lost leader before it takes the island over.
    host_0 = fed.island_argv("island-0", [*group, "--process-id", "0"], supervised=True)
    host_1 = [*fed.island_argv("island-0", [*group, "--process-id", "1"], supervised=True), "islands.regroup_wait_s=2"]

    fed.spawn("island-0", host_0)
    fed.wait_for(files.leader, WAIT_S, "process 0 leading")  # the first formation is process 0's, not a race
    fed.spawn("island-0-host-1", host_1)
    fed.start_island("island-1", env=devices_env(2))
    fed.paused(LEADER_LOST_AT, WAIT_S)
    fed.wait_for(lambda: "1" in _finished_checkpoints(fed, "island-0"), WAIT_S, "island-0's checkpoint 1")
    fed.kill("island-0", whole_group=True)  # process 0's host is gone; its follower's collective fails

    fed.paused(TAKEN_OVER_AT, WAIT_S)
    formed = fed.events("formed", island="island-0")
    assert [(e["processes"], e["devices"]) for e in formed] == [([0, 1], 4), ([1], 2)], formed
    assert "island-0" in fed.wait_rounds(2, WAIT_S)[1]["islands"]  # the round process 1 led committed
    leader = files.leader()
    assert leader is not None and leader["pid"] == int((island / "process-1.pid").read_text())
    fed.spawn("island-0", host_0)  # the old leader's host is back
    back = fed.wait_for(lambda: [c for c in files.candidates(exclude=1) if c.process == 0], WAIT_S, "process 0 back")
    assert back[0].leads  # able to lead, and yet it waits: run.lock is process 1's
    assert files.leader() == leader and len(fed.events("formed", island="island-0")) == 2
    fed.release(TAKEN_OVER_AT)
    fed.wait_done(WAIT_S)
    fed.stop(linger_s=20.0)

    # Process 1 resumed from round 1's checkpoint at its data cursor (step 4), the re-formed island from round 2's.
    _check_formations(
        fed,
        TAKEOVER_ROUNDS,
        [([0, 1], 4), ([1], 2), ([0, 1], 4)],
        [(1, 4), (2, 8)],
        "re-forming: process 0 ready to join (process 0 to lead)",
    )
    assert "restart 1/5" in fed.log_path("island-0-host-1").read_text()  # its first worker died with the leader
    print(f"loss curves differ by at most {_same_curve(fed, reference, TAKEOVER_ROUNDS):.3g}")


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


def test_a_follower_without_a_leader_gives_up_in_one_line(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Process 1 without --coordinator cannot lead, and no process 0 comes: after network.coordinator_wait_s it ends
    with one line naming what it waited for, and exit code 69, which its supervisor restarts."""
    argv = ["island", str(tiny_config), "--name", "island-0", "--no-supervise", "--run-dir", str(tmp_path / "run")]
    group = ["--process-id", "1", "--num-processes", "2", "--island-coordinator", "127.0.0.1:1234"]
    assert main([*argv, *group, "network.coordinator_wait_s=0.2"]) == 69
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == [
        "diloco: error: island island-0 process 1: no place in the island after 0.2 s (network.coordinator_wait_s) "
        "waiting for process 0 to lead the island (this process cannot: it has no --coordinator)"
    ], err
