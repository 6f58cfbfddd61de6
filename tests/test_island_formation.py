"""A multi-host island's formation (diloco/worker/island_formation.py): which processes it runs on now, and which
of them leads it.

The decisions are pure functions over plain values, tested as tables; the files are real (flocks held by this
process's own open lock files, which a probe through another open file sees held, as another process would); the
waits run on an injected clock. tests/test_multihost.py runs it with real processes: an island that loses a process
for good and grows back, and one that loses its process 0 for good and goes on under process 1.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from diloco import RELEASE
from diloco.config import RunConfig, load_config, to_dict
from diloco.run.rundir import RunDirLock
from diloco.worker.island_formation import (
    POLL_S,
    Candidate,
    Follows,
    Formation,
    FormationFiles,
    FormationRefused,
    Lead,
    Leads,
    Patience,
    announce,
    decide,
    elected,
    lock_name,
    take_place,
)
from floor.errors import WaitedTooLong
from tests.conftest import REPO

CFG = load_config(REPO / "configs" / "tiny.toml", [])
CONFIG = to_dict(CFG)
OTHER = to_dict(load_config(REPO / "configs" / "tiny.toml", ["inner.lr=0.001", "train.rounds=7"]))


def ready(
    process: int, nonce: str = "", release: str = RELEASE, config: dict[str, Any] = CONFIG, of: int = 3
) -> Candidate:
    return Candidate(process, nonce or f"n{process}", release, config, of)


@pytest.mark.parametrize(
    ("candidates", "members", "refused"),
    [
        ([ready(1), ready(2)], [(0, "lead"), (1, "n1"), (2, "n2")], {}),
        ([ready(2), ready(1)], [(0, "lead"), (1, "n1"), (2, "n2")], {}),  # ranks follow the process ids
        ([ready(2)], [(0, "lead"), (2, "n2")], {}),  # process 1 lost: process 2 is rank 1
        ([], [(0, "lead")], {}),  # alone
        (
            [ready(1, release="0.0.1"), ready(2)],
            [(0, "lead"), (2, "n2")],
            {"n1": f"process 1 runs release '0.0.1', process 0 runs {RELEASE!r}"},
        ),
        (
            [ready(1, config=OTHER)],
            [(0, "lead")],
            {"n1": "process 1's config differs from process 0's in: inner.lr, train.rounds"},
        ),
        (
            [ready(3)],
            [(0, "lead")],
            {"n3": "process 3 is not a follower of process 0 in an island of 3 processes (1, 2)"},
        ),
        (
            [ready(1, of=2)],
            [(0, "lead")],
            {"n1": "process 1 was started for an island of 2 processes, process 0 for 3"},
        ),
        (
            [ready(0)],
            [(0, "lead")],
            {"n0": "process 0 is not a follower of process 0 in an island of 3 processes (1, 2)"},
        ),
        ([ready(1, "b"), ready(1, "a")], [(0, "lead"), (1, "a")], {}),  # one per process id, whatever the order
    ],
    ids=["whole", "any-order", "one-lost", "alone", "release", "config", "beyond-n", "other-n", "a-second-0", "twice"],
)
def test_decide(candidates: list[Candidate], members: list[tuple[int, str]], refused: dict[str, str]) -> None:
    formation = decide(Formation(4, ((0, "old"),)), 3, (0, "lead"), candidates, CONFIG, RELEASE, "h:1")
    assert formation == Formation(5, tuple(members), refused, "h:1")
    assert decide(None, 3, (0, "lead"), candidates, CONFIG, RELEASE).epoch == 1


def test_another_leader_comes_first_and_process_0_follows_it() -> None:
    """Process 1 took the island over: it is rank 0, the others follow by process id, process 0 included."""
    candidates = [ready(2), ready(0), ready(1, "twin")]
    formation = decide(Formation(4, ((0, "old"),)), 3, (1, "lead"), candidates, CONFIG, RELEASE)
    assert formation.members == ((1, "lead"), (0, "n0"), (2, "n2")) and formation.leader == 1
    assert formation.refused == {"twin": "process 1 is not a follower of process 1 in an island of 3 processes (0, 2)"}


@pytest.mark.parametrize(
    ("me", "preferred", "able", "waited_out", "leads"),
    [
        (0, 0, [], False, True),  # the preferred leader takes the island at once
        (1, 1, [0], False, True),  # process 1 led the last formation: it leads again, process 0 back or not
        (1, 0, [], False, False),  # process 0 may still come back
        (1, 0, [0], True, False),  # process 0 is back: it leads
        (1, 0, [], True, True),  # process 0 lost: the lowest process able to lead takes over
        (2, 0, [1], True, False),  # process 1 is lower
        (2, 0, [3], True, True),
        (1, 0, [2, 3], True, True),
    ],
    ids=["preferred", "sticky", "wait", "back", "take-over", "lower-first", "lowest", "lowest-of-many"],
)
def test_elected(me: int, preferred: int, able: list[int], waited_out: bool, leads: bool) -> None:
    why = elected(me, preferred, able, waited_out, 5.0)
    assert (why is not None) == leads
    if leads and me != preferred:
        assert why == f"process {preferred} did not lead the island within 5 s; process {me} is the lowest able to lead"


@pytest.mark.parametrize(
    "holder",
    [
        None,
        {},
        {"pid": 1},
        {"ready": 3},
        {"ready": {"process": "1", "of": 2, "nonce": "n", "release": RELEASE, "config": {}}},
        {"ready": {"process": 1, "of": 2, "nonce": "", "release": RELEASE, "config": {}}},
        {"ready": {"process": 1, "of": 2, "nonce": "n" * 65, "release": RELEASE, "config": {}}},
        {"ready": {"process": 1, "of": 2, "nonce": "n", "release": 5, "config": {}}},
        {"ready": {"process": 1, "of": 2, "nonce": "n", "release": RELEASE, "config": []}},
        {"ready": {"process": 1, "of": 2, "nonce": "n", "release": RELEASE}},
        {"ready": {"process": 1, "of": "2", "nonce": "n", "release": RELEASE, "config": {}}},
    ],
)
def test_a_malformed_lock_file_names_no_candidate(holder: dict[str, Any] | None) -> None:
    assert Candidate.read(holder) is None


def test_a_formation_reads_back_as_written(tmp_path: Path) -> None:
    files = FormationFiles(tmp_path, 3)
    assert files.read() is None
    formation = Formation(2, ((0, "a"), (2, "c")), {"b": "why"}, "127.0.0.1:5", 2)
    files.write(formation)
    assert files.read() == formation and formation.rank("c") == 1 and formation.rank("b") is None
    assert formation.leader == 0 and formation.preferred == 2
    assert files.led_by(0) and not files.led_by(2)  # process 0's supervisor speaks for the island, 2's does not
    (tmp_path / "formation.json").write_text("{half")
    assert files.read() is None  # unreadable: process 0 writes a new one


def _follower(run_dir: Path, process: int, cfg: RunConfig = CFG, leads: bool = False) -> tuple[RunDirLock, str]:
    lock = RunDirLock(run_dir, role=f"island a process {process}", name=lock_name(process))
    return lock, announce(lock, process, 2, cfg, leads)


PATIENCE = Patience(regroup_s=1.0, give_up_s=3.0)


class Clock:
    """An injected clock: each wait of `take_place` moves it on by the wait, and nothing sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _take_place(files: FormationFiles, lock: RunDirLock, nonce: str, process: int, able: bool, clock: Clock) -> Any:
    return take_place(files, lock, nonce, "a", process, PATIENCE, able, clock, clock.sleep)


def test_a_candidate_is_a_live_lock_holder_that_said_it_is_ready(tmp_path: Path) -> None:
    files = FormationFiles(tmp_path, 3)
    one, nonce = _follower(tmp_path, 1)
    two = RunDirLock(tmp_path, name=lock_name(2))  # holds its lock, not ready yet
    try:
        assert [(c.process, c.nonce) for c in files.candidates()] == [(1, nonce)]
    finally:
        one.release()
        two.release()
    assert files.candidates() == []  # the file says ready, but no one holds it: a dead process's


class Events:
    def __init__(self) -> None:
        self.logged: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.logged.append((event, fields))


def test_process_0_forms_with_those_ready_and_takes_one_back_at_a_rounds_end(tmp_path: Path) -> None:
    files, events = FormationFiles(tmp_path, 2), Events()
    lead = Lead(files, CFG, "a", events)
    assert lead.form(0.0).processes == (0,)  # process 1 not ready: the island forms alone
    assert lead.returning() is None
    other, other_nonce = _follower(tmp_path, 1, load_config(REPO / "configs" / "tiny.toml", ["inner.lr=0.001"]))
    try:
        assert lead.returning() is None and lead.returning() is None  # refused, once
        with pytest.raises(FormationRefused) as refused:
            _take_place(files, other, other_nonce, 1, False, Clock())
    finally:
        other.release()
    reason = "process 1's config differs from process 0's in: inner.lr"
    assert str(refused.value) == (
        f"island a: process 0 refuses this process: {reason} (start it with process 0's release and config)"
    )
    assert events.logged == [("process_refused", {"island": "a", "process": 1, "reason": reason})]
    back, nonce = _follower(tmp_path, 1)
    try:
        assert lead.returning() == "process 1 ready to join"
        again = Lead(files, CFG, "a", events)  # process 0 started again: the island re-forms as two at once
        formation = again.form(60.0)
        assert formation.epoch == 2 and formation.processes == (0, 1)
        assert _take_place(files, back, nonce, 1, False, Clock()) == Follows(formation, 1)
        assert files.candidates() == []  # in the island now: no candidate of the next formation
    finally:
        back.release()


def test_a_follower_takes_over_an_island_without_its_leader_after_regroup_wait_s(tmp_path: Path) -> None:
    """Process 0 lost: process 1, able to lead, waits islands.regroup_wait_s for it, then holds run.lock (no one
    else can lead while it does), forms the island first in it, and names process 0 its successor when it is back."""
    files, clock = FormationFiles(tmp_path, 2), Clock()
    files.write(Formation(3, ((0, "gone"), (1, "old"))))
    one, nonce = _follower(tmp_path, 1, leads=True)
    try:
        place = _take_place(files, one, nonce, 1, True, clock)
        assert isinstance(place, Leads) and files.leader() is not None
        assert PATIENCE.regroup_s <= clock.now < PATIENCE.regroup_s + 2 * POLL_S
        assert place.why == "process 0 did not lead the island within 1 s; process 1 is the lowest able to lead"
        assert files.candidates(exclude=1) == []  # ready no more
        lead = Lead(files, CFG, "a", Events(), process=1, service="127.0.0.1:9")
        formation = lead.form(0.0)
        assert (formation.epoch, formation.processes, formation.service) == (4, (1,), "127.0.0.1:9")
        zero, zero_nonce = _follower(tmp_path, 0, leads=True)  # the old process 0 is back: it may not lead now
        try:
            with pytest.raises(WaitedTooLong) as waited:
                _take_place(files, zero, zero_nonce, 0, True, Clock())
            pid = place.lock.info["pid"]
            assert str(waited.value) == (
                "island a process 0: no place in the island after 3 s (network.coordinator_wait_s) waiting for the "
                f"island's leader (pid {pid}) to take it in at a round's end"
            )
            assert lead.returning() == "process 0 ready to join (process 0 to lead)"
            assert files.read() == replace(formation, successor=0)
        finally:
            zero.release()
    finally:
        place.lock.release()
        one.release()
    assert files.leader() is None


@pytest.mark.parametrize(
    ("others", "able", "waits_for"),
    [
        ([], False, "process 0 to lead the island (this process cannot: it has no --coordinator)"),
        ([0], True, "process 0 or a lower process able to lead to take the island"),  # process 0 ready: it leads
    ],
    ids=["cannot-lead", "process-0-ready"],
)
def test_a_process_that_may_not_lead_waits_for_one_that_may_then_gives_up_in_one_line(
    tmp_path: Path, others: list[int], able: bool, waits_for: str
) -> None:
    files = FormationFiles(tmp_path, 3)
    held = [_follower(tmp_path, p, leads=True)[0] for p in others]
    two, nonce = _follower(tmp_path, 2, leads=able)
    clock = Clock()
    try:
        with pytest.raises(WaitedTooLong) as waited:
            _take_place(files, two, nonce, 2, able, clock)
    finally:
        for lock in [*held, two]:
            lock.release()
    assert str(waited.value) == (
        f"island a process 2: no place in the island after 3 s (network.coordinator_wait_s) waiting for {waits_for}"
    )
    assert clock.now >= PATIENCE.give_up_s and files.leader() is None


def test_a_leader_superseded_by_a_newer_formation_steps_down(tmp_path: Path) -> None:
    """Without flock (run.lock fences nothing) two processes could both lead: the older formation's leader ends at
    its round's end."""
    files = FormationFiles(tmp_path, 2)
    lead = Lead(files, CFG, "a", Events())
    formation = lead.form(0.0)
    files.write(Formation(formation.epoch + 1, ((1, "x"),)))
    assert lead.returning() == f"formation {formation.epoch + 1} of process 1 supersedes this one ({formation.epoch})"
