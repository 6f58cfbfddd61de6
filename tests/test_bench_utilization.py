"""`diloco bench utilization`'s arithmetic: the plain round's cost models (the config's links, one kernel-shaped link)
and the measured utilization, by hand; `--kernel-link`'s refusals in one line; and (`pytest -m bench`, root only) one
small end-to-end run in a kernel-shaped namespace."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench import utilization
from diloco.bench.errors import BenchError
from diloco.bench.utilization import (
    measured_utilization,
    plain_round_model,
    run_utilization_bench,
    shared_link_round_model,
)
from diloco.cli import main
from diloco.config import load_config
from diloco.harness.netns import list_namespaces, netns_available

pytestmark = pytest.mark.timeout(30)


def test_the_slowest_island_sets_everyones_period() -> None:
    # a: 1 s of steps, up 0.2, down 0.3 -> 1.5 s to its push; b: 0.5 s of steps, up 0.1, down 0.1 -> 0.7 s.
    model = plain_round_model({"a": 1.0, "b": 0.5}, {"a": 0.2, "b": 0.1}, {"a": 0.3, "b": 0.1}, close_s=0.5)
    assert model["period_s"] == pytest.approx(1.5 + 0.5)
    assert model["utilization"] == pytest.approx(((1.0 + 0.5) / 2) / 2.0)  # mean compute 0.75 s of a 2 s period
    assert model["wire_share"] == pytest.approx(0.5 / 2.0)


def test_no_link_and_no_close_is_full_utilization() -> None:
    model = plain_round_model({"a": 0.4}, {"a": 0.0}, {"a": 0.0}, close_s=0.0)
    assert model == {"period_s": pytest.approx(0.4), "utilization": pytest.approx(1.0), "wire_share": 0.0}


def test_measured_period_is_the_median_round_after_the_warm_up() -> None:
    # Round 0 commits at 20 s (start-up), round 1 at 30 s: its 10 s held the slowest island's start-up (left out).
    times = {0: 20.0, 1: 30.0, 2: 31.0, 3: 32.5, 4: 33.0, 5: 34.2}
    rounds = [{"round": r, "t": t} for r, t in reversed(times.items())]  # any order: sorted by round
    assert utilization.measured_period_s(rounds) == pytest.approx(1.1)  # median of 1.0, 1.5, 0.5, 1.2: (1.0 + 1.2) / 2
    with pytest.raises(BenchError, match="fewer than two rounds after the 2 warm-up rounds"):
        utilization.measured_period_s(rounds[-2:])


def test_measured_utilization_leaves_out_the_warm_up_rounds() -> None:
    pushes = [
        {"island": "a", "round": 0, "compute_s": 1.0, "wall_s": 30.0},  # start-up: left out
        {"island": "b", "round": 0, "compute_s": 1.0, "wall_s": 25.0},  # start-up: left out
        {"island": "a", "round": 1, "compute_s": 1.0, "wall_s": 6.0},  # waited for b's start-up: left out
        {"island": "b", "round": 1, "compute_s": 1.0, "wall_s": 2.0},  # left out
        {"island": "a", "round": 2, "compute_s": 1.0, "wall_s": 2.0},
        {"island": "b", "round": 2, "compute_s": 2.0, "wall_s": 2.0},
    ]
    assert measured_utilization(pushes) == pytest.approx(3.0 / 4.0)
    with pytest.raises(BenchError, match="raise --rounds"):
        measured_utilization(pushes[:4])


MB = 1_250_000
"""Bytes that take 1 s at 10 Mbit/s."""


@pytest.mark.parametrize(
    ("compute", "push_bytes", "pull_bytes", "close_s", "period_s", "util", "wire_share"),
    [
        # Equal islands, 1 s a transfer: pulls end at 1 and 2, steps at 2 and 3; a pushes [2, 3], b [3, 4]; + 0.5.
        ({"a": 1.0, "b": 1.0}, {"a": MB, "b": MB}, MB, 0.5, 4.5, 1.0 / 4.5, 4.0 / 4.5),
        # The slow island (b, 2 s) pulls first [0, 1], a [1, 2]; a's steps end at 2.5, b's at 3:
        # a pushes [2.5, 3.5], b [3.5, 4.5].
        ({"a": 0.5, "b": 2.0}, {"a": MB, "b": MB}, MB, 0.0, 4.5, 1.25 / 4.5, 4.0 / 4.5),
        # Long steps hide the other island's transfers: pulls [0, 0.5], [0.5, 1]; steps end at 3.5 and 4;
        # pushes of 2 s [3.5, 5.5], then [5.5, 7.5].
        ({"a": 3.0, "b": 3.0}, {"a": 2 * MB, "b": 2 * MB}, MB / 2, 0.0, 7.5, 3.0 / 7.5, 5.0 / 7.5),
        # Nothing moved: the round is compute and close alone.
        ({"a": 0.4}, {"a": 0}, 0, 0.1, 0.5, 0.8, 0.0),
    ],
)
def test_on_one_kernel_link_the_rounds_transfers_take_turns(
    compute: dict[str, float],
    push_bytes: dict[str, float],
    pull_bytes: float,
    close_s: float,
    period_s: float,
    util: float,
    wire_share: float,
) -> None:
    model = shared_link_round_model(compute, push_bytes, pull_bytes, 10.0, close_s)
    assert model == {
        "period_s": pytest.approx(period_s),
        "utilization": pytest.approx(util),
        "wire_share": pytest.approx(wire_share),
    }


def test_one_link_for_all_is_slower_than_a_link_each() -> None:
    # Two islands pushing and pulling 1 s worth each: 1 s each way on a link of their own (plain_round_model: 2 s of
    # wire a round), while on the one queue the second pull and the first push wait for the others (4 s).
    each = {"a": 1.0, "b": 1.0}
    own = plain_round_model({"a": 1.0, "b": 1.0}, each, each, close_s=0.0)
    shared = shared_link_round_model({"a": 1.0, "b": 1.0}, {"a": MB, "b": MB}, MB, 10.0, close_s=0.0)
    assert own["period_s"] == pytest.approx(3.0) and shared["period_s"] == pytest.approx(4.0)


def _one_line_error(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and says in err and "\n" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("rate", ["0", "-1", "nan", "1e6"])
def test_a_kernel_link_rate_out_of_range_is_one_line(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], rate: str
) -> None:
    args = ["bench", "utilization", str(tiny_config), "--run-dir", str(tmp_path / "b"), f"--kernel-link={rate}"]
    _one_line_error(capsys, args, "bench utilization: --kernel-link: rate_mbit must be in (0, 100000]")
    assert not (tmp_path / "b").exists()


def test_no_namespace_here_is_one_line_naming_why(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    why = "needs root (CAP_NET_ADMIN) to create network namespaces"
    monkeypatch.setattr(utilization, "netns_available", lambda: (False, why))
    args = ["bench", "utilization", str(tiny_config), "--run-dir", str(tmp_path / "b"), "--kernel-link", "20"]
    _one_line_error(capsys, args, f"--kernel-link needs a kernel-shaped network namespace: {why}")
    assert not (tmp_path / "b").exists()


_NETNS_OK, _NETNS_WHY = netns_available()


@pytest.mark.bench  # two federations in a shaped namespace (~1-2 min): run with `pytest -m bench`
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(360)
@pytest.mark.skipif(not _NETNS_OK, reason=f"kernel-shaped namespaces unavailable here: {_NETNS_WHY}")
@pytest.mark.usefixtures("shared_jax_cache")
def test_both_runs_go_through_one_kernel_shaped_namespace(tiny_config: Path, tmp_path: Path) -> None:
    before = set(list_namespaces())
    out = run_utilization_bench(tiny_config, [], tmp_path / "ut", rounds=4, fragments=2, overlap=1, kernel_link=40)
    assert out["links"] == "kernel tbf 40 Mbit/s"
    kernel = out["kernel_link"]
    assert kernel["rate_mbit"] == 40 and 20 < kernel["goodput_mbit"] <= 42, kernel
    assert kernel["namespace"].startswith("diloco-ut-") and kernel["namespace"] not in list_namespaces()
    assert set(list_namespaces()) <= before  # nothing left behind
    plain, model = out["plain"], out["plain"]["model"]
    assert 0 < plain["utilization"] <= 1 and 0 < model["utilization"] <= 1 and 0 < model["wire_share"] < 1
    assert model["parts_s"]["wire"] == pytest.approx(model["bytes"]["round"] * 8 / (kernel["goodput_mbit"] * 1e6), 0.01)
    assert 0 < out["streaming"]["utilization"] <= 1
    for run in ("plain", "streaming"):  # the user-space shaper was off in both
        assert load_config(tmp_path / "ut" / run / "config.toml").network.links == ""


def test_a_malformed_variant_is_one_line(tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "utilization", str(tiny_config), "--run-dir", str(tmp_path / "b"), "--variant", "fp32"]
    _one_line_error(capsys, args, "--variant 'fp32' must look like NAME:section.key=v")
    assert not (tmp_path / "b").exists()


@pytest.mark.bench  # four federations (~2 min): run with `pytest -m bench`
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
@pytest.mark.usefixtures("shared_jax_cache")
def test_variants_run_side_by_side_on_the_same_links(tiny_config: Path, tmp_path: Path) -> None:
    variants = ["fp32:codec.uplink=fp32,codec.downlink=fp32", "int4:codec.uplink=int4,codec.downlink=int4"]
    out = run_utilization_bench(tiny_config, [], tmp_path / "ut", rounds=4, fragments=2, overlap=1, variants=variants)
    fp32, int4 = out["variants"]["fp32"], out["variants"]["int4"]
    assert fp32["codec"] == {"uplink": "fp32", "downlink": "fp32"} and int4["codec"]["uplink"] == "int4"
    # the int4 codec's ~7.76x, index and scales in; per push (an island slow to start misses the first rounds)
    assert 7 * int4["plain"]["bytes_up_per_push"] < fp32["plain"]["bytes_up_per_push"]
    for name, pair in out["variants"].items():
        assert 0 < pair["plain"]["utilization"] <= 1 and 0 < pair["streaming"]["utilization"] <= 1
        for run in ("plain", "streaming"):
            assert load_config(tmp_path / "ut" / name / run / "config.toml").codec.uplink == name
