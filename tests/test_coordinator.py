"""The coordinator's own checks, called in-process as the transport would call it after its wire-level checks.

What a push must satisfy beyond the wire (island of the run, open round, taken from θ_r, a possible token weight),
that a contribution which cannot be committed costs its island the round and never the coordinator its life, that a
Join with any config_json is refused with a reason, and that a flood of refusals writes a bounded log.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest

import diloco.coordinator.pull_answers as pull_answers_module
import diloco.coordinator.settler as settler_module
from diloco import RELEASE
from diloco.config import load_config
from diloco.coordinator.coordinator import Coordinator
from diloco.coordinator.membership import PullAnswer, PullKind, PullView
from diloco.harness.procs import wait_until
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import build_setup
from floor.codec import CodecSpec
from pytrees.digest import tree_digest
from pytrees.encode import encode_named
from pytrees.naming import flatten_named
from tests.wire_helpers import push_chunks
from transport import diloco_pb2 as pb
from transport.auth import call_metadata
from transport.chunking import payload_digest
from transport.errors import Rejected
from transport.service import DilocoService

F32_MAX = float(np.finfo(np.float32).max)


@pytest.fixture
def coordinator(tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # No island of these tests pulls or beats: each commit is evaluated at once, as `EVAL_YIELD_S` = 0 says.
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    # outer.aggregate=mean: these tests are about what the coordinator does when a round cannot be committed, which a
    # robust rule (the default, trimmed_mean) would prevent in the first place.
    cfg = load_config(tiny_config, ["quorum.min_islands=2", "train.checkpoint_every=0", "outer.aggregate=mean"])
    rd = RunDir(tmp_path / "run", cfg)
    coord = Coordinator(cfg, rd, build_setup(cfg, islands=()))
    yield coord
    coord.close()
    rd.close()


def push(coord: Coordinator, island: str, fill: float, **meta_fields) -> pb.PushReply:
    named = {k: np.full(np.shape(v), fill, np.float32) for k, v in flatten_named(coord.loop.params).items()}
    tensors = encode_named(named, CodecSpec(kind="fp32"))
    fields = {
        "run_id": coord.run_id,
        "island": island,
        "round": coord.loop.round,
        "tokens": 128,
        "loss": 1.0,
        "base_digest": bytes.fromhex(coord.world.params_digest),
        **meta_fields,
    }
    return coord.push(pb.PushMeta(**fields), tensors, named, payload_digest(tensors))


def refused(call, code: grpc.StatusCode, words: str) -> str:
    with pytest.raises(Rejected) as info:
        call()
    assert info.value.code == code and words in info.value.reason, info.value
    return info.value.reason


def test_a_push_must_belong_to_the_run_and_to_theta_r(coordinator: Coordinator) -> None:
    before = coordinator.world.params_digest
    refused(lambda: push(coordinator, "stranger", 1e-3), grpc.StatusCode.PERMISSION_DENIED, "not on this run's roster")
    refused(
        lambda: push(coordinator, "island-0", 1e-3, base_digest=b"\0" * 16),
        grpc.StatusCode.FAILED_PRECONDITION,
        "was not taken from θ_0",
    )
    refused(
        lambda: push(coordinator, "island-0", 1e-3, base_digest=b""), grpc.StatusCode.FAILED_PRECONDITION, "missing"
    )
    refused(
        lambda: push(coordinator, "island-0", 1e-3, round=1), grpc.StatusCode.FAILED_PRECONDITION, "round 0 is open"
    )
    assert coordinator.loop.pending == () and coordinator.world.params_digest == before


def test_a_claimed_token_weight_is_capped_to_what_h_steps_hold(coordinator: Coordinator) -> None:
    cfg = coordinator.cfg
    cap = cfg.train.inner_steps * cfg.train.batch_size * cfg.model.seq_len
    push(coordinator, "island-0", 1e-3, tokens=2**64 - 1)
    assert coordinator.world.totals.tokens == cap
    assert coordinator.loop._pending["island-0"].tokens == cap


def test_an_uncommittable_contribution_is_dropped_and_the_round_closes(coordinator: Coordinator) -> None:
    # float32-max values pass every wire check (finite); with nearly all the weight, the Nesterov step (lr 0.7 times
    # 1 + momentum 0.9) overflows float32 and the downlink codec refuses to encode the update.
    push(coordinator, "island-1", F32_MAX)
    push(coordinator, "island-0", 1e-3, tokens=1)  # the second push closes the round (both live islands pushed)
    assert coordinator.loop.round == 1, "the round did not close"
    commit = coordinator.window.last
    assert commit is not None and commit.islands == ("island-0",)
    assert all(np.isfinite(x).all() for x in flatten_named(coordinator.loop.params).values())
    assert coordinator.world.params_digest == tree_digest(coordinator.loop.params)
    dropped = read_events(coordinator.rd.metrics_path, "contribution_dropped")
    assert [e["island"] for e in dropped] == ["island-1"] and dropped[0]["round"] == 0


def test_a_round_left_empty_stays_open_and_a_dropped_contribution_may_not_come_back(coordinator: Coordinator) -> None:
    push(coordinator, "island-1", F32_MAX)
    with coordinator.cond:
        coordinator.committer.close(coordinator.clock(), "forced")
    assert coordinator.loop.round == 0 and coordinator.loop.pending == ()
    refused(lambda: push(coordinator, "island-1", F32_MAX), grpc.StatusCode.FAILED_PRECONDITION, "was dropped")
    # The same name with other bytes (a retrained Δ, or the real island after a forgery under its name) is heard.
    assert push(coordinator, "island-1", 1e-3).accepted
    assert push(coordinator, "island-0", 1e-3).accepted
    assert coordinator.loop.round == 1 and coordinator.admission.dropped == {}


@pytest.mark.parametrize(
    "config_json", ["0", "null", "[[1]]", "[" * 100_000 + "]" * 100_000, "{not json", '{"a": [1, {"b": {}}]}', ""]
)
@pytest.mark.slow
def test_a_join_with_any_config_json_is_refused_with_a_reason(coordinator: Coordinator, config_json: str) -> None:
    req = pb.JoinRequest(
        run_id=coordinator.run_id, island="island-0", config_digest=b"x" * 16, config_json=config_json, release=RELEASE
    )
    refused(lambda: coordinator.join(req), grpc.StatusCode.FAILED_PRECONDITION, "config differs")


@pytest.mark.parametrize(
    ("release", "named"),
    [
        ("0.0.9", "island island-0 runs diloco 0.0.9, the coordinator diloco "),
        ("", "island island-0 runs an older diloco (its join names no release), the coordinator diloco "),
        ("9" * 200, "island island-0 runs diloco 99999"),  # clipped: the reason stays one bounded line
    ],
)
@pytest.mark.slow
def test_a_join_from_another_release_is_refused_naming_both(coordinator: Coordinator, release: str, named: str) -> None:
    req = pb.JoinRequest(
        run_id=coordinator.run_id, island="island-0", config_digest=coordinator.digest, release=release
    )
    reason = refused(lambda: coordinator.join(req), grpc.StatusCode.FAILED_PRECONDITION, named)
    assert RELEASE in reason and "run one release everywhere" in reason and len(reason) < 250, reason
    assert "island-0" not in coordinator.roster  # not a member


@pytest.mark.slow
def test_a_flood_of_refusals_writes_a_bounded_log(coordinator: Coordinator) -> None:
    size_before = coordinator.rd.metrics_path.stat().st_size
    for i in range(20_000):
        coordinator.on_rejected("x" * 100_000, f"UNAUTHENTICATED: bad credentials for island {'y' * 100_000} #{i}")
    coordinator.rd._metrics.flush()
    grown = coordinator.rd.metrics_path.stat().st_size - size_before
    rejected = read_events(coordinator.rd.metrics_path, "rejected")
    assert coordinator.world.totals.rejected == 20_000
    assert len(rejected) == coordinator.events.rejections.burst
    assert grown < 10_000, grown
    assert json.dumps(rejected).count("y") < 1_000


def test_a_lone_island_that_wrecks_the_model_loses_its_round_not_the_run(coordinator: Coordinator) -> None:
    before = coordinator.world.params_digest
    for fill in (1e30, 2e30):  # finite, healthy loss reported, absurd Δ: alone in the round, again and again
        push(coordinator, "island-1", fill, loss=1.0)
        with coordinator.cond:
            coordinator.committer.close(coordinator.clock(), "forced")
        assert coordinator.settled(60)  # the commit is served at once, evaluated (and here undone) just after
        assert coordinator.world.diverged is None and coordinator.world.params_digest == before
        assert coordinator.loop.round == 0 and coordinator.loop.pending == ()
    dropped = read_events(coordinator.rd.metrics_path, "contribution_dropped")
    assert [e["island"] for e in dropped] == ["island-1"] * 2
    refused(lambda: push(coordinator, "island-1", 1e30, loss=1.0), grpc.StatusCode.FAILED_PRECONDITION, "was dropped")
    assert all("healthy island loss" in e["reason"] and "outer.lr" in e["reason"] for e in dropped)
    assert push(coordinator, "island-0", 1e-3).accepted
    with coordinator.cond:
        coordinator.committer.close(coordinator.clock(), "forced")
    assert coordinator.settled(60)
    assert coordinator.loop.round == 1 and coordinator.window.last.islands == ("island-0",)


def test_islands_whose_own_loss_exploded_stop_the_run(coordinator: Coordinator) -> None:
    push(coordinator, "island-0", 1e30, loss=1e9)
    push(coordinator, "island-1", 1e30, loss=1e9)  # closes the round: both pushed
    assert coordinator.settled(60)
    assert coordinator.world.diverged is not None and coordinator.loop.round == 0
    refused(lambda: push(coordinator, "island-0", 1e-3), grpc.StatusCode.FAILED_PRECONDITION, "diverged")


@pytest.mark.parametrize("insider_fill", [1e30, 0.0])
def test_one_island_claiming_an_exploded_loss_cannot_stop_the_run(
    coordinator: Coordinator, insider_fill: float
) -> None:
    # An insider holding island-1's secret reports an exploded loss, with a Δ that wrecks the model or with a
    # harmless one beside another wrecking Δ: the healthy island-0 disagrees, so the run goes on without the wreck.
    push(coordinator, "island-1", insider_fill, loss=1e9)
    push(coordinator, "island-0", 1e30 if insider_fill == 0.0 else 1e-3, loss=1.0)  # closes the round: both pushed
    assert coordinator.settled(60)
    assert coordinator.world.diverged is None and coordinator.loop.round == 0
    dropped = read_events(coordinator.rd.metrics_path, "contribution_dropped")
    assert [e["island"] for e in dropped] == ["island-1" if insider_fill else "island-0"], dropped
    with coordinator.cond:
        coordinator.committer.close(coordinator.clock(), "forced")
    assert coordinator.settled(60)
    assert coordinator.world.diverged is None and coordinator.loop.round == 1


def test_an_insiders_join_leave_loop_is_counted_not_logged_line_by_line(coordinator: Coordinator) -> None:
    """One island's secret lets an insider send Join and Leave in turn, each accepted: 200 pairs write at most
    MEMBERSHIP_BURST events of each kind in a minute, and the rest are counted once the minute is over."""
    from diloco.coordinator.rejections import MEMBERSHIP_BURST

    now = [1000.0]
    coordinator.clock = lambda: now[0]
    join = pb.JoinRequest(
        run_id=coordinator.run_id, island="island-0", config_digest=coordinator.digest, release=RELEASE
    )
    leave = pb.LeaveRequest(run_id=coordinator.run_id, island="island-0", reason="x" * 100)
    for _ in range(200):
        coordinator.join(join)
        coordinator.leave(leave)
    assert coordinator.world.totals.islands_joined == 200  # every join still counts
    path = coordinator.rd.metrics_path
    assert len(read_events(path, "island_joined")) == len(read_events(path, "island_left")) == MEMBERSHIP_BURST
    now[0] += 61.0
    coordinator.tick()
    (suppressed,) = read_events(path, "membership_suppressed")
    assert suppressed["counts"] == {"island_joined island-0": 190, "island_left island-0": 190}
    coordinator.join(join)  # a new minute: logged again
    assert len(read_events(path, "island_joined")) == MEMBERSHIP_BURST + 1


@pytest.mark.slow
def test_a_pull_sent_right_behind_its_push_waits_for_that_push_to_land(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An island asks for the commit as soon as its push is on the wire (`PullRequest.after_push`): the coordinator
    holds that pull while the push is still on its way, and while it streams in (`receiving`), instead of answering
    "push first"; a pull without the flag, or one whose push never lands, still hears "push first"."""
    import threading

    def pull(island: str, after_push: bool):
        req = pb.PullRequest(run_id=coordinator.run_id, island=island, have_round=0, after_push=after_push)
        return coordinator.pull(req)

    refused(lambda: pull("island-0", False), grpc.StatusCode.FAILED_PRECONDITION, "push it first")
    monkeypatch.setattr(pull_answers_module, "PUSH_LANDING_S", 0.05)
    refused(lambda: pull("island-0", True), grpc.StatusCode.FAILED_PRECONDITION, "push it first")  # it never lands

    got: dict[str, object] = {}

    def pull_in_background(island: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: got.setdefault(island, pull(island, True)), name=island)
        thread.start()
        return thread

    monkeypatch.setattr(pull_answers_module, "PUSH_LANDING_S", 30.0)
    answers: list[tuple[str, PullKind]] = []  # (the pulling island, what the coordinator decided), in order
    answer = pull_answers_module.answer_pull

    def recorded(view: PullView) -> PullAnswer:
        decided = answer(view)
        answers.append((threading.current_thread().name, decided.kind))
        return decided

    def held(thread: threading.Thread, since: int) -> None:
        """Once the coordinator decided, after the first `since` answers, that the pull of `thread` waits for the
        commit, that pull is still held (a decision seen, not a time waited)."""
        island = thread.name
        wait_until(lambda: (island, PullKind.WAIT) in answers[since:], f"{island}'s pull told to wait", 30)
        assert thread.is_alive(), f"{island}'s pull ended ({got.get(island)}) before the round closed"

    monkeypatch.setattr(pull_answers_module, "answer_pull", recorded)
    first = pull_in_background("island-0")  # asks before its push lands
    wait_until(lambda: answers, "the pull's first answer", 30)  # under the lock: the push below lands once it waits
    since = len(answers)
    push(coordinator, "island-0", 1e-3)
    held(first, since)  # the push landed, the round is still open: the pull waits for the commit
    monkeypatch.setattr(pull_answers_module, "PUSH_LANDING_S", 0.0)
    with coordinator.receiving(pb.PushMeta(run_id=coordinator.run_id, island="island-1", round=0)):
        since = len(answers)
        second = pull_in_background("island-1")  # no landing time: held because island-1's push is streaming in
        held(second, since)
        push(coordinator, "island-1", 1e-3)  # the second push closes the round
    for thread in (first, second):
        thread.join(timeout=30)
    assert coordinator.loop.round == 1
    for name in ("island-0", "island-1"):
        payload = got[name]
        assert payload.kind == "update" and payload.round == 1, payload  # type: ignore[attr-defined]
    assert coordinator.pulls.arriving == {}


@pytest.mark.slow
def test_a_commit_is_evaluated_once_its_islands_are_done_with_it(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evaluation yields to the commit's islands (`Settler._yield_to_islands`): it waits until every island
    that contributed has been sent the commit (the transport calls `PullPayload.on_done`) and, with plain rounds, says
    by heartbeat that it trains on the next round; or EVAL_YIELD_S. Both pulls share one serialized stream."""

    def pull(island: str):
        return coordinator.pull(pb.PullRequest(run_id=coordinator.run_id, island=island, have_round=0))

    def beat(island: str, round_: int) -> None:
        coordinator.heartbeat(pb.HeartbeatRequest(run_id=coordinator.run_id, island=island, round=round_))

    def evaluated() -> list[int]:
        return [e["round"] for e in read_events(coordinator.rd.metrics_path, "round")]

    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 60.0)
    push(coordinator, "island-0", 1e-3)
    push(coordinator, "island-1", 1e-3)  # closes round 0
    assert coordinator.loop.round == 1
    assert not coordinator.settled(timeout_s=0.3), "evaluated before any island received the commit"
    first, second = pull("island-0"), pull("island-1")
    assert first.kind == second.kind == "update" and first.shared is not None and first.shared is second.shared
    first.on_done()  # type: ignore[misc]
    beat("island-0", 1)
    beat("island-1", 0)  # a heartbeat from before its adopt
    assert not coordinator.settled(timeout_s=0.3), "evaluated before island-1 received the commit"
    second.on_done()  # type: ignore[misc]
    assert not coordinator.settled(timeout_s=0.3), "evaluated before island-1 trains on round 1"
    assert evaluated() == []
    beat("island-1", 1)
    assert coordinator.settled(timeout_s=30)
    assert evaluated() == [0]

    # An island that never pulls holds the evaluation up for EVAL_YIELD_S at most.
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.5)
    push(coordinator, "island-0", 1e-3)
    push(coordinator, "island-1", 1e-3)
    assert coordinator.loop.round == 2
    assert coordinator.settled(timeout_s=30)
    assert evaluated() == [0, 1]


def test_a_push_dropped_at_commit_leaves_its_island_free_to_push_a_new_delta(coordinator: Coordinator) -> None:
    """Through the service as a real push arrives: a push accepted, then dropped at commit (its update cannot be
    encoded), is refused when its bytes come again, and a new Δ of that island for the same round is heard and
    counted. Duplicates and drops are decided in one place (diloco/coordinator/push_admission.py), so no cached "accepted"
    outlives the drop and locks the island out of the round."""
    service = DilocoService(coordinator, coordinator.run_id, coordinator.model_spec, islands=coordinator.enrollment)

    def push_through(island: str, fill: float) -> pb.PushReply:
        named = {k: np.full(np.shape(v), fill, np.float32) for k, v in flatten_named(coordinator.loop.params).items()}
        meta = pb.PushMeta(
            run_id=coordinator.run_id,
            island=island,
            round=coordinator.loop.round,
            tokens=128,
            loss=1.0,
            base_digest=bytes.fromhex(coordinator.world.params_digest),
        )
        chunks = push_chunks(meta, encode_named(named, CodecSpec(kind="fp32")), 1 << 16)
        return service.push(call_metadata(island, None), chunks)

    assert push_through("island-1", F32_MAX).accepted
    with coordinator.cond:
        coordinator.committer.close(coordinator.clock(), "forced")  # the Nesterov step overflows: island-1 is dropped
    assert coordinator.loop.round == 0 and coordinator.loop.pending == ()
    refused(lambda: push_through("island-1", F32_MAX), grpc.StatusCode.FAILED_PRECONDITION, "was dropped")
    assert push_through("island-1", 1e-3).accepted, "the island is locked out of its round"
    closing = push_through("island-0", 1e-3)
    assert closing.accepted and coordinator.loop.round == 1 and coordinator.window.last is not None
    assert coordinator.window.last.islands == ("island-0", "island-1")
    assert push_through("island-0", 1e-3) == closing  # a retry after the round closed gets its original reply


def test_a_push_dropped_by_the_commit_it_triggers_is_refused_and_its_island_may_push_again(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The running coordinator's path: the only live island's push closes the round itself, the commit drops it
    (its update cannot be encoded), and the round stays open. Its reply says so, no cached "accepted" answers its
    bytes again, and a newly trained Δ is heard (before, the reply said "accepted", its retry was answered from the
    cache, and the new Δ was ALREADY_EXISTS: the island was locked out of its round)."""
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    cfg = load_config(tiny_config, ["quorum.min_islands=1", "train.checkpoint_every=0", "outer.aggregate=mean"])
    rd = RunDir(tmp_path / "run", cfg)
    coord = Coordinator(cfg, rd, build_setup(cfg, islands=()))
    try:
        service = DilocoService(coord, coord.run_id, coord.model_spec, islands=coord.enrollment)

        def push_through(fill: float) -> pb.PushReply:
            named = {k: np.full(np.shape(v), fill, np.float32) for k, v in flatten_named(coord.loop.params).items()}
            meta = pb.PushMeta(
                run_id=coord.run_id,
                island="island-1",
                round=coord.loop.round,
                tokens=128,
                loss=1.0,
                base_digest=bytes.fromhex(coord.world.params_digest),
            )
            chunks = push_chunks(meta, encode_named(named, CodecSpec(kind="fp32")), 1 << 16)
            return service.push(call_metadata("island-1", None), chunks)

        refused(lambda: push_through(F32_MAX), grpc.StatusCode.FAILED_PRECONDITION, "was dropped")
        assert coord.loop.round == 0 and coord.loop.pending == (), "the round did not stay open"
        refused(lambda: push_through(F32_MAX), grpc.StatusCode.FAILED_PRECONDITION, "was dropped")
        closing = push_through(1e-3)
        assert closing.accepted and coord.loop.round == 1, "the island is locked out of its round"
        assert coord.window.last is not None and coord.window.last.islands == ("island-1",)
    finally:
        coord.close()


@pytest.mark.slow
def test_once_the_run_is_done_it_awaits_the_islands_that_took_part_and_did_not_finish(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An island killed before the last commit and starting again finds the coordinator still there (`serve`
    lingers while `awaited_at_end` names it), hears at its join that the run is done, and leaves."""
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    cfg = load_config(tiny_config, ["train.rounds=1", "quorum.min_islands=1", "train.checkpoint_every=0"])
    rd = RunDir(tmp_path / "run", cfg)
    coord = Coordinator(cfg, rd, build_setup(cfg, islands=()))
    try:
        joins = {
            name: pb.JoinRequest(run_id=coord.run_id, island=name, config_digest=coord.digest, release=RELEASE)
            for name in ("island-0", "island-1")
        }
        for request in joins.values():
            coord.join(request)
        coord.leave(pb.LeaveRequest(run_id=coord.run_id, island="island-1", reason="killed"))
        assert coord.awaited_at_end() == ["island-1"]  # it took part, and left before the end
        push(coord, "island-0", 1e-3)  # the run's one round closes with island-0 alone
        assert coord.settled(60) and coord.done
        coord.leave(pb.LeaveRequest(run_id=coord.run_id, island="island-0", reason="done"))
        assert coord.awaited_at_end() == ["island-1"] and len(coord.roster) == 0
        assert coord.join(joins["island-1"]).state == "done"  # started again: told the run is over
        coord.leave(pb.LeaveRequest(run_id=coord.run_id, island="island-1", reason="done"))
        assert coord.awaited_at_end() == []
    finally:
        coord.close()
        rd.close()
