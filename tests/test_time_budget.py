"""Time-budgeted rounds (`train.round_seconds`), the slow-island knob (`islands.slowdown`) and the emulated device-bound
step (`islands.device_step_s`).

A slow island trains fewer inner steps in the same budget instead of holding up the round, and its pseudo-gradient
weighs what it trained (token-weighted). The budgets are far apart from the step times here (an island 20x slower
than the other, a budget a fast island's H steps fit in many times), so the counts do not depend on the load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.config import ConfigError, load_config
from diloco.run.rundir import read_events
from diloco.run.setup import build_setup, make_island
from diloco.simulator.simulate import run_simulation

H = 8


@pytest.mark.slow
def test_a_slow_island_fits_fewer_steps_in_the_same_budget(tiny_config: Path) -> None:
    cfg = load_config(tiny_config, [f"train.inner_steps={H}", "islands.slowdown=['island-1=20']"])
    setup = build_setup(cfg)
    fast, slow = (make_island(cfg, name, setup.model, setup.streams[name]) for name in cfg.islands.island_names)
    for island in (fast, slow):
        island.start(setup.init_params)
    step_s = fast.train(4).seconds / 4  # the first train compiles outside its timing (Island._warm_up)
    budget = 4 * H * step_s  # the fast island's H steps fit 4 times over; the slow one's 20x steps do not
    fast_run, slow_run = fast.train_for(budget, H), slow.train_for(budget, H)
    assert len(fast_run.losses) == H and fast_run.tokens == H * 8 * 16
    assert 1 <= len(slow_run.losses) < H, (len(slow_run.losses), budget, step_s)
    assert slow_run.tokens == len(slow_run.losses) * 8 * 16
    assert slow.state.step == len(slow_run.losses)


@pytest.mark.slow
def test_simulate_weighs_each_island_by_what_it_trained_in_its_budget(tiny_config: Path, tmp_path: Path) -> None:
    overrides = [
        f"train.inner_steps={H}",
        "train.rounds=2",
        "train.checkpoint_every=0",
        "train.round_seconds=1",
        "train.log_every=1",
        "islands.slowdown=['island-1=200']",
    ]
    result = run_simulation(load_config(tiny_config, overrides), tmp_path / "run", show_progress=False)
    steps = {}
    for e in read_events(tmp_path / "run" / "metrics.jsonl", "inner"):
        steps[e["island"]] = max(steps.get(e["island"], 0), e["step"])
    assert steps["island-0"] == 2 * H  # the fast island trained whole rounds
    # 200x slower: a tiny step (5-50 ms) takes 1-10 s, so one step per round fills its 1 s budget.
    assert 2 <= steps["island-1"] < 2 * H
    assert result["tokens"] == (2 * H + steps["island-1"]) * 8 * 16


@pytest.mark.slow
def test_a_device_bound_step_lasts_its_floor_and_leaves_the_results_alone(tiny_config: Path) -> None:
    """islands.device_step_s: each step lasts at least the floor (the island sleeps the rest), the floor counts as
    the run's compute seconds, and what the steps compute does not change. The floor (0.25 s) is far above a tiny
    model's step (5-50 ms), and sleep never returns early, so the lower bounds cannot flake."""
    floor = 0.25
    plain = load_config(tiny_config, [f"train.inner_steps={H}"])
    bound = load_config(tiny_config, [f"train.inner_steps={H}", f"islands.device_step_s={floor}"])
    runs = []
    for cfg in (plain, bound):
        setup = build_setup(cfg)
        island = make_island(cfg, "island-0", setup.model, setup.streams["island-0"])
        island.start(setup.init_params)
        runs.append((island.train(4), island))
    (free, free_island), (slow, slow_island) = runs
    assert slow.seconds >= 4 * floor
    assert free.seconds < 4 * floor  # the floor is what made it long
    assert list(slow.losses) == list(free.losses)
    assert slow_island.state.step == free_island.state.step == 4


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["islands.device_step_s=-0.1"], "islands.device_step_s must be between 0 and 60 seconds"),
        (["islands.device_step_s=61"], "islands.device_step_s must be between 0 and 60 seconds"),
        (["islands.slowdown=['island-9=2']"], "islands.slowdown entry 'island-9=2' must be NAME=FACTOR"),
        (["islands.slowdown=['island-0=0.5']"], "FACTOR a number >= 1"),
        (["train.round_seconds=-1"], "train.round_seconds must be a finite number >= 0"),
        (["train.round_seconds=5", "stream.fragments=2"], "needs whole rounds"),
    ],
)
def test_a_budget_or_slowdown_that_cannot_work_is_one_line(tiny_config: Path, overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tiny_config, overrides)
    assert words in str(info.value) and "\n" not in str(info.value)
