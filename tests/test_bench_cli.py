"""`diloco bench`: a failed benchmark is one line and exit 2, the recovery run is sized to outlast the restart, and
the failover run refuses what it cannot measure.

Nothing here runs a benchmark for real in README's test command (BENCHMARKS.md does); the federation is replaced by a
stand-in that fails. One small failover run is marked `bench` (`pytest -m bench`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench import federation as fed_bench
from diloco.bench.errors import BenchError
from diloco.cli import main
from diloco.config import load_config
from diloco.harness.procs import FederationError
from tests.conftest import REPO


def _one_line_error(capsys: pytest.CaptureFixture[str], args: list[str], *fragments: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and "\n" not in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_bad_bench_argument_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    _one_line_error(capsys, ["bench", "codec", "--size-mb", "0"], "--size-mb must be positive")
    _one_line_error(capsys, ["bench", "churn-soak", "--cycles", "1"], "--cycles must be >= 2")
    _one_line_error(capsys, ["bench", "churn-soak", "--minutes", "0"], "--minutes must be > 0")
    _one_line_error(capsys, ["bench", "codec", "--size-mb", "1", "--pieces", "7"], "--pieces 7 must cut the 64 rows")


def test_bench_codec_pieces_decode_as_the_whole() -> None:
    """`bench codec`'s pieces comparison, small: every codec's pieces give the whole encoding's values."""
    from diloco.bench.codec import run_codec_bench

    report = run_codec_bench(size_mb=1, repeats=1, pieces=4)
    assert report["pieces"]["count"] == 4
    rows = report["pieces"]["results"]
    assert sorted(r["codec"] for r in rows) == sorted(r["codec"] for r in report["results"] if r["zstd_level"] == 0)
    assert all(r["same_values"] and r["pieces_s"] > 0 and r["whole_s"] > 0 for r in rows), rows


def test_federation_failure_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Crashing:
        """Stands in for diloco.harness.procs.Federation: its coordinator dies at start, with logs in the message."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> Crashing:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def start(self) -> None:
            raise FederationError("coordinator exited with code 1: boom\n  coordinator.log (rc 1):\n    boom", "x")

    monkeypatch.setattr(fed_bench, "Federation", Crashing)
    run_dir = tmp_path / "faults"
    args = ["bench", "faults", str(REPO / "configs" / "faults.toml"), "--run-dir", str(run_dir)]
    _one_line_error(capsys, args, "coordinator exited with code 1: boom", f"logs: {run_dir / 'fault_free' / 'logs'}")


def test_bench_error_is_a_value_error() -> None:
    assert issubclass(BenchError, ValueError)


@pytest.mark.parametrize("kill_after", [1, 3, 7])
def test_recovery_run_outlasts_a_restart_of_twice_the_bound(kill_after: int) -> None:
    cfg = load_config(REPO / "configs" / "local.toml")
    bound_s = 10.08
    plan = fed_bench.plan_recovery(cfg, kill_after, bound_s)
    q = cfg.quorum
    # Rounds left after the kill, less the two before the restart and the margin, each at least min_deadline_s long
    # while the victim is a member that has not pushed: they cover the restart window.
    restart_rounds = plan.rounds - kill_after - 2 - fed_bench.RECOVERY_MARGIN_ROUNDS
    assert restart_rounds * q.min_deadline_s > plan.restart_window_s == fed_bench.RESTART_ROOM * bound_s
    # The victim stays a member through its absence: two rounds of at most max_deadline_s, then the window.
    assert plan.lease_s >= 2 * q.max_deadline_s + plan.restart_window_s
    assert plan.overrides() == [
        f"train.rounds={plan.rounds}",
        f"quorum.lease_s={plan.lease_s}",
        f"quorum.reconnect_grace_s={plan.lease_s}",
    ]
    assert load_config(REPO / "configs" / "local.toml", plan.overrides()).train.rounds == plan.rounds


def test_full_theta_bytes_counts_the_model_without_its_data() -> None:
    cfg = load_config(REPO / "configs" / "local.toml", ["data.path=/nonexistent/corpus.txt"])
    assert fed_bench.full_theta_bytes(cfg) == 4 * 118_016  # the cost model's P in BENCHMARKS.md


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--factor", "0.5"], "--factor >= 1"),
        (["--kill-after", "0"], "--kill-after must be >= 1"),
        (["--victim", "atlantis"], "victim 'atlantis' is not in islands.names"),
        (["quorum.min_islands=3"], "the run must go on without one island"),
        (["--how", "meteor"], "--how must be one of worker, host, freeze (got 'meteor')"),
        (["--how", "freeze"], "--how freeze needs transport.keepalive_s > 0"),
    ],
)
def test_failover_refuses_what_it_cannot_measure(
    extra: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "failover", str(REPO / "configs" / "local.toml"), "--run-dir", str(tmp_path / "fo"), *extra]
    _one_line_error(capsys, args, expected)
    assert not (tmp_path / "fo").exists()  # refused before any process started


@pytest.mark.bench
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_failover_run_closes_the_round_on_the_supervisors_leave(tiny_config: Path, tmp_path: Path) -> None:
    out = fed_bench.run_failover_bench(tiny_config, ["train.inner_steps=100"], tmp_path / "fo")
    assert out["victim"] == "island-1" and out["detected_by"] == "island_left: worker died (signal 9)", out
    assert out["round_islands"] == ["island-0"] and out["round_reason"].startswith("all 1 live islands pushed"), out
    # Noticed from the supervisor's Leave (`island_left`, not a lease's `island_lost`), and the round closed on it
    # (every live island pushed), before the lease and deadlines of FAILOVER_LEASE_S could have closed it: causes,
    # not seconds, so a busy machine does not fail it.
    assert out["detected_s"] <= out["survivors_stalled_s"] < fed_bench.FAILOVER_LEASE_S, out
