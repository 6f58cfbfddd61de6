"""`diloco bench simulator`: its refusals in one line, and one small end-to-end run of both paths (the figures come
from the command in the report of the change, on configs/convergence.toml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench.simulator import run_simulator_bench
from diloco.cli import main
from diloco.config import load_config


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--islands", "0"], "bench simulator: --islands and --rounds must be >= 1 (got 0 and 3)"),
        (["train.round_seconds=1.5"], "bench simulator: this config cannot be vectorized: train.round_seconds cannot"),
    ],
)
def test_a_bad_argument_is_one_line(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert main(["bench", "simulator", str(tiny_config), "--run-dir", str(tmp_path / "b"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and says in err and "\n" not in err, err


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_the_bench_times_both_paths_and_compares_their_results(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config)
    out = run_simulator_bench(cfg, tmp_path / "bench", islands=2, rounds=2)
    assert out["islands"] == 2 and out["rounds"] == 2
    for key in ("wall_s", "cpu_s", "inner_s", "ms_per_island_step"):
        assert set(out[key]) == {"sequential", "vectorized"} and all(v > 0 for v in out[key].values()), key
    assert all(ratio > 0 for ratio in out["speedup"].values())
    # The speedup is of the seconds before they are rounded to 3 decimals for the report (found: 0.823 from 13 and 16
    # ms): it lies where those roundings allow, and its own.
    seq, vec, half = out["inner_s"]["sequential"], out["inner_s"]["vectorized"], 0.0005
    assert (seq - half) / (vec + half) - half <= out["speedup"]["inner"] <= (seq + half) / (vec - half) + half
    gaps = out["max_abs_diff"]
    assert 0 <= gaps["final_eval_loss"] <= gaps["eval_loss"] < 1e-4 and 0 <= gaps["params"] < 1e-4
    for run_dir in out["run_dirs"].values():
        assert (Path(run_dir) / "summary.json").is_file()
    assert load_config(Path(out["run_dirs"]["vectorized"]) / "config.toml").train.vectorize
    with pytest.raises(ValueError, match="exists; the runs are timed, give a new --run-dir"):
        run_simulator_bench(cfg, tmp_path / "bench", islands=2, rounds=2)
