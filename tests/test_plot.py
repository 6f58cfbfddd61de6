"""`diloco plot` (diloco/ops/plot.py): curves read from real `simulate` run directories, PNGs written, one-line errors."""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path

import pytest

from diloco.cli import main
from diloco.config import load_config
from diloco.ops.plot import ASYNC_STEPS_NOTE, Curve, axis_label, read_curve
from diloco.run.rundir import read_events
from diloco.simulator.simulate import run_simulation
from tests.conftest import TINY_TOML, write_corpus

pytestmark = pytest.mark.slow  # four tiny simulate runs (module fixture) before the first test

H, ROUNDS, COUNT = 4, 3, 2  # TINY_TOML's train.inner_steps, train.rounds, islands.count
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUNS = {
    "diloco": [],
    "sync": ["train.mode=sync"],
    "stream": ["stream.fragments=2"],
    "async": ["train.mode=async", "train.rounds=4"],
    "sft": ["workload.kind=sft", "workload.task=addition", "workload.heldout_examples=8", "workload.max_new_tokens=4"],
}
"""The run directories the tests read, by name: their overrides of the tiny config."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny real `simulate` run per entry of RUNS (in this process: the session's XLA cache makes them cheap)."""
    tmp = tmp_path_factory.mktemp("plot-runs")
    config = tmp / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp / "corpus.txt")))
    for name, overrides in RUNS.items():
        run_simulation(load_config(config, overrides), tmp / name, show_progress=False)
    return {name: tmp / name for name in RUNS}


def _commits(run_dir: Path) -> list[dict]:
    """The events that carry a commit's eval loss, in the order they were logged."""
    return [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] in ("round", "sync")]


def _check_against_events(curve: Curve, run_dir: Path) -> None:
    """Every point is an event of the run: θ_0's eval, then each commit's eval loss, tokens, bytes and time."""
    initial = read_events(run_dir / "metrics.jsonl", "eval")[0]
    commits = _commits(run_dir)
    assert len(curve.points) == len(commits) + 1
    assert curve.values == [initial["eval_loss"], *(e["eval_loss"] for e in commits)]
    assert curve.xs("tokens") == [0, *(e["tokens"] for e in commits)]
    assert curve.xs("bytes") == [0, *(e["bytes_up"] + e["bytes_down"] for e in commits)]
    assert curve.xs("wall") == [initial["t"], *(e["t"] for e in commits)]
    for axis in ("steps", "tokens", "bytes"):
        xs = curve.xs(axis)
        assert all(a < b for a, b in zip(xs, xs[1:], strict=False)), (axis, xs)
    assert curve.xs("wall") == sorted(curve.xs("wall"))


@pytest.mark.parametrize("mode", ["diloco", "sync"])
def test_reads_rounds_and_the_data_parallel_baseline(runs: dict[str, Path], mode: str) -> None:
    curve = read_curve(runs[mode])
    assert (curve.label, curve.mode) == (mode, mode)
    assert len(curve.points) == ROUNDS + 1
    assert curve.xs("steps") == [r * H for r in range(ROUNDS + 1)]  # round r commits at (r+1)·H
    _check_against_events(curve, runs[mode])


def test_streaming_plots_every_fragment_commit(runs: dict[str, Path]) -> None:
    curve = read_curve(runs["stream"])
    events = [e["event"] for e in _commits(runs["stream"])]
    assert events == ["sync", "round"] * ROUNDS  # P = 2: fragment 0's commit is a sync, fragment 1's ends the round
    assert curve.xs("steps") == [s * H / 2 for s in range(2 * ROUNDS + 1)]  # one commit every H/P steps
    _check_against_events(curve, runs["stream"])


def test_async_counts_an_update_as_its_share_of_a_round(runs: dict[str, Path]) -> None:
    curve = read_curve(runs["async"], label="a")
    assert curve.label == "a" and len(curve.points) == 4 + 1
    assert curve.xs("steps") == [u * H / COUNT for u in range(4 + 1)]  # update u at (u+1)·H/islands.count
    _check_against_events(curve, runs["async"])
    assert axis_label("steps", [curve]).endswith(ASYNC_STEPS_NOTE)
    assert ASYNC_STEPS_NOTE not in axis_label("steps", [read_curve(runs["diloco"])])


def test_reading_needs_no_matplotlib(runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert len(read_curve(runs["diloco"]).points) == ROUNDS + 1


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header, after checking it is one."""
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    return struct.unpack(">II", data[16:24])


def test_writes_a_grid_of_all_runs_and_single_axis_figures(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tmp_path / "all.png"
    dirs = [str(runs[name]) for name in RUNS]
    labels = [arg for name in RUNS for arg in ("--label", f"run {name}")]
    assert main(["plot", *dirs, "--out", str(grid), *labels, "--title", "tiny"]) == 0
    assert capsys.readouterr().out == f"wrote {grid}\n"
    grid_w, grid_h = _png_size(grid)
    for axis in ("steps", "tokens", "bytes", "wall"):
        out = tmp_path / f"{axis}.png"
        assert main(["plot", str(runs["diloco"]), str(runs["sync"]), "--x", axis, "--out", str(out)]) == 0
        assert capsys.readouterr().out == f"wrote {out}\n"
        assert _png_size(out) == (grid_w // 2, grid_h // 2)  # one panel where the grid has 2x2


def test_a_post_training_figure_is_read_from_the_events_scores(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    curve = read_curve(runs["sft"], figure="sft_exact_match")
    initial, commits = read_events(runs["sft"] / "metrics.jsonl", "eval")[0], _commits(runs["sft"])
    assert curve.values == [e["scores"]["sft_exact_match"] for e in (initial, *commits)]
    assert curve.xs("steps") == read_curve(runs["sft"]).xs("steps")  # the same points as its eval loss
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(runs["sft"]), "--figure", "sft_exact_match", "--x", "steps"]) == 0
    assert capsys.readouterr().out == "wrote sft_exact_match_vs_steps.png\n"
    assert _png_size(tmp_path / "sft_exact_match_vs_steps.png")


def test_default_output_name(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(runs["diloco"])]) == 0
    assert main(["plot", str(runs["diloco"]), "--x", "bytes"]) == 0
    assert capsys.readouterr().out == "wrote eval_loss.png\nwrote eval_loss_vs_bytes.png\n"
    assert _png_size(tmp_path / "eval_loss.png") and _png_size(tmp_path / "eval_loss_vs_bytes.png")


def _no_eval_points(runs: dict[str, Path], tmp_path: Path) -> Path:
    """A run directory that has its config but has not evaluated anything yet."""
    d = tmp_path / "fresh"
    d.mkdir()
    shutil.copy(runs["diloco"] / "config.toml", d / "config.toml")
    (d / "metrics.jsonl").write_text('{"event": "island_joined", "t": 0.1, "round": 0, "island": "island-0"}\n')
    return d


def _error_cases(runs: dict[str, Path], tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (arguments, what the one line must say)."""
    good, empty = str(runs["diloco"]), tmp_path / "empty"
    empty.mkdir()
    return {
        "missing": ([str(tmp_path / "nope")], "does not exist"),
        "a file": ([str(runs["diloco"] / "summary.json")], "is not a directory"),
        "no metrics": ([str(empty)], "has no metrics.jsonl"),
        "no eval points": ([str(_no_eval_points(runs, tmp_path))], "has no eval points"),
        "unwritable": ([good, "--out", str(tmp_path / "no" / "such" / "dir.png")], "cannot write"),
        "out is a dir": ([good, "--out", str(tmp_path)], "cannot write"),
        "labels": ([good, str(runs["sync"]), "--label", "only one"], "--label given 1 times for 2 run dirs"),
        "no such figure": ([good, "--figure", "sft_ce"], "has no 'sft_ce' point (it has only eval_loss)"),
        "another run's figure": (
            [str(runs["sft"]), "--figure", "rl_reward"],
            "has no 'rl_reward' point (its figures: eval_loss, sft_ce, sft_exact_match)",
        ),
    }


def test_errors_are_one_line(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, (args, says) in _error_cases(runs, tmp_path).items():
        assert main(["plot", *args]) == 2, name
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("diloco: error: "), (name, err)
        assert says in err, (name, err)


def test_without_matplotlib_it_says_how_to_install(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(runs["diloco"]), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'diloco[plot]'" in err
    assert not (tmp_path / "x.png").exists()
