"""`diloco bench convergence`: per-method grids and the warm-start protocol (diloco/bench/convergence.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.bench.convergence import Point, grid_points, parse_grids, run_convergence_bench
from diloco.bench.errors import BenchError
from diloco.config import load_config


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        ([], {"L1": [], "LM": [], "Ls": []}),
        (["LM:inner.lr=1e-3,2e-3"], {"L1": [], "LM": [("inner.lr", ["1e-3", "2e-3"])], "Ls": []}),
        (
            ["all:outer.lr=0.5", "Ls:inner.lr=4e-3"],
            {
                "L1": [("outer.lr", ["0.5"])],
                "LM": [("outer.lr", ["0.5"])],
                "Ls": [("outer.lr", ["0.5"]), ("inner.lr", ["4e-3"])],
            },
        ),
    ],
)
def test_parse_grids(specs: list[str], expected: dict) -> None:
    assert parse_grids(specs) == expected


@pytest.mark.parametrize("spec", ["inner.lr=1e-3", "L4:inner.lr=1e-3", "LM:inner.lr", "LM:=1", "LM:inner.lr=,"])
def test_parse_grids_refuses_malformed_specs(spec: str) -> None:
    with pytest.raises(BenchError, match="--grid"):
        parse_grids([spec])


def test_grid_points_are_the_cartesian_product_in_order() -> None:
    axes = [("inner.lr", ["1e-3", "2e-3"]), ("outer.lr", ["0.5", "1.0"])]
    points = grid_points("LM", axes)
    assert [p.overrides for p in points] == [
        ("inner.lr=1e-3", "outer.lr=0.5"),
        ("inner.lr=1e-3", "outer.lr=1.0"),
        ("inner.lr=2e-3", "outer.lr=0.5"),
        ("inner.lr=2e-3", "outer.lr=1.0"),
    ]
    assert points[0].key == "inner.lr=1e-3,outer.lr=0.5"
    assert grid_points("Ls", []) == [Point("Ls", ())]
    assert Point("Ls", ()).key == "default"


@pytest.mark.bench  # the bench's end-to-end smoke run (45 s): pytest -m bench, like the other benches' smoke runs
def test_warm_start_and_grids_pick_each_methods_best(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.rounds=3", "train.inner_steps=2", "train.checkpoint_every=1"])
    grid = ["LM:inner.lr=1e-4,3e-3"]
    result = run_convergence_bench(cfg, tmp_path / "runs", islands=2, grids=grid, warm_steps=2)

    # The pretraining: one island, plain AdamW (the sync mode), 2 steps; every method then starts from it.
    warm = tmp_path / "runs" / "warm"
    assert result["warm_start"]["steps"] == 2 and json.loads((warm / "summary.json").read_text())["rounds"] == 1
    rows = result["grid"]["L2"]
    assert [r["overrides"] for r in rows] == [["inner.lr=1e-4"], ["inner.lr=3e-3"]]
    for row in [*rows, *result["grid"]["L1"], *result["grid"]["Ls"]]:
        run = Path(row["run_dir"])
        events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert any(e["event"] == "warm_start" for e in events), run  # init.from was read
        assert json.loads((run / "summary.json").read_text())["rounds"] == 2  # the budget minus the warm start
    # The best point is the lowest final loss, and the ratios are of the bests.
    best = min(rows, key=lambda r: r["final_eval_loss"])
    assert result["best"]["L2"] == best["overrides"] and result["L2"] == best["final_eval_loss"]
    assert result["ratio_LM_over_Ls"] == round(result["L2"] / result["Ls"], 4)


def test_warm_start_steps_must_fit_the_schedule(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.rounds=3", "train.inner_steps=2"])
    for steps in (1, 6):
        with pytest.raises(BenchError, match="--warm-start"):
            run_convergence_bench(cfg, tmp_path / "runs", islands=2, warm_steps=steps)


def test_an_unknown_warm_protocol_is_refused(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.rounds=3", "train.inner_steps=2"])
    with pytest.raises(BenchError, match=r"--warm-protocol must be one of restart, continue \(got 'resume'\)"):
        run_convergence_bench(cfg, tmp_path / "runs", islands=2, warm_steps=2, warm_protocol="resume")
    assert not (tmp_path / "runs" / "warm").exists()


@pytest.mark.bench  # 30 s: pytest -m bench
def test_the_continue_protocol_carries_the_pretrainings_state_and_schedule(tiny_config: Path, tmp_path: Path) -> None:
    """The pretraining runs 2 steps of a 6-step schedule; every method's every island starts from its inner state
    (step count 2) on the same 6-step schedule."""
    cfg = load_config(tiny_config, ["train.rounds=3", "train.inner_steps=2", "train.checkpoint_every=1"])
    result = run_convergence_bench(cfg, tmp_path / "runs", islands=2, warm_steps=2, warm_protocol="continue")
    assert result["warm_start"]["protocol"] == "continue"
    warm = tmp_path / "runs" / "warm"
    assert load_config(warm / "config.toml").inner.schedule_steps == 6
    for key, names in (("L1", ["island-0"]), ("L2", ["island-0", "island-1"]), ("Ls", ["sync"])):
        run = Path(result["run_dirs"][key])
        assert load_config(run / "config.toml").inner.schedule_steps == 6
        events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        loaded = [e for e in events if e["event"] == "warm_start" and "island" in e]
        assert sorted(e["island"] for e in loaded) == names, run
        assert all(e["inner_state"] and e["step_count"] == 2 and "sync" in e["source"] for e in loaded), run
