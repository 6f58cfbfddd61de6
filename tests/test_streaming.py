"""Streaming DiLoCo (outer_optimizer/fragments.py, `diloco.simulator.simulate.Lockstep`), checked by hand.

A linear model a reader can follow on paper: two "blocks" of one weight each, w = (w0, w1), fragment 0 = w0 and
fragment 1 = w1 (P = 2, strided). Island i's loss is ½·Σ_l (w_l - c_i)², c_0 = 0 and c_1 = 4, so one inner SGD step
with η = ½ is w <- (w + c_i) / 2. The outer step is SGD with lr ½ on the token-weighted mean (equal weights here):
g <- g - ½·mean_i(g - w_i). Everything starts at 8. H = 2, so with P = 2 a fragment syncs after every step
(S = H / P = 1): fragment 0 after steps 1, 3, ..., fragment 1 after steps 2, 4, ...; the merge of a fragment synced
after step t happens after step t + τ: w_p <- α·w_p + (1 - α)·g_p. At a step with both, the sync comes first.

Every value below is a short binary fraction, so float32 holds it exactly and the test compares with ==.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco.bench.streaming import run_streaming_bench
from diloco.config import ConfigError, StreamConfig, load_config
from diloco.run.rounds import OuterLoop
from diloco.run.rundir import read_events
from diloco.run.setup import build_setup
from diloco.simulator.simulate import Lockstep, run_simulation
from floor.codec import CodecSpec
from islands.island import Island
from islands.models.base import Model
from outer_optimizer.aggregate import mean
from outer_optimizer.fragments import Fragments
from pytrees.naming import flatten_named
from tests.conftest import cut_after_round

FP32 = CodecSpec(kind="fp32")


class ConstantStream:
    """Batches of one token whose value is the island's target c_i (batch_size 1, seq_len 1: 1 token per step)."""

    batch_size, seq_len, cursor = 1, 1, 0

    def __init__(self, c: int) -> None:
        self.c = c

    def next(self) -> np.ndarray:
        self.cursor += 1
        return np.full((1, 2), self.c, np.int32)


def linear_model() -> Model:
    def init(key: jax.Array) -> dict:
        return {"blocks": [{"w": jnp.full((1,), 8.0)}, {"w": jnp.full((1,), 8.0)}]}

    def loss(params: dict, batch: jax.Array) -> tuple[jax.Array, dict]:
        c = jnp.mean(batch.astype(jnp.float32))
        value = 0.5 * sum(jnp.sum((block["w"] - c) ** 2) for block in params["blocks"])
        return value, {"ce": value}

    return Model(init=init, loss=loss)


def run(fragments: int, tau: int, alpha: float, syncs: int) -> tuple[list[float], list[list[float]]]:
    """Train two islands with `Lockstep` until `syncs` fragment commits; return global w and each island's w."""
    model = linear_model()
    params = model.init(jax.random.key(0))
    sizes = {name: 1 for name in flatten_named(params)}
    loop = OuterLoop.fresh(params, optax.sgd(0.5), FP32, mean, Fragments.split(sizes, fragments))
    islands = [Island(f"island-{i}", model, optax.sgd(0.5), ConstantStream(c)) for i, c in enumerate((0, 4))]
    for island in islands:
        island.start(params)
    stream = StreamConfig(fragments=fragments, overlap_steps=tau, merge_alpha=alpha)
    lockstep = Lockstep(islands, loop, inner_steps=2, stream=stream)
    commits = []
    while len(commits) < syncs:
        lockstep.advance(lambda pushes: commits.append(loop.commit()) or commits[-1])

    def ws(tree: dict) -> list[float]:
        return [float(np.asarray(v)[0]) for v in flatten_named(tree).values()]

    return ws(loop.params), [ws(island.state.params) for island in islands]


# (P, τ, α, syncs): expected global (g0, g1) and islands ((w0, w1) of island 0, of island 1), worked out below.
CASES = {
    # Plain DiLoCo: 2 steps, island 0: 8 -> 4 -> 2, island 1: 8 -> 6 -> 5; Δ = (6, 3), mean 4.5; g = 8 - 2.25 = 5.75.
    "plain": ((1, 0, 0.0, 1), (5.75, 5.75), ((5.75, 5.75), (5.75, 5.75))),
    # τ=0, α=0. Step 1: i0 (4, 4), i1 (6, 6); sync f0: Δ0 = (4, 2), g0 = 8 - 1.5 = 6.5; merge: w0 = 6.5.
    # Step 2: i0 (3.25, 2), i1 (5.25, 5); sync f1: Δ1 = (6, 3), g1 = 5.75; merge: w1 = 5.75.
    # Step 3: i0 (1.625, 2.875), i1 (4.625, 4.875); sync f0: Δ0 = (4.875, 1.875), g0 = 6.5 - 1.6875 = 4.8125.
    "tau0-alpha0": ((2, 0, 0.0, 3), (4.8125, 5.75), ((4.8125, 2.875), (4.8125, 4.875))),
    # τ=1, α=0. Step 1: i0 (4, 4), i1 (6, 6); sync f0: g0 = 6.5 (merged after step 2).
    # Step 2: i0 (2, 2), i1 (5, 5); sync f1: Δ1 = (6, 3), g1 = 5.75; merge f0: w0 = 6.5.
    # Step 3: i0 (3.25, 1), i1 (5.25, 4.5); sync f0: Δ0 = (3.25, 1.25), g0 = 6.5 - 1.125 = 5.375; merge f1: w1 = 5.75.
    "tau1-alpha0": ((2, 1, 0.0, 3), (5.375, 5.75), ((3.25, 5.75), (5.25, 5.75))),
    # τ=0, α=½. Step 1: i0 (4, 4), i1 (6, 6); g0 = 6.5; merge: w0 = (4 + 6.5)/2 = 5.25, (6 + 6.5)/2 = 6.25.
    # Step 2: i0 (2.625, 2), i1 (5.125, 5); Δ1 = (6, 3), g1 = 5.75; merge: w1 = 3.875, 5.375.
    # Step 3: i0 (1.3125, 1.9375), i1 (4.5625, 4.6875); Δ0 = (5.1875, 1.9375), g0 = 6.5 - 1.78125 = 4.71875;
    # merge: w0 = (1.3125 + 4.71875)/2 = 3.015625, (4.5625 + 4.71875)/2 = 4.640625.
    "tau0-alpha-half": ((2, 0, 0.5, 3), (4.71875, 5.75), ((3.015625, 1.9375), (4.640625, 4.6875))),
    # τ=1, α=½. Step 1: i0 (4, 4), i1 (6, 6); g0 = 6.5. Step 2: i0 (2, 2), i1 (5, 5); g1 = 5.75; merge f0:
    # w0 = (2 + 6.5)/2 = 4.25, (5 + 6.5)/2 = 5.75. Step 3: i0 (2.125, 1), i1 (4.875, 4.5); Δ0 = (4.375, 1.625),
    # g0 = 6.5 - 1.5 = 5; merge f1: w1 = (1 + 5.75)/2 = 3.375, (4.5 + 5.75)/2 = 5.125.
    "tau1-alpha-half": ((2, 1, 0.5, 3), (5.0, 5.75), ((2.125, 3.375), (4.875, 5.125))),
    # α=1 keeps the local copy: the islands never take the global fragments, whatever τ. Steps: i0 4, 2, 1 and
    # i1 6, 5, 4.5 on both weights; g0 = 6.5, g1 = 8 - 2.25 = 5.75, then Δ0 = (5.5, 2), g0 = 6.5 - 1.875 = 4.625.
    "tau0-alpha1": ((2, 0, 1.0, 3), (4.625, 5.75), ((1.0, 1.0), (4.5, 4.5))),
    "tau1-alpha1": ((2, 1, 1.0, 3), (4.625, 5.75), ((1.0, 1.0), (4.5, 4.5))),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_streaming_matches_the_values_worked_out_by_hand(case: str) -> None:
    (fragments, tau, alpha, syncs), want_global, want_islands = CASES[case]
    got_global, got_islands = run(fragments, tau, alpha, syncs)
    assert got_global == list(want_global)
    assert got_islands == [list(w) for w in want_islands]


# -- the driver: simulate with [stream] ---------------------------------------------------------------------------

STREAM = [
    "model.n_layers=2",
    "stream.fragments=2",
    "stream.overlap_steps=1",
    "codec.uplink=int8",
    "codec.downlink=int8",
]


@pytest.mark.slow
def test_streaming_simulate_resumes_bit_identically(tiny_config: Path, tmp_path: Path) -> None:
    """Checkpoints are taken at round ends, where fragment P-1's merge is still τ steps away: a resumed run must
    rebuild that pending merge from the schedule, with the per-fragment outer states and residuals restored."""
    cfg = load_config(tiny_config, STREAM)
    run_dir = tmp_path / "run"
    reference = run_simulation(cfg, run_dir, show_progress=False)  # uninterrupted: the figures to end with
    cut_after_round(run_dir, 1)
    resumed = run_simulation(cfg, run_dir, show_progress=False)
    events = read_events(run_dir / "metrics.jsonl")
    assert [e["round"] for e in events if e["event"] == "resumed"] == [1]
    assert [(e["round"], e["fragment"]) for e in events if e["event"] in ("sync", "round")] == [
        (r, p) for r in range(3) for p in range(2)
    ]
    assert resumed["params_digest"] == reference["params_digest"]
    assert resumed["final_eval_loss"] == reference["final_eval_loss"]
    assert resumed["syncs"] == reference["syncs"] == 6


@pytest.mark.slow
def test_the_streaming_bench_measures_each_sync_sending_only_its_fragment(tiny_config: Path, tmp_path: Path) -> None:
    """`diloco bench streaming`, one round: fp32 is 4 bytes per element, so the fragments' syncs of a round add up to
    one plain sync, and each is smaller (not half: this tiny model's token embedding weighs as much as a block)."""
    cfg = load_config(tiny_config, ["model.n_layers=2", "train.rounds=1", "train.checkpoint_every=0"])
    r = run_streaming_bench(cfg, tmp_path / "bench", fragments=2, overlap=1, alpha=0.0)
    plain_bytes = 2 * 4 * build_setup(cfg, islands=()).n_params  # 2 islands, all of θ once
    assert r["syncs"] == {"plain": 1, "streaming": 2}
    assert r["bytes_up"] == {"plain": plain_bytes, "streaming": plain_bytes}
    assert r["peak_bytes_up_per_sync"]["plain"] == plain_bytes
    assert 1.4 < r["peak_reduction"] < 2.0, r
    assert 0.9 < r["ratio_streaming_over_plain"] < 1.1, r


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["stream.fragments=3"], "train.inner_steps (4) must be a multiple of stream.fragments (3)"),
        (["stream.overlap_steps=4"], "stream.overlap_steps must be in [0, train.inner_steps)"),
        (["stream.merge_alpha=2"], "stream.merge_alpha must be in [0, 1]"),
        (["train.inner_steps=8", "stream.fragments=8"], "splits into at most 5 parts (1 repeated blocks and 4 other"),
    ],
)
def test_a_stream_setting_that_cannot_run_is_one_line(tiny_config: Path, overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_setup(load_config(tiny_config, overrides), islands=())
    assert words in str(info.value) and "\n" not in str(info.value)


def test_the_processes_refuse_the_data_parallel_baseline_in_one_line(tiny_config: Path) -> None:
    from diloco.config import require_federated

    with pytest.raises(ConfigError, match=r"^launch: train.mode = 'sync' \(the data-parallel baseline\) runs in"):
        require_federated(load_config(tiny_config, ["train.mode=sync"]), "launch")
    require_federated(load_config(tiny_config, ["train.mode=async"]), "launch")
    require_federated(load_config(tiny_config, ["stream.fragments=2"]), "launch")  # streaming runs in the processes
