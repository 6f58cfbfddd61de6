"""A multi-host island's formation (diloco/worker/island_formation.py): which processes it runs on now.

The decision is a pure function over plain values, tested as a table; the files are real (flocks held by this
process's own open lock files, which a probe through another open file sees held, as another process would).
tests/test_multihost.py runs it with real processes: an island that loses a process for good and grows back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diloco import RELEASE
from diloco.config import RunConfig, load_config, to_dict
from diloco.run.rundir import RunDirLock
from diloco.worker.island_formation import (
    Candidate,
    Formation,
    FormationFiles,
    FormationRefused,
    Lead,
    announce,
    decide,
    lock_name,
    take_place,
)
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
        ([ready(3)], [(0, "lead")], {"n3": "process 3 is not a follower of an island of 3 processes (1 .. 2)"}),
        (
            [ready(1, of=2)],
            [(0, "lead")],
            {"n1": "process 1 was started for an island of 2 processes, process 0 for 3"},
        ),
        ([ready(0)], [(0, "lead")], {"n0": "process 0 is not a follower of an island of 3 processes (1 .. 2)"}),
        ([ready(1, "b"), ready(1, "a")], [(0, "lead"), (1, "a")], {}),  # one per process id, whatever the order
    ],
    ids=["whole", "any-order", "one-lost", "alone", "release", "config", "beyond-n", "other-n", "a-second-0", "twice"],
)
def test_decide(candidates: list[Candidate], members: list[tuple[int, str]], refused: dict[str, str]) -> None:
    formation = decide(Formation(4, ((0, "old"),)), 3, "lead", candidates, CONFIG, RELEASE)
    assert formation == Formation(5, tuple(members), refused)
    assert decide(None, 3, "lead", candidates, CONFIG, RELEASE).epoch == 1


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
    formation = Formation(2, ((0, "a"), (2, "c")), {"b": "why"})
    files.write(formation)
    assert files.read() == formation and formation.rank("c") == 1 and formation.rank("b") is None
    (tmp_path / "formation.json").write_text("{half")
    assert files.read() is None  # unreadable: process 0 writes a new one


def _follower(run_dir: Path, process: int, cfg: RunConfig = CFG) -> tuple[RunDirLock, str]:
    lock = RunDirLock(run_dir, role=f"island a process {process}", name=lock_name(process))
    return lock, announce(lock, process, 2, cfg)


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
            take_place(files, other, other_nonce, "a", 1)
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
        assert take_place(files, back, nonce, "a", 1) == (formation, 1)
        assert files.candidates() == []  # in the island now: no candidate of the next formation
    finally:
        back.release()
