"""Warm start (`[init]`, diloco/run/warm_start.py): θ_0 and the islands' inner states from another run's checkpoint.

One small `simulate` run is the source of most tests here. A warm-started run must begin at exactly its θ (the
digest of summary.json), evaluate that θ at step 0, log a `warm_start` event, refuse a missing path or another model
in one line, and, once it has checkpoints of its own, resume from them and never read init.from again. The papers'
warm start (a sync pretraining on a schedule of the whole budget, continued with its inner state) must take its
first step exactly as the pretraining's next one would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from diloco.config import ConfigError, load_config
from diloco.harness.procs import Federation
from diloco.run.rundir import RunDir, read_events
from diloco.run.setup import build_setup, make_island
from diloco.run.warm_start import (
    WarmStartError,
    find_source,
    initial_inner_state,
    model_difference,
    read_item,
    step_count,
    tensor_difference,
)
from diloco.simulator.simulate import run_simulation
from islands.inner import inner_update, make_inner_optimizer
from pytrees.digest import tree_digest
from tests.conftest import ENV, FAST, JAX_CACHE, REPO, TINY_TOML, write_corpus


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny config, a finished 2-round `simulate` run directory of it) shared by the module's tests."""
    tmp = tmp_path_factory.mktemp("warm-source")
    config = tmp / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp / "corpus.txt")))
    run_simulation(load_config(config, ["train.rounds=2"]), tmp / "source", show_progress=False)
    return config, tmp / "source"


SPAN = "inner.schedule_steps=16"
"""The tiny config's 4 rounds of 4 steps: the pretraining runs 2 of them, the continuation the other 2."""


@pytest.fixture(scope="module")
def pretrained(source: tuple[Path, Path]) -> Path:
    """The papers' pretraining: the sync baseline on one island, 8 steps of a 16-step schedule."""
    config, src = source
    run_dir = src.parent / "pretrained"
    cfg = load_config(config, ["train.mode=sync", "islands.count=1", "train.rounds=2", SPAN])
    run_simulation(cfg, run_dir, show_progress=False)
    return run_dir


def continued(pretrained: Path, *more: str) -> list[str]:
    """The overrides of a 2-island DiLoCo run that continues `pretrained` as the papers do."""
    init = [f"init.from={pretrained}", "init.inner_state=true", "init.inner_state_island=sync"]
    return ["train.rounds=2", *init, *more]


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def warm_events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's `warm_start` event for θ_0 (the islands' inner-state events carry no digest)."""
    return [e for e in read_events(run_dir / "metrics.jsonl", "warm_start") if "digest" in e]


def initial_eval(run_dir: Path) -> float:
    (event,) = [e for e in read_events(run_dir / "metrics.jsonl", "eval") if e["step"] == 0]
    return event["eval_loss"]


def assert_started_from(run_dir: Path, source_dir: Path) -> None:
    """θ_0 of `run_dir` is the source's final θ, and its step-0 evaluation is of that θ."""
    src = summary_of(source_dir)
    (event,) = warm_events(run_dir)
    assert event["digest"] == src["params_digest"]
    assert event["source_round"] == 2 and Path(event["source"]).parent.name in ("coordinator", "sync")
    assert initial_eval(run_dir) == pytest.approx(src["final_eval_loss"], rel=1e-6)
    assert summary_of(run_dir)["initial_eval_loss"] == pytest.approx(src["final_eval_loss"], rel=1e-6)


# -- pure parts ----------------------------------------------------------------------------------------------------


def test_init_from_is_a_toml_key_and_inner_state_needs_it(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["init.from=some/run", "init.inner_state=true"])
    assert (cfg.init.from_, cfg.init.inner_state) == ("some/run", True)
    (tmp_path / "dump.toml").write_text(tiny_config.read_text() + '\n[init]\nfrom = "some/run"\ninner_state = true\n')
    assert load_config(tmp_path / "dump.toml") == cfg
    with pytest.raises(ConfigError, match=r"^init\.inner_state = true needs init\.from") as exc:
        load_config(tiny_config, ["init.inner_state=true"])
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="did you mean 'init.from'"):
        load_config(tiny_config, ["init.frm=x"])
    with pytest.raises(ConfigError, match=r"^init\.inner_state_island names the inner state to load: it needs"):
        load_config(tiny_config, ["init.from=x", "init.inner_state_island=sync"])


def test_the_first_difference_is_named() -> None:
    assert model_difference({"d_model": 32, "n_layers": 1}, {"d_model": 32, "n_layers": 1}) is None
    assert model_difference({"d_model": 32, "n_layers": 1}, {"d_model": 64, "n_layers": 2}) == (
        "model.d_model is 32 there, 64 here"
    )
    ours = {"a": ((2, 3), "float32"), "b": ((4,), "float32")}
    assert tensor_difference(dict(ours), ours) is None
    wider = {**ours, "a": ((3, 3), "float32")}
    assert tensor_difference(wider, ours) == "tensor 'a' is float32[3, 3] there, float32[2, 3] here"
    assert tensor_difference({"a": ours["a"]}, ours) == "tensor 'b' is missing there"
    assert tensor_difference({**ours, "c": ((1,), "float32")}, ours) == "tensor 'c' is there but not here"


def test_missing_path_and_a_dir_without_checkpoints_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(WarmStartError, match=r"^init\.from: '.*nowhere' does not exist$"):
        find_source(tmp_path / "nowhere")
    (tmp_path / "empty" / "checkpoints" / "coordinator").mkdir(parents=True)
    with pytest.raises(WarmStartError, match=r"^init\.from: '.*empty' holds no checkpoint") as exc:
        find_source(tmp_path / "empty")
    assert "\n" not in str(exc.value)


# -- simulate --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_source_run_dir_store_and_step_resolve_to_the_same_checkpoint(source: tuple[Path, Path]) -> None:
    _, src = source
    step = src / "checkpoints" / "coordinator" / "2"
    for path in (src, step.parent, step):
        found = find_source(path)
        assert (found.step_dir, found.run_dir, found.round) == (step, src, 2)


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_warm_diloco_run_starts_at_the_source_and_resumes_from_its_own(
    source: tuple[Path, Path], tmp_path: Path
) -> None:
    """θ_0, the step-0 eval, the islands' inner states; then the source vanishes, the run is cut back to its round-1
    checkpoint (as a kill after round 1 leaves it) and resumes from it, reading nothing of init.from, to the same θ."""
    config, src = source
    copy = shutil.copytree(src, tmp_path / "copy")
    overrides = ["train.rounds=2", f"init.from={copy}", "init.inner_state=true"]
    run = tmp_path / "warm"
    first = run_simulation(load_config(config, overrides), run, show_progress=False)
    assert_started_from(run, copy)
    islands = [e for e in read_events(run / "metrics.jsonl", "warm_start") if "island" in e]
    assert {(e["island"], e["inner_state"], Path(e["source"]).parent.name) for e in islands} == {
        ("island-0", True, "island-0"),
        ("island-1", True, "island-1"),
    }

    shutil.rmtree(copy)
    for owner in ("coordinator", "island-0", "island-1"):
        shutil.rmtree(run / "checkpoints" / owner / "2")
    resumed = run_simulation(load_config(config, overrides), run, show_progress=False)
    events = read_events(run / "metrics.jsonl")
    assert [e["round"] for e in events if e["event"] == "resumed"] == [1]
    assert len(warm_events(run)) == 1  # the warm start of the first start only
    assert resumed["params_digest"] == first["params_digest"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_warm_sync_and_async_runs_start_at_the_source(source: tuple[Path, Path], tmp_path: Path, mode: str) -> None:
    """The sync baseline (one model, its own store) and the asynchronous mode take θ_0 from the source too; the sync
    model has no island of its name in a DiLoCo source, so its inner state starts fresh (said in an event)."""
    config, src = source
    run = tmp_path / mode
    run_simulation(
        load_config(
            config,
            [
                "train.rounds=1",
                f"train.mode={mode}",
                f"init.from={src}",
                f"init.inner_state={str(mode == 'sync').lower()}",
            ],
        ),
        run,
        show_progress=False,
    )
    assert_started_from(run, src)
    if mode == "sync":
        (fresh,) = [e for e in read_events(run / "metrics.jsonl", "warm_start") if "island" in e]
        assert (
            fresh["island"] == "sync"
            and fresh["inner_state"] is False
            and "no checkpoint of island sync" in (fresh["reason"])
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("init.from={src}/../nowhere", r"^init\.from: '.*nowhere' does not exist$"),
        ("model.d_model=64", r"^init\.from: '.*source' trained another model \(model\.d_model is 32 there, 64 here\)"),
    ],
)
def test_a_wrong_source_is_refused_in_one_line_before_the_run_dir_exists(
    source: tuple[Path, Path], tmp_path: Path, override: str, message: str
) -> None:
    config, src = source
    overrides = [f"init.from={src}", override.format(src=src)]
    with pytest.raises(WarmStartError, match=message) as exc:
        run_simulation(load_config(config, overrides), tmp_path / "run", show_progress=False)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_checkpoint_of_other_shapes_names_the_first_tensor(source: tuple[Path, Path], tmp_path: Path) -> None:
    """A checkpoint outside any run directory has no config.toml to compare: its own metadata names the tensor."""
    config, src = source
    lone = shutil.copytree(src / "checkpoints" / "coordinator" / "2", tmp_path / "lone" / "2")
    cfg = load_config(config, [f"init.from={lone}", "model.d_model=64"])
    wider = r"tensor 'blocks/0/attn/wo' is float32\[32, 32\] there, float32\[64, 64\] here"
    with pytest.raises(WarmStartError, match=wider):
        run_simulation(cfg, tmp_path / "run", show_progress=False)


@pytest.mark.slow
def test_a_continued_warm_start_takes_the_pretrainings_next_step(
    source: tuple[Path, Path], pretrained: Path, tmp_path: Path
) -> None:
    """Each island loads the pretraining's inner state (its moments, its count 8) and, on the same 16-step schedule,
    its first step from θ_S is bit for bit the step the pretraining would have taken next; without the shared
    schedule the same state steps at another rate."""
    config, _ = source
    cfg = load_config(config, continued(pretrained, SPAN))
    setup = build_setup(cfg)
    island = make_island(cfg, "island-1", setup.model, setup.streams["island-1"])
    step_dir = pretrained / "checkpoints" / "sync" / "2"
    theta = read_item(step_dir, "params", setup.init_params, "parameters")
    rd = RunDir(tmp_path / "run", cfg)
    try:
        state = initial_inner_state(cfg, island, theta, rd)
    finally:
        rd.close()
    (event,) = read_events(tmp_path / "run" / "metrics.jsonl", "warm_start")
    assert (event["island"], event["inner_state"], event["step_count"]) == ("island-1", True, 8)
    assert Path(event["source"]) == step_dir

    source_cfg = load_config(pretrained / "config.toml")
    source_tx = make_inner_optimizer(source_cfg.inner, source_cfg.total_inner_steps)
    saved = read_item(step_dir, "inner_opt_state", source_tx.init(theta), "the pretraining's inner state")
    assert step_count(state) == 8 and tree_digest(state) == tree_digest(saved)  # moments and counts as saved

    batch = jax.numpy.asarray(np.stack([setup.streams["island-1"].next()]))
    nxt = tree_digest(inner_update(setup.model.loss, source_tx, theta, saved, batch)[0])
    assert tree_digest(inner_update(setup.model.loss, island.tx, theta, state, batch)[0]) == nxt
    unspanned = make_inner_optimizer(load_config(config, continued(pretrained)).inner, cfg.total_inner_steps)
    assert tree_digest(inner_update(setup.model.loss, unspanned, theta, state, batch)[0]) != nxt


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_a_count_carried_onto_the_runs_own_schedule_is_said_in_one_line(
    source: tuple[Path, Path], pretrained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, schedule: str
) -> None:
    """A cosine over this run's own 8 steps ends 8 steps early: said. A wsd schedule without a decay does not depend
    on its span: nothing to say."""
    config, _ = source
    # No inner.schedule_steps: the schedule spans this run's 8 steps.
    cfg = load_config(config, continued(pretrained, f"inner.schedule={schedule}"))
    setup = build_setup(cfg)
    island = make_island(cfg, "island-0", setup.model, setup.streams["island-0"])
    rd = RunDir(tmp_path / "run", cfg)
    try:
        assert initial_inner_state(cfg, island, setup.init_params, rd) is not None
    finally:
        rd.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "diloco.run.warm_start"]
    if schedule == "wsd":
        assert lines == []
        return
    (line,) = lines
    assert "goes on from the source's step 8 on a schedule of this run's 8 steps" in line and "\n" not in line
    assert "inner.schedule_steps" in line


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_every_island_continues_the_pretraining_and_the_run_resumes_without_it(
    source: tuple[Path, Path], pretrained: Path, tmp_path: Path
) -> None:
    """Through simulate: θ_0 and every island's inner state are the sync pretraining's (init.inner_state_island), and
    a cut-back run resumes from its own checkpoints, with the pretraining gone, to the same θ."""
    config, _ = source
    copy = shutil.copytree(pretrained, tmp_path / "copy")
    cfg = load_config(config, continued(copy, SPAN))
    run = tmp_path / "warm"
    first = run_simulation(cfg, run, show_progress=False)
    assert first["final_eval_loss"] < summary_of(copy)["final_eval_loss"]
    islands = [e for e in read_events(run / "metrics.jsonl", "warm_start") if "island" in e]
    assert sorted((e["island"], e["step_count"], Path(e["source"]).parent.name) for e in islands) == [
        ("island-0", 8, "sync"),
        ("island-1", 8, "sync"),
    ]
    shutil.rmtree(copy)
    for owner in ("coordinator", "island-0", "island-1"):
        shutil.rmtree(run / "checkpoints" / owner / "2")
    (run / "summary.json").unlink()
    assert run_simulation(cfg, run, show_progress=False)["params_digest"] == first["params_digest"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["init.inner_state_island=eu"],
            r"^init\.inner_state_island: '.*pretrained' holds no checkpoint of island 'eu'",
        ),
        (
            ["inner.kind=muon"],
            r"^init\.from: '.*sync/2' does not fit this run's inner optimizer state of island island-0 "
            r"\(inner\.kind = 'muon'\): tensor '.*' is (missing there|there but not here)",
        ),
    ],
)
def test_an_inner_state_that_is_not_there_or_does_not_fit_is_one_line(
    source: tuple[Path, Path], pretrained: Path, tmp_path: Path, overrides: list[str], message: str
) -> None:
    config, _ = source
    with pytest.raises(WarmStartError, match=message) as exc:
        run_simulation(load_config(config, continued(pretrained, *overrides)), tmp_path / "run", show_progress=False)
    assert "\n" not in str(exc.value)


# -- the coordinator and island processes ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(290)
def test_federation_starts_at_the_source(source: tuple[Path, Path], tmp_path: Path) -> None:
    """The coordinator loads θ_0 and evaluates it; each island process loads its own inner state from the source's
    island checkpoint and gets θ_0 from the coordinator by its first full pull."""
    config, src = source
    overrides = [*FAST, "train.rounds=2", "quorum.min_islands=2", f"init.from={src}", "init.inner_state=true"]
    fed = Federation(config, overrides, tmp_path / "fed", cwd=REPO, env=ENV, jax_cache=JAX_CACHE)
    try:
        fed.start()
        summary = fed.wait_done(240)
    finally:
        fed.stop(grace_s=0.0)
    assert summary["rounds"] == 2
    assert_started_from(fed.run_dir, src)
    digest = summary_of(src)["params_digest"]
    for name in fed.names:
        (inner,) = fed.events("warm_start", island=name)
        assert inner["inner_state"] is True and Path(inner["source"]).parent.name == name
        first = fed.events("synced", island=name)[0]
        assert (first["kind"], first["round"], first["digest"]) == ("full", 0, digest)
