"""Who may take part in a run: the pure admission and retirement rules, the durable roster, and the operator's calls
over real gRPC against a real coordinator (diloco/coordinator/enrollment.py, diloco/ops/roster_ops.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import diloco.coordinator.settler as settler_module
from diloco import RELEASE
from diloco.config import ConfigError, config_digest, load_config, to_dict
from diloco.coordinator.coordinator import Coordinator
from diloco.coordinator.enrollment import (
    RETIRED_SHOWN,
    AdmissionLimits,
    Enrollment,
    EnrollmentView,
    RosterFileError,
    admission_refusal,
    overdue,
)
from diloco.coordinator.serve import _start
from diloco.deploy.tls import OPERATOR_CLIENT
from diloco.ops.roster_ops import RosterOpError, admit_island, retire_island, write_island_kit
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import build_setup
from transport import diloco_pb2 as pb
from transport.auth import OPERATOR_KEY, call_metadata, is_island_name, secret_digest
from transport.config import TransportConfig
from transport.errors import Rejected, TransportError
from transport.grpc_client import GrpcTransport, OperatorClient

pytestmark = pytest.mark.timeout(120)

D1, D2 = hashlib.sha256(b"one").digest(), hashlib.sha256(b"two").digest()
LIMITS = AdmissionLimits(max_islands=3, per_minute=2)
EMPTY = EnrollmentView(frozenset({"a"}), frozenset(), {}, frozenset(), ())
C = grpc.StatusCode


@pytest.mark.parametrize(
    ("name", "digest", "view", "code", "words"),
    [
        ("b", D1, EMPTY, None, ""),
        ("", D1, EMPTY, C.INVALID_ARGUMENT, "1 to 64 characters"),
        ("x" * 65, D1, EMPTY, C.INVALID_ARGUMENT, "1 to 64 characters"),
        ("b/../c", D1, EMPTY, C.INVALID_ARGUMENT, "[A-Za-z0-9_-]"),
        # the operator certificate's name: the new one is no island name, the old one is reserved
        (OPERATOR_CLIENT, D1, EMPTY, C.INVALID_ARGUMENT, "[A-Za-z0-9_-]"),
        ("diloco-operator", D1, EMPTY, C.INVALID_ARGUMENT, "operator certificates made by earlier releases"),
        ("b", b"short", EMPTY, C.INVALID_ARGUMENT, "secret_sha256 must be 32 bytes (got 5)"),
        ("a", D1, EMPTY, C.ALREADY_EXISTS, "'a' is already on the roster (configured)"),
        # a replayed admission of an island retired since: its credential is never taken again
        ("b", D1, EnrollmentView(frozenset({"a"}), frozenset(), {"b": "r"}, frozenset({D1}), ()), C.PERMISSION_DENIED,
         "belonged to a retired island"),
        # ... but the same name with a new credential is welcome back
        ("b", D2, EnrollmentView(frozenset({"a"}), frozenset(), {"b": "r"}, frozenset({D1}), ()), None, ""),
        ("c", D1, EnrollmentView(frozenset({"a"}), frozenset({"b", "x"}), {}, frozenset(), ()), C.RESOURCE_EXHAUSTED,
         "the roster is full: 3 islands enrolled, islands.max = 3"),
        # a retired island makes room
        ("c", D1, EnrollmentView(frozenset({"a"}), frozenset({"b", "x"}), {"x": "r"}, frozenset(), ()), None, ""),
        # a flood: 2 admissions in the last minute is the limit ...
        ("c", D1, EnrollmentView(frozenset({"a"}), frozenset(), {}, frozenset(), (50.0, 90.0)), C.RESOURCE_EXHAUSTED,
         "2 admissions in the last minute (islands.admissions_per_minute = 2); try again in 10s"),
        # ... and an admission older than a minute no longer counts
        ("c", D1, EnrollmentView(frozenset({"a"}), frozenset(), {}, frozenset(), (39.0, 90.0)), None, ""),
    ],
)  # fmt: skip
def test_admission_rules(name: str, digest: bytes, view: EnrollmentView, code: grpc.StatusCode | None, words: str):
    refusal = admission_refusal(name, digest, view, 100.0, LIMITS)
    if code is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal[0] == code and words in refusal[1], refusal


def test_islands_gone_past_the_limit_are_retired_and_zero_means_never() -> None:
    gone = {"a": 0.0, "b": 50.0, "c": 91.0}
    assert overdue(gone, 100.0, 50.0) == ["a", "b"]
    assert overdue(gone, 100.0, 0.0) == []


def test_the_roster_is_durable_private_and_keeps_no_secret(tmp_path: Path) -> None:
    book = Enrollment(["a", "b"], tmp_path, LIMITS)
    book.admit("c", D1, 3)
    assert book.retire("b", 4, "operator") and not book.retire("b", 5, "again")
    path = tmp_path / "roster.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert b"one" not in path.read_bytes(), "only the digest of a secret is kept"
    again = Enrollment(["a", "b"], tmp_path, LIMITS)  # a restarted coordinator
    assert again.names == ("a", "c") and "b" not in again and again.secret_of("c") == D1
    assert again.retirement("b") == "at round 4: operator" and again.secret_of("a") is None
    assert again.retire("c", 6, "operator")
    with pytest.raises(Rejected, match="belonged to a retired island"):
        again.admit("c", D1, 6)
    path.write_text('{"version": 1, "admitted": {"x": {"secret_sha256": "zz", "round": 0}}}')
    with pytest.raises(RosterFileError, match="roster.json: cannot read the run's roster"):
        Enrollment(["a"], tmp_path, LIMITS)


def test_a_failed_write_leaves_the_roster_as_it_was_and_says_so(tmp_path: Path) -> None:
    """Durably first, in memory after: roster.json cannot be replaced (its temporary name is taken by a directory, a
    real failure even as root), so the admission and the retirement are refused with UNAVAILABLE and change nothing
    on disk or in memory; once the run dir is fixed they go through."""
    book = Enrollment(["a", "b"], tmp_path, AdmissionLimits(max_islands=9, per_minute=9))
    book.admit("c", D1, 0)
    before = (tmp_path / "roster.json").read_bytes()
    (tmp_path / "roster.json.tmp").mkdir()
    for change in (lambda: book.admit("d", D2, 1), lambda: book.retire("b", 1, "operator")):
        with pytest.raises(Rejected) as info:
            change()
        assert info.value.code == C.UNAVAILABLE and "the roster is unchanged" in info.value.reason, info.value
    assert book.names == ("a", "b", "c") and book.retirement("b") is None and book.secret_of("d") is None
    assert (tmp_path / "roster.json").read_bytes() == before
    (tmp_path / "roster.json.tmp").rmdir()
    assert book.retire("b", 1, "operator") and book.names == ("a", "c")


def test_the_roster_file_is_renamed_into_place_and_its_directory_synced(tmp_path: Path) -> None:
    """The rename is durable only once the directory is: write_atomically syncs the directory after it (observed by
    tracing the real process's fsync calls on the directory's file descriptor)."""
    script = f"""
import os, stat
from pathlib import Path
from floor.files import write_atomically
synced = []
real = os.fsync
def fsync(fd):
    synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
    real(fd)
os.fsync = fsync
write_atomically(Path({str(tmp_path / "roster.json")!r}), "{{}}", mode=0o600)
print(synced)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[False, True]", done.stdout + done.stderr


def test_the_admission_rate_window_outlives_a_restart(tmp_path: Path) -> None:
    now = [1000.0]
    book = Enrollment(["a"], tmp_path, AdmissionLimits(max_islands=9, per_minute=2), wall=lambda: now[0])
    book.admit("b", D1, 0)
    book.admit("c", D2, 0)
    now[0] = 1010.0
    again = Enrollment(["a"], tmp_path, AdmissionLimits(max_islands=9, per_minute=2), wall=lambda: now[0])
    with pytest.raises(Rejected, match="2 admissions in the last minute"):
        again.admit("d", hashlib.sha256(b"three").digest(), 0)
    now[0] = 1061.0
    again.admit("d", hashlib.sha256(b"three").digest(), 0)
    assert again.names == ("a", "b", "c", "d")


def test_churn_leaves_the_roster_its_size_and_never_forgets_a_retired_credential(tmp_path: Path) -> None:
    """Admissions and retirements past the listed history's bound: roster.json stays the size it had once that bound
    was reached, the retired islands listed are bounded (every retired configured island, the newest admitted
    ones), the count is whole, and neither the first nor the last retired credential is accepted again (the
    1,000-cycle measurement against a coordinator is `diloco bench churn`)."""
    now = [0.0]
    book = Enrollment(["a", "b"], tmp_path, AdmissionLimits(max_islands=4, per_minute=1), wall=lambda: now[0])
    assert book.retire("b", 0, "operator")
    sizes = []
    cycles = 2 * RETIRED_SHOWN + 16  # x0 .. x79: from x10 on, every name and round listed has two digits
    for i in range(cycles):
        now[0] += 61.0
        book.admit(f"x{i}", hashlib.sha256(b"%d" % i).digest(), i)
        assert book.retire(f"x{i}", i, "operator")
        sizes.append(len((tmp_path / "roster.json").read_bytes()))
    bounded = sizes[RETIRED_SHOWN + 10 :]
    assert max(bounded) - min(bounded) <= 2, (min(bounded), max(bounded))  # a digit more in a count
    summary = book.summary()
    assert len(summary["retired"]) == RETIRED_SHOWN + 1 and "b" in summary["retired"]  # type: ignore[arg-type]
    assert summary["retired_total"] == cycles + 1 and book.names == ("a",)
    for i in (0, cycles - 1):
        now[0] += 61.0
        with pytest.raises(Rejected, match="belonged to a retired island"):
            book.admit("y", hashlib.sha256(b"%d" % i).digest(), 1000)


# -- the operator's calls, over real gRPC ----------------------------------------------------------------------


@pytest.fixture
def live(tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Coordinator, str]]:
    """A coordinator of a 2-island run as `diloco coordinator` starts it (serve._start), with island secrets and an
    operator secret, listening on a free loopback port."""
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    monkeypatch.setenv("TEST_OPERATOR", "operator-secret")
    for name in ("i0", "i1"):
        (tmp_path / name).write_text(f"secret-of-{name}")
    overrides = [
        'islands.names=["i0","i1"]',
        f'network.secrets=["file:{tmp_path / "i0"}","file:{tmp_path / "i1"}"]',
        "network.operator_secret=env:TEST_OPERATOR",
        "islands.max=3",
        "islands.admissions_per_minute=5",
        "train.checkpoint_every=0",
    ]
    cfg = load_config(tiny_config, overrides)
    rd = RunDir(tmp_path / "run", cfg)
    secrets = {"i0": "secret-of-i0", "i1": "secret-of-i1"}
    server, _, coordinator = _start(cfg, rd, "127.0.0.1:0", None, secrets, 0)
    yield coordinator, server.address
    server.stop(0)
    coordinator.close()
    rd.close()


def _join(coordinator: Coordinator, address: str, island: str, secret: str) -> pb.JoinReply:
    cfg = coordinator.cfg
    client = GrpcTransport(address, island, secret, config=TransportConfig(max_attempts=1, rpc_timeout_s=10))
    try:
        return client.join(
            pb.JoinRequest(
                run_id=cfg.run.name,
                island=island,
                last_round=-1,
                config_digest=bytes.fromhex(config_digest(cfg)),
                release=RELEASE,
            )
        )
    finally:
        client.close()


def test_an_operator_admits_an_island_that_joins_with_its_own_credential(
    live: tuple[Coordinator, str], tmp_path: Path
) -> None:
    coordinator, address = live
    run = coordinator.run_id
    kit = admit_island(address, run, "sa-east", "env:TEST_OPERATOR", tmp_path / "kit", None)
    secret_file = tmp_path / "kit" / "sa-east.secret"
    assert kit["secret"] == f"file:{secret_file}" and stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    assert secret_file.read_text() not in (tmp_path / "run" / "roster.json").read_text()
    reply = _join(coordinator, address, "sa-east", secret_file.read_text())
    assert reply.needs_full_params and "sa-east" in coordinator.roster
    # another island's secret does not open the admitted island's door, nor the other way round
    for island, secret in (("sa-east", "secret-of-i0"), ("i0", secret_file.read_text())):
        with pytest.raises(TransportError) as info:
            _join(coordinator, address, island, secret)
        assert info.value.code == C.UNAUTHENTICATED
    events = [e for e in read_events(tmp_path / "run" / "metrics.jsonl") if e["event"] == "island_admitted"]
    assert [e["island"] for e in events] == ["sa-east"]
    detail = json.loads(coordinator.status().detail_json)
    assert detail["roster"]["admitted"] == ["sa-east"] and detail["roster"]["enrolled"] == ["i0", "i1", "sa-east"]


def test_forged_replayed_and_flooding_admissions_are_refused_and_leave_nothing(
    live: tuple[Coordinator, str], tmp_path: Path
) -> None:
    coordinator, address = live
    run = coordinator.run_id
    forged = tmp_path / "forged"
    with pytest.raises(TransportError) as info:
        admit_island(address, run, "x1", "wrong-operator-secret", forged, None)
    assert info.value.code == C.UNAUTHENTICATED and "bad operator credentials" in info.value.reason
    assert not (forged / "x1.secret").exists(), "a refused admission leaves no credential behind"
    with pytest.raises(TransportError) as info:  # an island's own credential is no operator's
        with OperatorClient(address, [("x-diloco-island", "i0"), ("x-diloco-secret", "secret-of-i0")]) as client:
            client.admit(pb.AdmitRequest(run_id=run, island="x1", secret_sha256=D1))
    assert info.value.code == C.UNAUTHENTICATED and "missing operator credentials" in info.value.reason
    # a replayed admission (the same request again) is told the island is already there, and changes nothing
    request = pb.AdmitRequest(run_id=run, island="x1", secret_sha256=D1)
    with OperatorClient(address, [(OPERATOR_KEY, "operator-secret")]) as client:
        assert client.admit(request).ok
        with pytest.raises(TransportError) as info:
            client.admit(request)
        assert info.value.code == C.ALREADY_EXISTS
        # the roster is full at islands.max = 3
        with pytest.raises(TransportError) as info:
            client.admit(pb.AdmitRequest(run_id=run, island="x2", secret_sha256=D2))
        assert info.value.code == C.RESOURCE_EXHAUSTED and "islands.max = 3" in info.value.reason
        for bad, words in ((pb.AdmitRequest(run_id="other", island="x3", secret_sha256=D2), "does not match"),
                           (pb.AdmitRequest(run_id=run, island="x3", secret_sha256=b"\0" * 7), "32 bytes")):  # fmt: skip
            with pytest.raises(TransportError) as info:
                client.admit(bad)
            assert words in info.value.reason
    assert coordinator.enrollment.names == ("i0", "i1", "x1")


def test_a_retired_island_stops_counting_at_once_and_its_credential_is_refused(
    live: tuple[Coordinator, str], tmp_path: Path
) -> None:
    coordinator, address = live
    run = coordinator.run_id
    _join(coordinator, address, "i0", "secret-of-i0")
    _join(coordinator, address, "i1", "secret-of-i1")
    # an island may retire only itself, with its own credential
    with pytest.raises(TransportError) as info:
        retire_island(address, run, "i0", "", None, island_secret_ref="secret-of-i1")
    assert info.value.code == C.UNAUTHENTICATED
    with pytest.raises(TransportError) as info:
        with OperatorClient(address, [("x-diloco-island", "i1"), ("x-diloco-secret", "secret-of-i1")]) as client:
            client.retire(pb.RetireRequest(run_id=run, island="i0"))
    assert info.value.code == C.PERMISSION_DENIED and "cannot act as island 'i0'" in info.value.reason
    done = retire_island(address, run, "i1", "region closed", None, island_secret_ref="secret-of-i1")
    assert "retired" in done["detail"] and "i1" not in coordinator.roster and coordinator.roster.live == ["i0"]
    with pytest.raises(TransportError) as info:
        _join(coordinator, address, "i1", "secret-of-i1")
    assert info.value.code == C.PERMISSION_DENIED and "not on this run's roster" in info.value.reason
    with pytest.raises(TransportError) as info:
        retire_island(address, run, "i1", "", None, operator_ref="env:TEST_OPERATOR")
    assert info.value.code == C.NOT_FOUND and "was retired at round 0: region closed" in info.value.reason
    retired = [e for e in read_events(tmp_path / "run" / "metrics.jsonl") if e["event"] == "island_retired"]
    assert [(e["island"], e["reason"]) for e in retired] == [("i1", "region closed")]
    assert coordinator.world.totals.islands_retired == 1


def test_a_retired_configured_islands_secret_never_authenticates_again(
    live: tuple[Coordinator, str], tmp_path: Path
) -> None:
    """Retired means retired: the operator retires configured island i1; its old secret offered as the credential of
    a re-admission is refused, and once i1 is admitted again with a new one, only the new one authenticates."""
    coordinator, address = live
    run = coordinator.run_id
    retire_island(address, run, "i1", "region closed", None, operator_ref="env:TEST_OPERATOR")
    old = pb.AdmitRequest(run_id=run, island="i1", secret_sha256=secret_digest("secret-of-i1"))
    with OperatorClient(address, [(OPERATOR_KEY, "operator-secret")]) as client:
        with pytest.raises(TransportError) as info:
            client.admit(old)
        assert info.value.code == C.PERMISSION_DENIED and "belonged to a retired island" in info.value.reason
        fresh = pb.AdmitRequest(run_id=run, island="i1", secret_sha256=secret_digest("a-new-secret-of-i1"))
        assert client.admit(fresh).ok
    with pytest.raises(TransportError) as info:
        _join(coordinator, address, "i1", "secret-of-i1")
    assert info.value.code == C.UNAUTHENTICATED
    assert _join(coordinator, address, "i1", "a-new-secret-of-i1").round == 0


def test_without_island_secrets_only_the_operator_retires_an_island(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a run without per-island secrets anyone who reaches the coordinator may claim an island's name: a
    retirement in that name alone is refused (the island stays enrolled); the operator's goes through."""
    monkeypatch.setattr(settler_module, "EVAL_YIELD_S", 0.0)
    monkeypatch.setenv("TEST_OPERATOR", "operator-secret")
    cfg = load_config(tiny_config, ["network.operator_secret=env:TEST_OPERATOR", "train.checkpoint_every=0"])
    rd = RunDir(tmp_path / "run", cfg)
    server, _, coordinator = _start(cfg, rd, "127.0.0.1:0", None, None, 0)
    try:
        run, island = coordinator.run_id, coordinator.enrollment.names[0]
        with pytest.raises(TransportError) as info:
            with OperatorClient(server.address, call_metadata(island, None)) as client:
                client.retire(pb.RetireRequest(run_id=run, island=island, reason="hostile"))
        assert info.value.code == C.UNAUTHENTICATED and "only the operator retires it" in info.value.reason
        assert island in coordinator.enrollment
        retire_island(server.address, run, island, "region closed", None, operator_ref="env:TEST_OPERATOR")
        assert island not in coordinator.enrollment
    finally:
        server.stop(0)
        coordinator.close()
        rd.close()


def test_the_operator_certificate_names_are_no_island_names(tiny_config: Path, tmp_path: Path) -> None:
    """Today's operator certificate name is no island name; the one of earlier releases is refused wherever an island
    is named: in the config (one line naming the key), by `diloco admit` before it writes a kit, at admission."""
    assert not is_island_name(OPERATOR_CLIENT)
    with pytest.raises(ConfigError) as err:
        load_config(tiny_config, ["islands.names=[diloco-operator, b]"])
    assert str(err.value).startswith("islands.names: 'diloco-operator' is the name of operator certificates")
    assert "\n" not in str(err.value)
    with pytest.raises(RosterOpError, match="'diloco-operator' is the name of operator certificates"):
        write_island_kit(tmp_path / "kit", "diloco-operator", None)
    assert not (tmp_path / "kit").exists()


@contextlib.contextmanager
def clocked_coordinator(tiny_config: Path, run_dir: Path) -> Iterator[tuple[Coordinator, list[float]]]:
    """A coordinator (islands.retire_after_s = 30) on a clock the test moves: `now[0]`."""
    now = [0.0]
    cfg = load_config(tiny_config, ["islands.retire_after_s=30", "train.checkpoint_every=0"])
    rd = RunDir(run_dir, cfg)
    coordinator = Coordinator(cfg, rd, build_setup(cfg, ()), clock=lambda: now[0])
    try:
        yield coordinator, now
    finally:
        coordinator.close()
        rd.close()


def test_an_island_gone_longer_than_retire_after_s_is_retired(tiny_config: Path, tmp_path: Path) -> None:
    with clocked_coordinator(tiny_config, tmp_path / "run") as (coordinator, now):
        cfg = coordinator.cfg
        names = coordinator.enrollment.names
        for name in names:
            coordinator.join(pb.JoinRequest(run_id=cfg.run.name, island=name, last_round=-1,
                                            config_digest=coordinator.digest, release=RELEASE))  # fmt: skip
        coordinator.leave(pb.LeaveRequest(run_id=cfg.run.name, island=names[1], reason="host lost"))
        now[0] = 29.0
        coordinator.tick()
        assert coordinator.enrollment.names == names, "not yet"
        now[0] = 31.0
        coordinator.tick()
        assert coordinator.enrollment.names == names[:1], "the island gone 30 s is retired; the member is not"
        assert "islands.retire_after_s = 30" in (coordinator.enrollment.retirement(names[1]) or "")


def test_an_island_that_never_came_is_not_retired(tiny_config: Path, tmp_path: Path) -> None:
    """A region slow to start (a long compile, a host provisioned late) is not gone: it never took part."""
    with clocked_coordinator(tiny_config, tmp_path / "run") as (coordinator, now):
        names = coordinator.enrollment.names
        run_id = coordinator.cfg.run.name
        coordinator.admit(pb.AdmitRequest(run_id=run_id, island="sa-east", secret_sha256=bytes(32)))
        now[0] = 3600.0
        coordinator.tick()
        assert coordinator.enrollment.names == (*names, "sa-east")


def test_an_admitted_island_draws_from_the_shared_corpus_or_brings_its_own(tiny_config: Path, tmp_path: Path) -> None:
    from diloco.config import ConfigError
    from diloco.run.setup import admitted_stream

    cfg = load_config(tiny_config)
    one, other = admitted_stream(cfg, "sa-east"), admitted_stream(cfg, "af-south")
    assert one.stream_id != other.stream_id and not (one.batch_at(0) == other.batch_at(0)).all()
    own = tmp_path / "own.txt"
    own.write_bytes(b"z" * 5000)
    mine = admitted_stream(load_config(tiny_config, [f"data.own_path={own}"]), "sa-east")
    assert set(mine.batch_at(0).ravel().tolist()) == {ord("z")}, "its own source, not the shared corpus"
    cfg_own = load_config(tiny_config, [f"data.own_path={own}"])
    assert "own_path" not in json.dumps(to_dict(cfg_own)), "per process: not part of the run's identity"
    non_iid = load_config(tiny_config, [f'data.paths=["{own}", "{own}"]', 'data.path=""'])
    with pytest.raises(ConfigError, match="give the admitted island its own source"):
        admitted_stream(non_iid, "sa-east")


def test_a_retirement_that_cannot_be_written_changes_nothing_in_the_coordinator(
    tiny_config: Path, tmp_path: Path
) -> None:
    """The caller is told UNAVAILABLE (not INTERNAL), and memory agrees with disk: the island is still enrolled and a
    member, and no retirement is logged or counted."""
    with clocked_coordinator(tiny_config, tmp_path / "run") as (coordinator, now):
        run_id, island = coordinator.cfg.run.name, coordinator.enrollment.names[1]
        coordinator.join(pb.JoinRequest(run_id=run_id, island=island, last_round=-1, config_digest=coordinator.digest,
                                        release=RELEASE))  # fmt: skip
        (tmp_path / "run" / "roster.json.tmp").mkdir()
        with pytest.raises(Rejected) as info:
            coordinator.retire(pb.RetireRequest(run_id=run_id, island=island, reason="region closed"), "(operator)")
        assert info.value.code == C.UNAVAILABLE and "roster.json" in info.value.reason, info.value
        assert island in coordinator.enrollment and island in coordinator.roster
        assert coordinator.world.totals.islands_retired == 0
        assert read_events(tmp_path / "run" / "metrics.jsonl", "island_retired") == []


def test_a_retirement_by_timeout_that_cannot_be_written_is_tried_again(tiny_config: Path, tmp_path: Path) -> None:
    """The ticker's retirement after islands.retire_after_s: a failed write keeps the island enrolled and says so in
    a `retire_failed` event (the coordinator goes on); the next tick once the run dir is fixed retires it."""
    with clocked_coordinator(tiny_config, tmp_path / "run") as (coordinator, now):
        run_id, island = coordinator.cfg.run.name, coordinator.enrollment.names[1]
        coordinator.join(pb.JoinRequest(run_id=run_id, island=island, last_round=-1, config_digest=coordinator.digest,
                                        release=RELEASE))  # fmt: skip
        coordinator.leave(pb.LeaveRequest(run_id=run_id, island=island, reason="host lost"))
        (tmp_path / "run" / "roster.json.tmp").mkdir()
        now[0] = 31.0
        coordinator.tick()
        assert island in coordinator.enrollment
        failed = read_events(tmp_path / "run" / "metrics.jsonl", "retire_failed")
        assert [e["island"] for e in failed] == [island] and "roster.json" in failed[0]["reason"], failed
        (tmp_path / "run" / "roster.json.tmp").rmdir()
        coordinator.tick()
        assert island not in coordinator.enrollment and coordinator.world.totals.islands_retired == 1
