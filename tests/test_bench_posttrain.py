"""`diloco bench posttrain`: the columns' overrides keep the samples per step equal; bad arguments are one line; a
small run of every column and stage reports scores that agree with its runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.bench.posttrain import column_overrides, heldout_count, ratio
from diloco.cli import main
from diloco.config import load_config
from diloco.run.rundir import read_events
from diloco.simulator.simulate import run_simulation
from tests.conftest import TINY_TOML, fails

TASK = ["workload.kind=sft", "workload.task=addition", "workload.heldout_examples=8", "workload.max_new_tokens=4"]


def test_every_column_sees_the_same_examples_per_step(tiny_config: Path) -> None:
    cfg = load_config(tiny_config, TASK)
    per_step = cfg.islands.count * cfg.train.batch_size
    one = load_config(tiny_config, [*TASK, *column_overrides(cfg, "one")])
    assert one.islands.island_names == cfg.islands.island_names[:1] and one.train.batch_size == per_step
    sync = load_config(tiny_config, [*TASK, *column_overrides(cfg, "sync")])
    assert sync.train.mode == "sync" and sync.islands.count * sync.train.batch_size == per_step
    assert column_overrides(cfg, "diloco") == []
    assert heldout_count(cfg, None) == 1007  # two-digit addition's whole held-out split
    assert heldout_count(cfg, 5) == 5 and ratio(0.8, 0.4) == 2.0 and ratio(0.5, 0.0) is None


@pytest.mark.parametrize(
    ("flags", "overrides", "message"),
    [
        (["--columns", "diloco,two"], TASK, "bench posttrain: --columns takes a comma-separated list of diloco, one"),
        (["--heldout", "0"], TASK, "--heldout must be >= 1"),
        ([], [], "bench posttrain needs a [workload] with a built-in task"),
    ],
)
def test_a_bad_argument_is_one_line(
    tiny_config: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    overrides: list[str],
    message: str,
) -> None:
    argv = ["bench", "posttrain", str(tiny_config), "--pretrained", str(tmp_path), "--run-dir", str(tmp_path / "b")]
    fails(capsys, [*argv, *flags, *overrides], message)


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_a_small_run_scores_every_column_and_stage(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=corpus))
    pre = tmp_path / "pre"
    run_simulation(load_config(config, ["train.rounds=1"]), pre, show_progress=False)
    short = "train.rounds=1 inner.warmup_steps=0"
    args = ["bench", "posttrain", str(config), "--pretrained", str(pre), "--run-dir", str(tmp_path / "b"),
            "--heldout", "12", "--dpo", f"workload.kind=dpo workload.sft_weight=1 {short}",
            "--rl", f"workload.kind=rl workload.reward=builtin:addition {short}", *TASK]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["heldout_problems"] == 12 and set(out["columns"]) == {"diloco", "one", "sync"}
    for column, stages in out["columns"].items():
        assert set(stages) == {"sft", "dpo", "rl"}
        for stage, row in stages.items():
            summary = json.loads((tmp_path / "b" / f"{column}-{stage}" / "summary.json").read_text())
            assert row["digest"] == summary["params_digest"] and row["final"] == summary["final_scores"]
            assert 0.0 <= row["heldout"]["exact_match"] <= 1.0 and 0.0 <= row["heldout"]["reward"] <= 1.0
        assert "dpo_accuracy" in stages["dpo"]["heldout"]
        (dpo_start,) = read_events(tmp_path / "b" / f"{column}-dpo" / "metrics.jsonl", "warm_start")[:1]
        assert f"{column}-sft" in json.dumps(dpo_start)  # each column's DPO starts from its own SFT
    assert set(out["ratios"]["rl"]) == {"diloco/one", "diloco/sync"}
