"""`diloco simulate` end to end: the run directory, sync mode, the FedAvg invariant, SIGKILL and resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np
import pytest

from diloco.config import load_config
from diloco.harness.procs import wait_until
from diloco.run.rundir import read_events
from diloco.run.setup import Evaluator, build_setup
from diloco.run.summary import SUMMARY_KEYS
from diloco.simulator.simulate import run_simulation
from islands.inner import make_inner_optimizer
from islands.island import Island
from tests.conftest import REPO, child_env


@pytest.mark.slow
def test_diloco_run_writes_the_run_directory(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config)
    summary = run_simulation(cfg, tmp_path / "run", show_progress=False)
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} >= {"config.toml", "metrics.jsonl", "summary.json", "checkpoints"}
    assert load_config(run / "config.toml") == cfg  # the resolved config reloads to the same run
    assert tuple(json.loads((run / "summary.json").read_text())) == SUMMARY_KEYS
    assert summary["rounds"] == 3 and summary["syncs"] == 3
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 1.0
    n_params = summary["param_count"]
    assert summary["bytes_up"] == summary["bytes_down"] == 3 * 2 * 4 * n_params  # fp32, 2 islands, 3 rounds
    assert summary["tokens"] == 3 * 2 * 4 * 8 * 16
    events = read_events(run / "metrics.jsonl")
    assert all({"event", "t"} <= set(e) for e in events)
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [0, 1, 2]
    assert all({"loss", "eval_loss", "tokens", "bytes_up", "bytes_down"} <= set(e) for e in rounds)
    inner = [e for e in events if e["event"] == "inner"]
    assert {e["island"] for e in inner} == {"island-0", "island-1"} and all("step" in e for e in inner)
    assert sum(e["event"] == "island_joined" for e in events) == 2
    assert (run / "checkpoints" / "coordinator").is_dir() and (run / "checkpoints" / "island-1").is_dir()


@pytest.mark.slow
def test_sync_baseline_trains_on_the_union_every_step(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.mode=sync"])
    summary = run_simulation(cfg, tmp_path / "sync", show_progress=False)
    assert summary["syncs"] == 3 * 4  # every inner step is a sync
    assert summary["tokens"] == 3 * 4 * (2 * 8) * 16  # the union of both islands' batches
    assert summary["bytes_up"] == 3 * 4 * 2 * 4 * summary["param_count"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 1.0


@pytest.mark.slow
def test_one_island_fedavg_lr1_equals_plain_training(tiny_config: Path, tmp_path: Path) -> None:
    overrides = [
        "islands.count=1",
        "outer.kind=sgd",
        "outer.lr=1.0",
        "outer.momentum=0.0",
        "train.checkpoint_every=0",
    ]
    cfg = load_config(tiny_config, overrides)
    summary = run_simulation(cfg, tmp_path / "fedavg", show_progress=False)
    setup = build_setup(cfg)
    stream = setup.streams["island-0"]
    plain = Island("plain", setup.model, make_inner_optimizer(cfg.inner, cfg.total_inner_steps), stream)
    plain.start(setup.init_params)
    losses = plain.train(cfg.total_inner_steps).losses
    inner = [e["loss"] for e in read_events(tmp_path / "fedavg" / "metrics.jsonl") if e["event"] == "inner"]
    np.testing.assert_allclose(inner, losses[1::2], rtol=1e-5, atol=1e-5)  # log_every = 2
    plain_eval = Evaluator(setup.model, setup.eval_stack)(plain.state.params)
    assert summary["final_eval_loss"] == pytest.approx(plain_eval, abs=1e-5)


def _finished_steps(run_dir: Path, owners: list[str]) -> set[int]:
    """The checkpoint steps that every owner has finished saving."""
    dirs = [run_dir / "checkpoints" / owner for owner in owners]
    return set.intersection(
        *({int(p.name) for p in d.iterdir() if p.name.isdigit()} if d.is_dir() else set() for d in dirs)
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_then_resume_ends_with_the_same_parameters(tiny_config: Path, tmp_path: Path) -> None:
    rounds = ["train.rounds=6", "codec.uplink=int8", "codec.downlink=int4"]  # residuals must survive too
    run_dir = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "diloco.cli",
        "simulate",
        str(tiny_config),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *rounds,
    ]
    child = subprocess.Popen(
        cmd, env=child_env(jax_cache=True), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    # The uninterrupted reference run, in this process while the children run (one core each).
    with ThreadPoolExecutor(1) as pool:
        reference_run = pool.submit(
            run_simulation, load_config(tiny_config, rounds), tmp_path / "ref", show_progress=False
        )

        # Kill it once the coordinator and both islands have each finished saving a round (orbax renames a step's
        # directory to its number when the save is complete; saves are asynchronous, so a `round` event alone
        # does not mean its checkpoint is there yet).
        def alive() -> None:
            assert child.poll() is None, child.communicate()[1][-2000:]

        finished = ["coordinator", "island-0", "island-1"]
        wait_until(lambda: _finished_steps(run_dir, finished), "a round saved by every process", 300, 0.05, alive)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL
        assert not (run_dir / "summary.json").exists()  # it really died mid-run

        again = subprocess.run(
            cmd, env=child_env(jax_cache=True), cwd=REPO, capture_output=True, text=True, timeout=240
        )
        reference = reference_run.result(timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    events = read_events(run_dir / "metrics.jsonl")
    resumes = [e for e in events if e["event"] == "resumed"]
    assert len(resumes) == 1 and 1 <= resumes[0]["round"] < 6
    assert [e["round"] for e in events if e["event"] == "round"] == list(range(6))  # none repeated or lost
    assert resumed["params_digest"] == reference["params_digest"]
    assert resumed["final_eval_loss"] == reference["final_eval_loss"]
    assert resumed["tokens"] == reference["tokens"]


@pytest.mark.slow
def test_run_dir_of_another_run_is_refused(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.rounds=1", "train.checkpoint_every=0"])
    run_simulation(cfg, tmp_path / "r", show_progress=False)
    from diloco.run.rundir import RunDirError

    with pytest.raises(RunDirError, match=r"holds another run \(config differs in: outer.lr\)"):
        run_simulation(
            load_config(tiny_config, ["train.rounds=1", "train.checkpoint_every=0", "outer.lr=0.1"]),
            tmp_path / "r",
        )


@pytest.mark.slow
def test_custom_model_trains_through_simulate(tiny_config: Path, tmp_path: Path) -> None:
    overrides = [
        "model.kind=custom",
        "model.entry=tests.custom_model:build",
        "train.rounds=2",
        "train.checkpoint_every=0",
    ]
    summary = run_simulation(load_config(tiny_config, overrides), tmp_path / "c", show_progress=False)
    assert summary["param_count"] == 256 * 256
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]


@pytest.mark.slow
def test_moe_trains_through_simulate(tiny_config: Path, tmp_path: Path) -> None:
    overrides = ["model.kind=moe", "model.n_experts=4", "model.top_k=2", "train.rounds=2", "train.checkpoint_every=0"]
    summary = run_simulation(load_config(tiny_config, overrides), tmp_path / "m", show_progress=False)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert jax.device_count() >= 1


def test_run_dir_written_by_an_older_diloco_still_resumes(tiny_config: Path, tmp_path: Path) -> None:
    """A key added to the config later (absent from an old config.toml) takes its default, not a mismatch."""
    from diloco.run.rundir import RunDir

    cfg = load_config(tiny_config, ["train.checkpoint_every=0"])
    RunDir(tmp_path / "old", cfg).close()
    stored = tmp_path / "old" / "config.toml"
    stored.write_text(stored.read_text().replace("shard_block_tokens = 8192\n", ""))
    assert "shard_block_tokens" not in stored.read_text()
    RunDir(tmp_path / "old", cfg).close()  # no RunDirError
