"""`diloco bench heterogeneous`: its virtual time axis on numbers worked out by hand, its command line, and one small
end-to-end run (the published figures come from BENCHMARKS.md's command)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.bench.heterogeneous import (
    first_time_at_or_below,
    loss_at,
    round_end_times,
    run_heterogeneous_bench,
    steps_per_round,
)
from diloco.cli import main
from diloco.config import load_config
from diloco.run.rundir import read_events


def _metrics(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"t": 0.0, **e}) + "\n" for e in events))
    return path


def test_steps_per_round_counts_each_islands_inner_events(tmp_path: Path) -> None:
    inner = [
        {"event": "inner", "round": r, "island": i, "step": s}
        for r, i, s in [(0, "a", 1), (0, "a", 2), (0, "b", 1), (1, "a", 3), (1, "a", 4), (1, "b", 2), (1, "b", 3)]
    ]
    metrics = _metrics(tmp_path / "m.jsonl", [*inner, {"event": "round", "round": 0}])
    assert steps_per_round(metrics) == [{"a": 2, "b": 1}, {"a": 2, "b": 2}]


def test_a_round_lasts_until_its_slowest_island_is_done() -> None:
    # Round 0: a trained 4 steps at s = 1 (4 units), b 4 steps at s = 2 (8 units) -> ends at 8 (plain: b holds it up).
    # Round 1 (time budget): a 4 steps (4), b 2 steps (4) -> 4 more, ends at 12.
    # Round 2: a 3 steps (3), b 1 step (2) -> 3 more, ends at 15.
    steps = [{"a": 4, "b": 4}, {"a": 4, "b": 2}, {"a": 3, "b": 1}]
    assert round_end_times(steps, {"a": 1.0, "b": 2.0}) == [8.0, 12.0, 15.0]


def test_time_to_target_and_loss_at_equal_tokens_or_time() -> None:
    points = [(4.0, 100, 3.0), (8.0, 200, 2.5), (12.0, 300, 2.0)]  # (virtual time, tokens, eval loss)
    assert first_time_at_or_below(points, 2.5) == 8.0  # reached exactly at the second point
    assert first_time_at_or_below(points, 2.2) == 12.0
    assert first_time_at_or_below(points, 1.0) is None  # never
    assert loss_at(points, 250, axis=1) == 2.5  # the last point within 250 tokens
    assert loss_at(points, 12.0, axis=0) == 2.0
    assert loss_at(points, 3.0, axis=0) is None  # nothing committed by then


def test_a_bad_argument_is_one_line_and_config_may_be_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    # No CONFIG: the first override is not taken for one, and configs/convergence.toml is used (it loads, then the
    # argument check refuses before anything runs).
    assert main(["bench", "heterogeneous", "--rounds", "0", "outer.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error: bench heterogeneous: --rounds must be >= 1") and "\n" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_compares_the_three_modes_on_one_axis(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.inner_steps=4", "train.checkpoint_every=0"])
    out = run_heterogeneous_bench(cfg, tmp_path / "bench", rounds=2, islands=3, factor=2.0)
    assert out["slow_island"] == "island-2"
    # Plain: each round waits for island-2's 4 steps at 2 units each, so its 2 rounds span 16 units; the budgeted
    # run gets ceil(16 / 4.4) = 4 rounds of a 1.1·H budget, the async run every push due by 16: island-0 and
    # island-1 at 4, 8, 12, 16, island-2 at 8 and 16.
    assert out["time_span"] == 16.0 and out["rounds"] == {"plain": 2, "budgeted": 4, "async": 10}
    assert out["time_end"]["plain"] == out["time_end"]["async"] == 16.0
    assert out["tokens"]["plain"] == 2 * 3 * 4 * 8 * 16 and out["tokens"]["async"] == 10 * 4 * 8 * 16
    assert out["time_to_target"]["plain"] is not None  # plain reaches its own final loss x 1.02 by its end
    assert out["eval_loss_at_equal_tokens"]["tokens"] == out["tokens"]["plain"]
    async_rounds = read_events(tmp_path / "bench" / "async" / "metrics.jsonl", "round")
    assert [e["island"] for e in async_rounds] == [
        "island-0",
        "island-1",
        "island-0",
        "island-1",
        "island-2",
        "island-0",
        "island-1",
        "island-0",
        "island-1",
        "island-2",
    ]
    assert load_config(tmp_path / "bench" / "async" / "config.toml").outer.kind == "delayed_nesterov"
