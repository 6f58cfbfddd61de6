"""The fault model (docs/architecture.md, "Fault model") with real processes, sockets and SIGKILL.

Every test starts the same CLIs a user runs (`diloco coordinator`, `diloco island`, `diloco launch`) as separate
processes on 127.0.0.1, injects faults with real signals (SIGKILL, SIGSTOP), and asserts what survived once the
run is over (`check_run`): the coordinator committed rounds 0..R-1 exactly once each (no gap, no duplicate, even
across its own restart); every committed round holds exactly the pseudo-gradients whose pushes were accepted
(nothing half-applied); and after every committed round every island's parameter digest equals the coordinator's
(DiLoCo's bit-identical θ, arXiv 2311.08105). Scenarios are combined into few launches because each process
start costs seconds of JAX import and compilation; a persistent XLA compilation cache shared by the session's
children (tests/conftest.py) makes the restarts cheap, and the one `diloco launch` (7) is the session's shared one,
which test_secure_defaults reads too. Every kill lands at a named point (diloco/faults.py): the process stops
there, the test waits for its marker and SIGKILLs it, so what the kill interrupts is what the test says, on any
machine at any load. Waits poll the run directories' metrics.jsonl and the pause markers with generous timeouts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diloco.harness.procs import Federation, devices_env
from diloco.run.chunk_ledger import consumption
from diloco.run.rundir import read_events
from diloco.run.summary import SUMMARY_KEYS
from tests.conftest import FAST, TOKENS, WAIT_S, H, SharedLaunch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def check_run(
    fed: Federation, rounds: int, islands: list[str], tokens: int = TOKENS, fragments: int = 1
) -> list[dict[str, Any]]:
    """What every fault test asserts once the run is over; returns the coordinator's commits (with streaming, one
    per fragment: `sync` events and the round's last, `round`)."""
    coord = fed.events()
    commits = [e for e in coord if e["event"] in ("sync", "round")]

    def key(e: dict[str, Any]) -> tuple[int, int]:
        return e["round"], e.get("fragment", 0)

    # The committed sequence is complete: no gap, no duplicate (a coordinator restart reruns only the round that
    # was in flight, and its metrics forget that round's events).
    assert [key(c) for c in commits] == [(r, p) for r in range(rounds) for p in range(fragments)], commits
    # Nothing half-applied: each commit holds exactly the pushes accepted for it, each accepted once.
    pushes: dict[tuple[int, int], list[str]] = defaultdict(list)
    for e in coord:
        if e["event"] == "push":
            pushes[key(e)].append(e["island"])
            assert e["tokens"] == tokens, e
    for c in commits:
        assert c["islands"] and sorted(c["islands"]) == sorted(pushes[key(c)]), (c, pushes[key(c)])
    assert set(pushes) <= {key(c) for c in commits}
    # Bit-identical θ: every island's copy after each commit it applied equals the coordinator's (with streaming:
    # an update proves its fragment, a full pull all of θ), at every sync position (round·P + fragment).
    whole_after = {c["round"] * fragments + c.get("fragment", 0) + 1: c["digest"] for c in commits}
    fragment_after = {
        c["round"] * fragments + c.get("fragment", 0) + 1: c.get("fragment_digest", c["digest"]) for c in commits
    }
    initial: set[str] = set()
    for name in islands:
        synced = superseded_dropped(fed.events("synced", island=name))
        assert synced, f"{name} never synced"
        for s in synced:
            at = s.get("position", s["round"])
            if at == 0:
                initial.add(s["digest"])
            else:
                expected = (fragment_after if s["kind"] == "update" else whole_after)[at]
                assert s["digest"] == expected, (name, s, expected)
        assert synced[-1].get("position", synced[-1]["round"]) == rounds * fragments, (name, synced[-1])
        assert not fed.events("digest_mismatch", island=name), name
    assert len(initial) <= 1, initial
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert summary["rounds"] == rounds and summary["params_digest"] == whole_after[rounds * fragments], summary
    return commits


def superseded_dropped(synced: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An island's `synced` events without those a coordinator restart took back: commits are served before their
    checkpoint is saved (docs/architecture.md, "Commits off the critical path"), so a coordinator killed in between
    restarts behind what its islands hold, and they resync with a full θ of an earlier position. Events at later
    positions that came before such a resync were of commits that no longer exist."""
    kept: list[dict[str, Any]] = []
    for s in synced:
        at = s.get("position", s["round"])
        if s["kind"] == "full":
            kept = [k for k in kept if k.get("position", k["round"]) <= at]
        kept.append(s)
    return kept


# ---------------------------------------------------------------------------------------------------------------
# 1 + 3 + 4: an island killed mid-round and restarted; a frozen island; a rogue client against the live server.


def rogue_attacks(addr: str, run_id: str) -> list[str]:
    """Five forged messages against the live coordinator; returns the gRPC status code of each refusal.

    The rogue holds island-0's secret (a leaked credential) but not island-1's.
    """
    from floor.codec import CodecSpec
    from pytrees.encode import encode_named
    from transport import diloco_pb2 as pb
    from transport.config import TransportConfig
    from transport.errors import TransportError
    from transport.grpc_client import GrpcTransport
    from transport.tensors import decoder

    once = TransportConfig(max_attempts=1, rpc_timeout_s=20)
    codes: list[str] = []

    def refused(call: Callable[[], Any]) -> None:
        with pytest.raises(TransportError) as info:
            call()
        codes.append(info.value.code.name)

    with GrpcTransport(addr, "island-0", "not-the-secret", config=once) as wrong:
        refused(lambda: wrong.join(pb.JoinRequest(run_id=run_id, island="island-0", last_round=-1)))
    with GrpcTransport(addr, "island-0", "s0", config=once) as rogue:
        # Reading the global parameters changes nothing; it gives the rogue the exact names and shapes.
        full = rogue.pull(pb.PullRequest(run_id=run_id, island="island-0", have_round=-1, full=True))
        decode = decoder()
        named = {t.name: np.array(decode(t), np.float32) for t in full.tensors}
        # In the run's uplink codec (int8): a push in another codec is refused for that alone (INVALID_ARGUMENT).
        good = encode_named({k: np.full_like(v, 1e-3) for k, v in named.items()}, CodecSpec(kind="int8"))
        current = full.round

        def meta(island: str = "island-0", round_: int = current) -> pb.PushMeta:
            return pb.PushMeta(run_id=run_id, island=island, round=round_, tokens=TOKENS, inner_steps=H, loss=1.0)

        refused(lambda: rogue.push(meta(island="island-1"), good))  # impersonation
        first = next(iter(named))
        misshapen = encode_named({**named, first: np.zeros(named[first].size + 1, np.float32)}, CodecSpec("fp32"))
        refused(lambda: rogue.push(meta(), misshapen))
        # An int8 payload starts with its float32 block scales: a NaN scale (the decoder refuses non-finite scales).
        nan_scale = np.array([np.nan], np.float32).tobytes()
        nan = [dataclasses.replace(t, payload=nan_scale + bytes(t.payload)[4:]) if t.name == first else t for t in good]
        refused(lambda: rogue.push(meta(), nan))
        refused(lambda: rogue.push(meta(round_=current - 1), good))  # replay into a closed round
    return codes


def coordinator_state(addr: str) -> tuple[int, str]:
    from transport.config import TransportConfig
    from transport.grpc_client import GrpcTransport

    # With secrets set, Status needs an island's credentials (the run's are s0, s1).
    with GrpcTransport(addr, "island-0", "s0", config=TransportConfig(max_attempts=3, rpc_timeout_s=20)) as client:
        reply = client.status()
    return reply.round, json.loads(reply.detail_json)["params_digest"]


def test_island_killed_restarted_and_rogue_client(federation: Callable[..., Federation]) -> None:
    rounds = 8
    # A long minimum deadline: once island-1 has rejoined, a round waits for its first push (it compiles first)
    # rather than closing without it until the run ends; while it is lost, rounds close on island-0 alone at once.
    # A long lease: an island is lost here only because its presence call broke (transport/presence.py), at its
    # death or, with the coordinator's keepalive pings on, when it froze.
    # Both islands wait before their push of round 0 until the other is there too, so that both train from round 0
    # whichever process starts faster (rounds then wait for both: min_deadline_s); island-1 is killed before its
    # push of round 2; island-0 is frozen before its push of round 3, once round 2 has closed without island-1.
    pauses = ["island-0:before_push:0", "island-1:before_push:0", "island-1:before_push:2", "island-0:before_push:3"]
    fed = federation(
        f"train.rounds={rounds}",
        "quorum.min_islands=1",
        'network.secrets=["s0", "s1"]',
        "quorum.min_deadline_s=15",
        "quorum.lease_s=60",
        "transport.keepalive_s=1",
        pause_at=pauses,
    )
    fed.start_coordinator()
    fed.start_island("island-0", args=["--secret", "s0"])
    fed.start_island("island-1", args=["--secret", "s1"])
    fed.release_together(["island-0:before_push:0", "island-1:before_push:0"], WAIT_S)

    # SIGKILL island-1 after it trained round 2, before its push, once a checkpoint of it is complete (islands save
    # on a background thread, which goes on while the island waits at the point).
    fed.paused("island-1:before_push:2", WAIT_S)
    fed.wait_for(lambda: _finished_checkpoints(fed, "island-1"), WAIT_S, "a finished checkpoint of island-1")
    fed.kill("island-1")  # its kernel closes its connections: the presence call breaks at once
    mark = len(fed.events())
    fed.wait_for(lambda: lost_since(fed, mark, "island-1"), WAIT_S, "island-1 lost")
    alone = fed.wait_for(
        lambda: [c for c in fed.events()[mark:] if c["event"] == "round" and c["islands"] == ["island-0"]],
        WAIT_S,
        "a round closed by island-0 alone",
    )[0]
    assert alone["round"] == 2, alone

    # Freeze island-0 (SIGSTOP: a hung host; nothing is closed, nothing answers) before its push of round 3, until
    # it is lost too: the coordinator's keepalive pings go unanswered and close its connection. Nobody can push,
    # θ cannot move.
    fed.paused("island-0:before_push:3", WAIT_S)
    fed.signal("island-0", signal.SIGSTOP)
    mark = len(fed.events())
    fed.wait_for(lambda: lost_since(fed, mark, "island-0"), WAIT_S, "island-0 lost")
    before = coordinator_state(fed.address)
    assert before[0] == 3, before
    n_rejected = len(fed.events(event="rejected"))
    codes = rogue_attacks(fed.address, "test")
    # The replay names round 2, which island-0 pushed (alone): a different payload for an accepted push.
    assert codes == [
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "ALREADY_EXISTS",
    ], codes
    assert coordinator_state(fed.address) == before, "a rejected message changed the global parameters"
    rejected = fed.events(event="rejected")[n_rejected:]
    assert len(rejected) == 5 and all(e["island"] == "island-0" for e in rejected), rejected
    for code, event in zip(codes, rejected, strict=True):
        assert event["reason"].startswith(code), (code, event)

    # Restart island-1 with the same command and run dir; thaw island-0 once island-1 is back in.
    mark = len(fed.events())
    fed.start_island("island-1", args=["--secret", "s1"])
    fed.wait_for(
        lambda: [e for e in fed.events()[mark:] if e["event"] == "island_joined"], WAIT_S, "island-1 to rejoin"
    )
    fed.signal("island-0", signal.SIGCONT)
    fed.release("island-0:before_push:3")
    resumed = fed.wait_for(lambda: fed.events("resumed", island="island-1"), WAIT_S, "island-1 to resume")[0]
    # Its own checkpoint: the round it had reached, and its inner step counter as it was when it trained that round.
    started = {e["round"]: e["step"] for e in fed.events("train_start", island="island-1")}
    assert resumed["round"] >= 1 and resumed["step"] == started[resumed["round"]] > 0, (resumed, started)
    back = fed.wait_for(
        lambda: [c for c in fed.events()[mark:] if c["event"] == "round" and "island-1" in c["islands"]],
        WAIT_S,
        "a round with island-1 again",
    )[0]
    fed.wait_exit(WAIT_S)

    commits = check_run(fed, rounds, ["island-0", "island-1"])
    between = commits[commits.index(alone) : commits.index(back)]
    assert between and all("island-1" not in c["islands"] for c in between)
    assert fed.events("joined", island="island-1")[-1]["round"] >= resumed["round"]
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert summary["islands_lost"] >= 2 and summary["rejected"] >= 5, summary
    # Both were noticed from their presence call, long before the 60 s lease: killed and frozen alike.
    lost = {e["island"]: e["reason"] for e in fed.events("island_lost")}
    assert all("its connection broke" in lost[name] for name in ("island-0", "island-1")), lost


def lost_since(fed: Federation, mark: int, island: str) -> bool:
    return any(e["event"] == "island_lost" and e["island"] == island for e in fed.events()[mark:])


# ---------------------------------------------------------------------------------------------------------------
# 2 + 6 + 4: the coordinator killed and restarted on the same port; a supervised worker killed; an island
# restarted on fewer devices.


def test_coordinator_restart_supervisor_and_fewer_devices(federation: Callable[..., Federation]) -> None:
    rounds = 9
    # The coordinator dies with round 2 in flight: island-1 pushed into it, island-0 waits before its push. Both
    # islands die before their pushes of round 4.
    pauses = ["island-0:before_push:2", "island-0:before_push:4", "island-1:before_push:4"]
    fed = federation(
        f"train.rounds={rounds}", "quorum.min_islands=2", "islands.devices=2", "train.microbatch=2", pause_at=pauses
    )
    fed.start_coordinator()
    fed.start_island("island-0", env=devices_env(2), supervised=True)
    fed.start_island("island-1", env=devices_env(2))

    # Coordinator: SIGKILL once round 1's checkpoint (θ_2) is on disk and round 2 holds island-1's push only;
    # restart on the same address with the same run dir.
    fed.paused("island-0:before_push:2", WAIT_S)
    fed.wait_for(
        lambda: [e for e in fed.events("push") if e["round"] == 2 and e["island"] == "island-1"],
        WAIT_S,
        "island-1's push of round 2",
    )
    fed.wait_for(lambda: "2" in _finished_checkpoints(fed, "coordinator"), WAIT_S, "the coordinator's checkpoint 2")
    fed.kill("coordinator")
    logged = len(fed.rounds())
    synced_before = max(e["round"] for name in ("island-0", "island-1") for e in fed.events("synced", island=name))
    assert logged == synced_before == 2, (logged, synced_before)
    pre_kill = fed.rounds()  # read before the restart drops the events of the round that was in flight
    fed.start_coordinator()
    resumed = fed.wait_for(lambda: fed.events(event="resumed"), WAIT_S, "the coordinator to resume")[0]
    # The round in flight is lost; island-1, whose push went with it, pushes again, island-0 for the first time.
    assert resumed["round"] == 2, resumed
    fed.release("island-0:before_push:2")
    fed.wait_for(lambda: [c for c in fed.rounds() if c["round"] == 2], WAIT_S, "round 2 committed after the restart")

    # Island-0 is supervised: SIGKILL its worker; the supervisor starts a new one. Island-1 loses a device:
    # SIGKILL, then restart it where only one host device exists. Both die before their pushes of round 4, once
    # each has finished saving a round after the coordinator's restart (islands save on a background thread).
    worker = fed.paused("island-0:before_push:4", WAIT_S)["pid"]  # the supervisor's worker stopped there
    fed.paused("island-1:before_push:4", WAIT_S)
    fed.wait_for(
        lambda: all(
            any(int(step) > resumed["round"] for step in _finished_checkpoints(fed, name))
            for name in ("island-0", "island-1")
        ),
        WAIT_S,
        "both islands to save a round after the coordinator's restart",
    )
    supervisor_dir = fed.island_dir("island-0")
    assert int((supervisor_dir / "worker.pid").read_text()) == worker
    n_resumed0 = len(fed.events("resumed", island="island-0"))
    commits_before = len(fed.wait_rounds(4, WAIT_S))
    assert commits_before == 4, fed.rounds()  # nobody pushed round 4
    os.kill(worker, signal.SIGKILL)
    fed.kill("island-1")
    fed.start_island("island-1", env=devices_env(1))
    fed.wait_for(
        lambda: (supervisor_dir / "worker.pid").read_text().strip() not in ("", str(worker)), WAIT_S, "a new worker"
    )
    fed.wait_for(
        lambda: len(fed.events("resumed", island="island-0")) > n_resumed0, WAIT_S, "island-0's new worker to resume"
    )
    reduced = fed.wait_for(
        lambda: fed.events("devices_reduced", island="island-1"), WAIT_S, "island-1 on fewer devices"
    )[0]
    assert reduced["configured"] == 2 and reduced["available"] == 1, reduced
    fed.wait_for(lambda: fed.events("resumed", island="island-1"), WAIT_S, "island-1 to resume")
    fed.wait_exit(WAIT_S)

    commits = check_run(fed, rounds, ["island-0", "island-1"])
    # min_islands=2: every round, before and after each fault, holds both islands, and island-1 kept its batch
    # (tokens per push, checked in check_run) by accumulating microbatches on one device.
    assert all(c["islands"] == ["island-0", "island-1"] for c in commits)
    assert len(commits) > commits_before
    assert [c["round"] for c in pre_kill] == list(range(logged))
    for old in pre_kill[: resumed["round"]]:
        assert old["digest"] == commits[old["round"]]["digest"], "a committed round changed after the restart"


def test_coordinator_restarts_behind_its_islands(federation: Callable[..., Federation]) -> None:
    """train.checkpoint_every=2: a coordinator killed after committing round 2 restarts from round 2's checkpoint
    (θ_2) while its islands already hold θ_3. They must not wait for a round the coordinator will never close:
    their push is refused ("in the future"), they resync with the full θ_2 and the run completes."""
    rounds = 6
    # Both islands stop once they hold θ_3: nobody can push round 3, so the coordinator cannot commit it before the
    # kill, however the machine schedules them.
    holding_3 = ["island-0:after_adopt:3", "island-1:after_adopt:3"]
    fed = federation(f"train.rounds={rounds}", "quorum.min_islands=2", "train.checkpoint_every=2", pause_at=holding_3)
    fed.start_coordinator()
    fed.start_island("island-0")
    fed.start_island("island-1")
    for entry in holding_3:
        fed.paused(entry, WAIT_S)
    # θ_2's checkpoint is complete (it is saved on the settle thread, after round 1's commit).
    fed.wait_for(lambda: "2" in _finished_checkpoints(fed, "coordinator"), WAIT_S, "the coordinator's checkpoint 2")
    fed.wait_rounds(3, WAIT_S)
    fed.kill("coordinator")
    assert len(fed.rounds()) == 3  # min_islands=2 and both islands wait to train round 3
    fed.start_coordinator()
    resumed = fed.wait_for(lambda: fed.events(event="resumed"), WAIT_S, "the coordinator to resume")[0]
    assert resumed["round"] == 2, resumed
    for entry in holding_3:
        fed.release(entry)
    fed.wait_exit(WAIT_S)

    commits = fed.rounds()
    assert [c["round"] for c in commits] == list(range(rounds))
    digest_after = {c["round"] + 1: c["digest"] for c in commits}
    for name in ("island-0", "island-1"):
        events = fed.events(island=name)
        dropped = [e for e in events if e["event"] == "push_dropped" and "future" in e["reason"]]
        assert dropped, f"{name} never noticed the coordinator went back"
        resync = [e for e in after_event(events, dropped[-1]) if e["event"] == "synced"]
        assert resync[0]["round"] == 2 and resync[0]["kind"] == "full", resync[0]
        assert [e["digest"] for e in resync[1:]] == [digest_after[e["round"]] for e in resync[1:]]
        assert resync[-1]["round"] == rounds


def after_event(events: list[dict[str, Any]], marker: dict[str, Any]) -> list[dict[str, Any]]:
    return events[events.index(marker) + 1 :]


# ---------------------------------------------------------------------------------------------------------------
# 5 + 4: seeded chaos.


def _finished_checkpoints(fed: Federation, name: str) -> list[str]:
    """The complete checkpoint steps of island `name`, or of the coordinator."""
    ckpt = (
        fed.run_dir / "checkpoints" / "coordinator" if name == "coordinator" else fed.island_dir(name) / "checkpoints"
    )
    return [p.name for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.is_dir() else []


@pytest.mark.parametrize(
    ("n_kills", "fragments"),
    [(3, 2), pytest.param(5, 1, marks=pytest.mark.bench)],  # the longer soak: `pytest -m bench`
    ids=["3kills-streaming", "5kills"],
)
@pytest.mark.parametrize("seed", [int(os.environ.get("DILOCO_CHAOS_SEED", "7"))])
def test_chaos_random_kills(federation: Callable[..., Federation], seed: int, n_kills: int, fragments: int) -> None:
    """3 islands, min 2 per round, 18 rounds; `n_kills` seeded islands SIGKILLed at a named point each (before
    their push of a seeded round in the first half, or the first round they reach after it: diloco/faults.py), and
    restarted at once or once the coordinator counted them lost (seeded). Depending on how the kills fall, a round
    closes without the dead island once it is lost or at the adaptive deadline, waits below quorum when two are
    dead, or the island is back in time. No island pushes the last round before every island reached it: the run
    cannot end before a restarted island is back. Each kill costs a restart and rounds held to a lease or
    deadline: README's test command runs 3 kills with Streaming DiLoCo (2 fragments, τ = 1: every kill falls with
    a fragment in flight), `pytest -m bench` the 5-kill soak of plain rounds."""
    rounds = 18
    names = ["island-0", "island-1", "island-2"]
    rng = random.Random(seed)
    plan = [
        (f"{rng.choice(names)}:before_push:{r}+", rng.choice(["at once", "once lost"]))
        for r in sorted(rng.sample(range(1, rounds // 2 - 1), n_kills))
    ]
    last = [f"{name}:before_push:{rounds - 1}+" for name in names]
    fed = federation(
        f"train.rounds={rounds}",
        "islands.count=3",
        "quorum.min_islands=2",
        "quorum.max_deadline_s=4",
        "train.inner_steps=2",
        f"stream.fragments={fragments}",
        f"stream.overlap_steps={fragments - 1}",
        pause_at=[entry for entry, _ in plan] + last,  # a kill's entry first: it stops there first
    )
    fed.start_coordinator()
    for name in names:
        fed.start_island(name)

    restarts: dict[
        str, int
    ] = {}  # island -> the index of the coordinator's event log at its kill, to restart once lost
    kills: list[tuple[int, str]] = []
    expect_resume: list[tuple[str, int]] = []

    def restart_lost() -> None:
        for name, mark in list(restarts.items()):
            if lost_since(fed, mark, name):
                fed.start_island(name)
                del restarts[name]

    for entry, restart in plan:
        victim = entry.split(":")[0]

        def reached(entry: str = entry) -> dict[str, Any] | None:
            restart_lost()  # a restart never waits for a commit: below quorum, none comes
            return fed.pauses.reached(entry)

        fed.wait_for(reached, WAIT_S, f"a stop at {entry}")
        fed.kill(victim)
        kills.append((len(fed.rounds()), victim))
        if _finished_checkpoints(fed, victim):  # orbax renames a step's directory to its number when complete
            expect_resume.append((victim, len(fed.events("resumed", island=victim))))
        if restart == "at once":
            fed.start_island(victim)
        else:
            restarts[victim] = len(fed.events())
    fed.wait_for(lambda: restart_lost() or not restarts, WAIT_S, "the last restarts")
    for entry in last:  # every island is back and holds θ of the last round: only now may the run end
        fed.paused(entry, WAIT_S)
    for entry in last:
        fed.release(entry)
    fed.wait_exit(2 * WAIT_S)

    assert len(kills) == n_kills, kills
    check_run(fed, rounds, names, tokens=8 * 16 * 2 // fragments, fragments=fragments)
    for victim, resumes_before in expect_resume:
        assert len(fed.events("resumed", island=victim)) > resumes_before, (
            f"{victim} did not resume from its checkpoint"
        )


# ---------------------------------------------------------------------------------------------------------------
# 7: without faults, the federation over real sockets computes exactly what the one-process simulation does.


def test_launch_equals_simulate(shared_launch: SharedLaunch) -> None:
    """`diloco launch` and `diloco simulate` of one run (tests/conftest.py: the session's shared launch, with island
    secrets and mutual TLS, and a simulate that ran beside it; 3 rounds, int8 both ways, every round holding every
    island, as in the simulation; each island's parameters split over its 2 devices, some leaves pushed as pieces)
    end with the same parameters and losses."""
    assert shared_launch.returncode == 0, f"launch failed: {shared_launch.stderr[-3000:]}"
    assert shared_launch.simulate_returncode == 0, f"simulate failed: {shared_launch.simulate_stderr[-3000:]}"
    launched = json.loads((shared_launch.run_dir / "summary.json").read_text())
    simulated = json.loads((shared_launch.simulate_dir / "summary.json").read_text())
    assert launched["rounds"] == simulated["rounds"] == 3
    assert tuple(launched) == tuple(simulated) == SUMMARY_KEYS  # one summary writer for both modes
    assert launched["params_digest"] == simulated["params_digest"]
    assert launched["final_eval_loss"] == pytest.approx(simulated["final_eval_loss"], rel=1e-6)
    for name in ("island-0", "island-1"):
        synced = read_events(shared_launch.run_dir / "islands" / name / "metrics.jsonl", "synced")
        assert synced[-1]["round"] == 3 and synced[-1]["digest"] == simulated["params_digest"]
    pushes = read_events(shared_launch.run_dir / "metrics.jsonl", "push")
    assert len(pushes) == 6 and all(p.get("tensors_in_pieces", 0) > 0 for p in pushes), pushes


# ---------------------------------------------------------------------------------------------------------------
# 8: Streaming DiLoCo over real sockets: fragments synced in turn on a wire thread while islands train on, merged
# τ steps later, each fragment's copy proved bit-identical, and the same floats as the one-process simulation.


@pytest.mark.parametrize("alpha", ["0.5", "0"])  # α = 0 merges the leaves the pull lane placed (IslandWorker._prepare)
def test_streaming_federation_equals_simulate(
    federation: Callable[..., Federation], tiny_config: Path, tmp_path: Path, alpha: str
) -> None:
    from diloco.config import load_config
    from diloco.simulator.simulate import run_simulation

    rounds = 3
    stream = [
        "stream.fragments=2",
        "stream.overlap_steps=1",
        f"stream.merge_alpha={alpha}",
    ]  # H = 4: a sync every 2 steps
    overrides = [f"train.rounds={rounds}", "quorum.min_islands=2", *stream]  # every sync holds both islands
    fed = federation(*overrides)
    fed.start_coordinator()
    for name in ("island-0", "island-1"):
        fed.start_island(name)
    fed.wait_exit(WAIT_S)

    coord = fed.events()
    commits = [e for e in coord if e["event"] in ("sync", "round")]
    assert [(c["round"], c["fragment"]) for c in commits] == [(r, p) for r in range(rounds) for p in (0, 1)]
    assert all(sorted(c["islands"]) == ["island-0", "island-1"] for c in commits), commits
    # Each island's copy of each committed fragment is the coordinator's, bit for bit (per-fragment digests).
    committed = {(c["round"] + (c["fragment"] == 1), c["fragment"]): c["fragment_digest"] for c in commits}
    for name in ("island-0", "island-1"):
        updates = fed.events("synced", island=name)[1:]  # the first is the full θ_0
        assert [(s["round"], s["fragment"]) for s in updates] == list(committed), (name, updates)
        assert all(s["digest"] == committed[(s["round"], s["fragment"])] for s in updates), name
        assert not fed.events("digest_mismatch", island=name)
        # Overlap: each fragment's push went out and training went on before its commit was merged.
        pushes = fed.events("pushed", island=name)
        assert [(e["round"], e["fragment"]) for e in pushes] == [(r, p) for r in range(rounds) for p in (0, 1)]

    simulated = run_simulation(load_config(tiny_config, [*FAST, *overrides]), tmp_path / "sim", show_progress=False)
    launched = json.loads((fed.run_dir / "summary.json").read_text())
    assert launched["params_digest"] == simulated["params_digest"] == commits[-1]["digest"]
    assert launched["final_eval_loss"] == pytest.approx(simulated["final_eval_loss"], rel=1e-6)


# -- Asynchronous updates in the processes: each push is committed at once, weighted by its staleness; the slow island
# holds nobody up, and every island's copy after every update it pulled is the coordinator's, bit for bit.


def test_asynchronous_federation_does_not_wait_for_a_slow_island(federation: Callable[..., Federation]) -> None:
    rounds, exponent = 8, 0.5
    fed = federation(
        f"train.rounds={rounds}",
        "train.mode=async",
        "data.sampling=chunks",  # each update consumes what its island read: exactly once (below)
        "data.chunk_sequences=20",
        'islands.slowdown=["island-1=40"]',
        "outer.kind=delayed_nesterov",
        "outer.momentum_every=2",
        f"outer.staleness_exponent={exponent}",
        pause_at=(first := ["island-0:before_push:0", "island-1:before_push:0"]),
    )
    # Both islands trained their first update before either pushes it: otherwise one that starts much later on a
    # loaded machine lets the other push alone for a while (the fast one can finish the run before the slow one
    # joined, or the slow one contribute as often as the fast one: both seen).
    fed.start()
    fed.release_together(first, WAIT_S)
    fed.wait_exit(WAIT_S)

    commits = check_run(fed, rounds, ["island-0", "island-1"])
    pushes = {e["round"]: e for e in fed.events("push")}
    for c in commits:  # one island's Δ per update, weighted (1 + τ)^-a by the updates applied since its base
        (island,) = c["islands"]
        push = pushes[c["round"]]
        assert push["island"] == island and c["staleness"] == push["staleness"] == c["round"] - push["base"], (c, push)
        assert c["weight"] == round((1 + c["staleness"]) ** -exponent, 6), c
    per_island = [sum(c["islands"] == [name] for c in commits) for name in ("island-0", "island-1")]
    # The island 40x slower pushes far less often and the fast one never waits for it (a round would need both).
    assert per_island[0] > per_island[1], per_island
    consumed = [(e["round"], list(e["spans"])) for e in fed.events("chunks_consumed")]
    assert consumed == [(c["round"], c["islands"]) for c in commits]
    got = consumption(fed.events())
    assert (got.consumed, got.repeated, got.lost) == (rounds * 32, 0, 0), got


# -- Graceful stops: SIGTERM on an island leaves the federation at once (Leave, checkpoint flushed); SIGTERM on the
# coordinator checkpoints the last committed round even when its save was not due, so its restart loses nothing.


def test_sigterm_stops_an_island_and_the_coordinator_cleanly(federation: Callable[..., Federation]) -> None:
    rounds = 8
    # A long lease: only a Leave can tell the coordinator that the stopped island is gone. The coordinator's own
    # checkpoint is due only at the end (every 100 rounds), so a stop mid-run has to save one of its own.
    # Both islands wait before their push of round 0 until the other is there too (min_islands=1: else the faster to
    # start may commit rounds alone first); island-1 is stopped before its push of round 2 (or the first it reaches after, should a round
    # close without it), once it has a checkpoint; the coordinator once island-0 waits to push round 6.
    pauses = ["island-0:before_push:0", "island-1:before_push:0", "island-1:before_push:2+", "island-0:before_push:6"]
    fed = federation(
        f"train.rounds={rounds}",
        "train.checkpoint_every=100",
        "quorum.lease_s=60",
        "quorum.min_islands=1",
        pause_at=pauses,
    )
    fed.start_coordinator()
    for name in ("island-0", "island-1"):
        fed.start_island(name)
    fed.release_together(["island-0:before_push:0", "island-1:before_push:0"], WAIT_S)

    fed.paused("island-1:before_push:2+", WAIT_S)
    fed.wait_for(
        lambda: any((fed.island_dir("island-1") / "checkpoints").rglob("_CHECKPOINT_METADATA")),
        WAIT_S,
        "island-1's first checkpoint",
    )
    fed.signal("island-1", signal.SIGTERM)
    fed.release("island-1:before_push:2+")  # on to its next sync point, where it stops
    assert fed.processes()["island-1"].wait(timeout=60) == 0
    left = fed.wait_for(
        lambda: [e for e in fed.events("island_left") if e["island"] == "island-1"], WAIT_S, "island-1's Leave"
    )[0]
    assert left["reason"] == "stopped: SIGTERM", left
    assert fed.events("stopped", island="island-1")
    # The next round closed because every live island pushed, not at a deadline that waited for island-1.
    alone = fed.wait_for(lambda: [r for r in fed.rounds() if r["round"] > left["round"]], WAIT_S, "a round alone")[0]
    assert alone["islands"] == ["island-0"] and alone["reason"].startswith("all 1 live islands pushed"), alone

    # The coordinator, stopped while no checkpoint is due, with rounds 0-5 committed and nothing of round 6 pushed:
    # its last committed round is saved anyway.
    fed.paused("island-0:before_push:6", WAIT_S)
    fed.wait_rounds(6, WAIT_S)
    fed.signal("coordinator", signal.SIGTERM)
    assert fed.coordinator is not None and fed.coordinator.wait(timeout=120) == 0
    committed = len(fed.rounds())
    assert committed == 6, fed.rounds()
    assert fed.events("stopped")[-1]["reason"] == "SIGTERM"
    assert max(int(p.name) for p in (fed.run_dir / "checkpoints" / "coordinator").iterdir() if p.name.isdigit()) == (
        committed
    )
    fed.start_coordinator()
    resumed = fed.wait_for(lambda: fed.events(event="resumed"), WAIT_S, "the coordinator to resume")[0]
    assert resumed["round"] == committed, (resumed, committed)
    joins = len(fed.events("joined", island="island-1"))
    fed.start_island("island-1")  # resumes from its own checkpoint, rejoins
    # island-0 goes on only once island-1 is back: alone, it would finish the run before island-1 could join.
    fed.wait_for(lambda: len(fed.events("joined", island="island-1")) > joins, WAIT_S, "island-1 to rejoin")
    fed.release("island-0:before_push:6")
    fed.wait_exit(WAIT_S * 2)
    check_run(fed, rounds, ["island-0", "island-1"])
    assert fed.events("resumed", island="island-1")
