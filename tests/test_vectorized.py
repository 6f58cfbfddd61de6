"""`train.vectorize`: the islands' inner steps as one program (islands/vectorized.py) against the sequential path.

The sequential path is the reference: a vectorized run must take the same steps on the same batches (island, step and
round of every `inner` event, tokens, cursors) and agree with it to float rounding (vmap may sum in another order), in
plain and Streaming DiLoCo; resume from its own checkpoints exactly; and be refused where it cannot apply.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.bench.simulator import final_params
from diloco.cli import main
from diloco.config import ConfigError, load_config, require_federated
from diloco.run.rundir import read_events
from diloco.run.setup import build_setup, make_island
from diloco.run.warm_start import newest_step
from diloco.simulator.simulate import run_simulation
from islands.data import BatchStream
from islands.island import DivergedError, Island
from islands.vectorized import IslandStack
from pytrees.naming import PyTree
from tests.conftest import cut_after_round

RTOL, ATOL = 1e-4, 1e-5
"""How close the vectorized path must stay to the sequential one (measured: well below, see `test_..._agree`)."""

PLAIN = ["model.n_layers=2"]
"""Plain DiLoCo: 3 rounds of H = 4 (two layers, as streaming needs, so every test here compiles the same model)."""
STREAM = [*PLAIN, "stream.fragments=2", "stream.overlap_steps=1"]
"""Streaming DiLoCo with P = 2, τ = 1 (tests/test_streaming.py's)."""
LOSSY = ["codec.uplink=int8", "codec.downlink=int8"]
"""int8 both ways: residuals are state too. Not in the comparison of the two paths: a quantizer turns a difference of
float rounding in Δ into a whole quantization step now and then (measured: 9e-5 in θ), which says nothing of the
inner steps."""


def island_host_fields(run_dir: Path, name: str) -> dict[str, int]:
    """The host fields (step, data_cursor) of island `name`'s newest checkpoint, from its JSON metadata."""
    step_dir = newest_step([run_dir / "checkpoints" / name])
    assert step_dir is not None
    return json.loads((step_dir / "meta" / "metadata").read_text())["state_host_fields"]


def losses(run_dir: Path, *events: str) -> tuple[list[tuple], np.ndarray]:
    """(where, loss) of a run's events of these kinds: `inner` → island/step/round and loss; commits → eval_loss."""
    found = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] in events]
    where = [(e["event"], e.get("island"), e.get("step"), e.get("round"), e.get("fragment")) for e in found]
    return where, np.array([e["loss"] if e["event"] == "inner" else e["eval_loss"] for e in found])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "streaming"])
def test_the_vectorized_and_sequential_paths_agree(tiny_config: Path, tmp_path: Path, case: str) -> None:
    overrides = PLAIN if case == "plain" else STREAM
    runs = {}
    for vectorize in (False, True):
        cfg = load_config(tiny_config, [*overrides, "train.log_every=1", f"train.vectorize={str(vectorize).lower()}"])
        run_dir = tmp_path / str(vectorize)
        runs[vectorize] = (cfg, run_dir, run_simulation(cfg, run_dir, show_progress=False))
    (seq_cfg, seq_dir, seq), (vec_cfg, vec_dir, vec) = runs[False], runs[True]

    # The same steps of the same islands on the same tokens, the same syncs and bytes.
    for key in ("rounds", "syncs", "tokens", "bytes_up", "bytes_down", "inner_steps_per_island"):
        assert vec[key] == seq[key], key
    seq_where, seq_inner = losses(seq_dir, "inner")
    vec_where, vec_inner = losses(vec_dir, "inner")
    assert vec_where == seq_where and len(seq_where) == 2 * seq["inner_steps_per_island"]  # every step of both
    commits_where, seq_eval = losses(seq_dir, "eval", "sync", "round")
    assert losses(vec_dir, "eval", "sync", "round")[0] == commits_where
    # Each island's last checkpoint: the same step counter and data cursor (host ints, in its JSON metadata).
    for name in seq_cfg.islands.island_names:
        saved = [island_host_fields(run_dir, name) for run_dir in (seq_dir, vec_dir)]
        assert saved[0] == saved[1] and saved[0]["step"] == seq["inner_steps_per_island"]
    # ... and to float rounding, every island's loss at every step, the global model's eval loss at every commit and
    # its final parameters.
    vec_eval = losses(vec_dir, "eval", "sync", "round")[1]
    seq_params, vec_params = final_params(seq_cfg, seq_dir), final_params(vec_cfg, vec_dir)
    gaps = {
        "inner loss": float(np.max(np.abs(vec_inner - seq_inner))),
        "eval loss": float(np.max(np.abs(vec_eval - seq_eval))),
        "params": max(float(np.max(np.abs(vec_params[k] - seq_params[k]))) for k in seq_params),
    }
    print(f"{case}: max |vectorized - sequential|: {gaps}")  # the figure to report (pytest -s shows it)
    np.testing.assert_allclose(vec_inner, seq_inner, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(vec_eval, seq_eval, rtol=RTOL, atol=ATOL)
    for key in seq_params:
        np.testing.assert_allclose(vec_params[key], seq_params[key], rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.mark.slow
def test_a_vectorized_run_resumes_to_the_same_parameters(tiny_config: Path, tmp_path: Path) -> None:
    """As tests/test_simulate.py's kill-and-resume for the sequential path (and test_streaming's, whose way of
    leaving what a kill right after round 1's checkpoint leaves is used here): the islands' saved states are all a
    vectorized run needs, and it ends with the digest of the uninterrupted run."""
    cfg = load_config(tiny_config, [*STREAM, *LOSSY, "train.vectorize=true"])
    run_dir = tmp_path / "run"
    reference = run_simulation(cfg, run_dir, show_progress=False)
    cut_after_round(run_dir, 1)
    resumed = run_simulation(cfg, run_dir, show_progress=False)
    events = read_events(run_dir / "metrics.jsonl")
    assert [e["round"] for e in events if e["event"] == "resumed"] == [1]
    assert [e["round"] for e in events if e["event"] == "round"] == [0, 1, 2]  # none repeated or lost
    assert resumed["params_digest"] == reference["params_digest"]
    assert resumed["final_eval_loss"] == reference["final_eval_loss"]
    assert resumed["tokens"] == reference["tokens"]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["train.mode=async"], "train.mode must be 'diloco'"),
        (["train.mode=sync"], "train.mode must be 'diloco'"),
        (["islands.devices=2"], "islands.devices must be 1"),
        (["train.round_seconds=1.5"], "train.round_seconds cannot be set"),
        (["islands.slowdown=['island-1=2']"], "islands.slowdown cannot be set"),
        (["islands.device_step_s=0.1"], "islands.device_step_s cannot be set"),
    ],
)
def test_what_cannot_be_vectorized_is_refused_in_one_line(tiny_config: Path, overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"train.vectorize = true steps every island in one program: {named}"):
        load_config(tiny_config, ["train.vectorize=true", *overrides])


def test_simulate_refuses_it_before_anything_runs_and_the_processes_refuse_it(
    tiny_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "never"
    assert (
        main(["simulate", str(tiny_config), "--run-dir", str(run_dir), "train.vectorize=true", "train.mode=sync"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "train.vectorize" in err and "train.mode" in err and "\n" not in err, err
    assert not run_dir.exists()
    with pytest.raises(ConfigError, match="train.vectorize = true .* runs in `diloco simulate` only"):
        require_federated(load_config(tiny_config, ["train.vectorize=true"]), "launch")


def _islands(tiny_config: Path, batch_sizes: tuple[int, ...] = (8, 8)) -> list[Island]:
    cfg = load_config(tiny_config, PLAIN)
    setup = build_setup(cfg)
    islands = []
    for i, size in enumerate(batch_sizes):
        stream = BatchStream(setup.streams["island-0"].tokens, size, cfg.model.seq_len, cfg.run.seed, stream_id=i)
        island = make_island(cfg, f"island-{i}", setup.model, stream, check_memory=False)
        island.start(setup.init_params)
        islands.append(island)
    return islands


def test_islands_that_cannot_share_one_program_are_refused(tiny_config: Path) -> None:
    with pytest.raises(
        ValueError, match="islands island-0 and island-1 cannot be stepped as one program: their batches differ"
    ):
        IslandStack(_islands(tiny_config, (8, 4)))


def _poisoned(params: PyTree) -> PyTree:
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [jnp.full_like(leaves[0], jnp.nan), *leaves[1:]])


@pytest.mark.slow
def test_a_diverged_island_is_named_and_the_ones_before_it_keep_their_steps(tiny_config: Path) -> None:
    islands = _islands(tiny_config)
    good, bad = islands
    assert bad.state is not None
    bad.set_params(_poisoned(bad.state.params))
    with pytest.raises(DivergedError, match=r"^island island-1 diverged: loss is nan at inner step 1; lower inner"):
        IslandStack(islands).train(3)
    assert good.state is not None and (good.state.step, good.state.data_cursor, good.stream.cursor) == (3, 3, 3)
    assert bad.state.step == 0  # not adopted: its state is the one it had (its stream moved on, as `train`'s does)
