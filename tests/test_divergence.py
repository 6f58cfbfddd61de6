"""A run that diverges ends with one line naming where and what to change (exit code 2), never a traceback, a
restart loop or a hang; and a diverged commit never becomes the global model.

Island side (islands/island.py, `Island.check_finite`): the first non-finite inner step of an island is named.
Coordinator side (diloco/run/global_run.py, `GlobalRun.close_round`): a committed model whose eval loss is NaN/Inf or
over DIVERGENCE_FACTOR x the initial one is undone, logged as `diverged`, and raised.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import pytest

from diloco.cli import main
from diloco.config import RunConfig, load_config
from diloco.run.global_run import GlobalRun, diverged_reason
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import Setup, build_setup, make_island
from islands.island import DivergedError
from pytrees.digest import tree_digest
from tests.conftest import TINY_TOML, run_cli

SYNTHETIC_TOML = TINY_TOML.replace('kind = "text"\npath = "{corpus}"', 'kind = "synthetic"')
assert 'kind = "synthetic"' in SYNTHETIC_TOML


@pytest.fixture
def synthetic_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(SYNTHETIC_TOML)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, Setup]:
    path = tmp_path_factory.mktemp("cfg") / "tiny.toml"
    path.write_text(SYNTHETIC_TOML)
    cfg = load_config(path)
    return cfg, build_setup(cfg)


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_divergence_rule() -> None:
    assert diverged_reason(5.0, 5.5) is None
    assert diverged_reason(11.0, 5.5) is None  # exactly 2x is still allowed
    assert diverged_reason(11.01, 5.5) == "eval loss 11.01 is over 2x the initial 5.5"
    assert diverged_reason(math.nan, 5.5) == "eval loss is nan"
    assert diverged_reason(math.inf, None) == "eval loss is inf"
    assert diverged_reason(100.0, 5.5, factor=0) is None  # the explosion check turned off; NaN/Inf still count
    assert diverged_reason(math.nan, 5.5, factor=0) == "eval loss is nan"
    assert diverged_reason(3.0, -1.0) is None  # a negative initial loss scales nothing
    assert diverged_reason(3.0, None) is None


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_an_island_names_its_first_non_finite_step(tiny: tuple[RunConfig, Setup]) -> None:
    cfg, setup = tiny
    island = make_island(cfg, "island-0", setup.model, setup.streams["island-0"])
    island.start(setup.init_params)
    params = island.state.params
    with pytest.raises(DivergedError) as losses:
        island.check_finite(np.array([5.0, 7.5, np.inf, np.nan], np.float32), params, first_step=10)
    assert str(losses.value).startswith(
        "island island-0 diverged: loss is inf at inner step 13 (it was 7.5 at step 12); "
    )
    for key in ("inner.lr", "inner.clip_norm", "inner.warmup_steps"):
        assert key in str(losses.value)

    poisoned = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan), params)
    with pytest.raises(
        DivergedError,
        match=r"^island island-0 diverged: its parameters hold NaN or Inf after inner "
        r"step 12 \(loss 7\.5\); lower inner\.lr",
    ):
        island.check_finite(np.array([5.0, 7.5], np.float32), poisoned, first_step=10)
    island.check_finite(np.array([5.0, 7.5], np.float32), params, first_step=10)  # finite: no error

    # Through the real train step: NaN parameters give a NaN loss at the first step, and the state is not advanced.
    island.set_params(poisoned)
    before = island.state.step
    with pytest.raises(DivergedError, match=rf"loss is nan at inner step {before + 1};"):
        island.train(2)
    assert island.state.step == before


@pytest.mark.timeout(300)
def test_a_diverged_commit_is_undone_logged_and_raised_again(tiny: tuple[RunConfig, Setup], tmp_path: Path) -> None:
    cfg, setup = tiny
    rd = RunDir(tmp_path / "run", cfg)
    world = GlobalRun(cfg, rd, setup, durable=False)
    try:
        world.start(None)
        digest, state = tree_digest(world.loop.params), world.loop.state
        # Islands that trained fine (loss 5) but whose Δ is huge: the outer step wrecks the model.
        huge = jax.tree.map(lambda x: np.asarray(x) * -1000.0, world.loop.params)
        world.loop.submit("island-0", 0, huge, tokens=100)
        with pytest.raises(DivergedError) as diverged:
            world.close_round(losses=[5.0], seconds=1.0)
        message = str(diverged.value)
        assert message.startswith("the global model diverged at round 0 and was not kept: eval loss "), message
        assert "islands' last loss up to 5; lower outer.lr (0.7) or outer.momentum (0.9)" in message, message
        # All or nothing: θ, the outer state, the round and its contributions are those before the commit, and
        # nothing was saved.
        assert world.loop.round == 0 and world.loop.state is state and tree_digest(world.loop.params) == digest
        assert world.loop.pending == ("island-0",)
        assert world.totals.rounds == 0 and world.totals.final_eval_loss == world.totals.initial_eval_loss
        assert world.store is not None and world.store.steps() == []
        events = read_events(rd.metrics_path)
        assert [e["event"] for e in events if e["event"] in ("round", "diverged")] == ["diverged"]
        assert events[-1]["round"] == 0 and events[-1]["islands"] == ["island-0"]
        assert events[-1]["eval_loss"] > 2 * events[-1]["initial_eval_loss"] or math.isnan(events[-1]["eval_loss"])
        # Latched: a later close, even with a harmless contribution, commits nothing more.
        world.loop.submit("island-1", 0, jax.tree.map(np.zeros_like, huge), tokens=100)
        with pytest.raises(DivergedError) as again:
            world.close_round(losses=[5.0], seconds=1.0)
        assert again.value is diverged.value and world.loop.round == 0
        assert world.loop.pending == ("island-0", "island-1") and len(read_events(rd.metrics_path, "diverged")) == 1
    finally:
        world.close()
        rd.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_simulate_that_diverges_ends_with_one_line(synthetic_config: Path, tmp_path: Path, capsys) -> None:
    # The user's case: a huge lr without clipping. Every island's loss explodes within round 0 (finite still),
    # so the first commit is where it is caught.
    base = ["simulate", str(synthetic_config), "--no-progress", "inner.clip_norm=0"]
    err = _one_line(capsys, [*base, "inner.lr=30", "--run-dir", str(tmp_path / "a")])
    assert err.startswith("diloco: error: the global model diverged at round 0 and was not kept: eval loss "), err
    assert err.endswith(
        "lower inner.lr (30), set inner.clip_norm > 0 (it is 0: no clipping) or raise inner.warmup_steps (2)"
    ), err
    assert not (tmp_path / "a" / "summary.json").exists()
    assert [e["round"] for e in read_events(tmp_path / "a" / "metrics.jsonl", "diverged")] == [0]

    # An lr so large that the parameters overflow: with warmup_steps = 2 the first step's lr is 0, the second's
    # update overflows, so island-0 (the first to train) has a finite loss at step 2 and NaN at step 3.
    err = _one_line(capsys, [*base, "inner.lr=1e30", "--run-dir", str(tmp_path / "b")])
    assert err.startswith("diloco: error: island island-0 diverged: loss is nan at inner step 3 (it was "), err
    assert "inner.lr" in err and "inner.clip_norm" in err and "inner.warmup_steps" in err


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_launch_that_diverges_exits_with_one_line(synthetic_config: Path, tmp_path: Path) -> None:
    """Processes, sockets, supervisors: the run stops by itself (no restart loop, no coordinator left waiting)."""
    # The bound is run_cli's timeout: generous (start-up and one round take well under a minute unloaded), while a
    # hang (the old behaviour: no island alive, the coordinator waiting for ever) runs into it. A short
    # network.pull_wait_s: the islands' pulls of round 0, waiting for a commit that never comes, end in a second
    # rather than the default 10 s that the stopping coordinator would otherwise wait out.
    out = run_cli(
        "launch",
        str(synthetic_config),
        "inner.lr=30",
        "inner.clip_norm=0",
        "network.pull_wait_s=1",
        "--no-progress",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=300,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("diloco: error: "), out.stderr
    assert "the global model diverged at round 0" in lines[0] and "inner.lr (30)" in lines[0], lines[0]
    for name in ("island-0", "island-1"):  # no supervisor restarted a worker
        assert "restart" not in (tmp_path / "run" / "logs" / f"{name}.log").read_text()
