"""The whole process's cost model (islands/memory.py, `ProcessPlan`) and its check before the first step
(diloco/run/memory_plan.py): islands that do not fit together are one line, before any state exists; a run that fits
runs."""

from __future__ import annotations

import math
import resource
from pathlib import Path

import jax
import numpy as np
import pytest

from diloco.bench.big import SMOKE
from diloco.cli import main
from diloco.config import load_config
from diloco.run.memory_plan import (
    COORDINATOR,
    check_process,
    codec_ratio,
    launch_need,
    launch_plans,
    launch_refusal,
    plan,
)
from diloco.run.setup import Evaluator, build_setup, make_island
from floor.codec import CodecSpec
from islands.island import InnerRun, RoundPush
from islands.memory import CHECKPOINT_WRITE, GB, RUNTIME, Footprint, OutOfMemoryError, ProcessPlan, Room, host_room
from pytrees.encode import aligned_copy
from pytrees.feedback import compress_tree
from pytrees.naming import to_host
from tests.conftest import REPO

MB = 10**6
P = 100 * MB
STEP = Footprint(arguments=3 * P, outputs=3 * P, aliased=3 * P, temp=250 * MB, code=0)


def _plan(**kw: object) -> ProcessPlan:
    base: dict = dict(islands=2, params=P, largest_leaf=P // 2, inner_state=2 * P, step=STEP, outer_state=P)
    return ProcessPlan(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "held", "phases"),
    [
        # fp32 both ways, mean: islands θ + AdamW (3P each), the coordinator θ + momentum (2P)
        ({}, 8 * P, {"a first step": 5.5 * P, "a sync": 4 * P + 5 * P, "a checkpoint": 3 * P}),
        # lossy codecs: each side keeps a residual; a push is Δ and its int8 bytes; the commit adds u + e, û, e', bytes
        (
            {"uplink_lossy": True, "downlink_lossy": True, "uplink_ratio": 0.25, "downlink_ratio": 0.25},
            11 * P,
            {"a first step": 5.5 * P, "a sync": 2.5 * P + 4 * P + P + 3.25 * P, "a checkpoint": 4 * P},
        ),
        # trimmed_mean stacks N copies of the largest leaf and sorts them
        ({"order_statistic": True}, 8 * P, {"a sync": 4 * P + 5 * P + 2 * 2 * P // 2}),
        # every island's step at once (train.vectorize), on 2 host devices each
        ({"stepped_together": True, "step_sharers": 2}, 8 * P, {"a first step": 3 * P + 2 * 2 * 2.5 * P}),
        # the evaluation: beside the pushes and the commit's new θ and momentum
        ({"evaluation": Footprint(P, 0, 0, 4 * P, 0)}, 8 * P, {"an evaluation": 4 * P + 2 * P + 5 * P}),
        # no coordinator (an island process): its state, its first step, its checkpoint
        ({"coordinator": False, "islands": 1}, 3 * P, {"a first step": 5.5 * P, "a checkpoint": 3 * P}),
        # rl: the islands' frozen reference, one copy beside them
        ({"reference": P}, 9 * P, {"a first step": 5.5 * P, "a checkpoint": 3 * P}),
        # an island process of a federation: its own copy of the global θ beside its state; its push (Δ), its pull
        # (both bytes, û and the new θ) and its checkpoint (θ + AdamW copied, orbax's 0.8 of it, the next step's 2.5P)
        (
            {"coordinator": False, "islands": 1, "global_copy": True},
            4 * P,
            {"a first step": 5.5 * P, "a push": P, "a pull": 4 * P, "a checkpoint": 3 * P + 2.4 * P + 2.5 * P},
        ),
        # the same with int8 both ways: the residual held and saved; the push adds Δ̂, the residual and its bytes
        (
            {"coordinator": False, "islands": 1, "global_copy": True, "uplink_lossy": True}
            | {"uplink_ratio": 0.25, "downlink_ratio": 0.25},
            5 * P,
            {"a push": 3.25 * P, "a pull": 2.5 * P, "a checkpoint": 4 * P + 3.2 * P + 2.5 * P},
        ),
        # orbax's write window bounds its buffers (P / 2 here, below 0.8 of the 4P saved)
        (
            {"coordinator": False, "islands": 1, "global_copy": True, "uplink_lossy": True, "write_window": P // 2},
            5 * P,
            {"a checkpoint": 4 * P + P / 2 + 2.5 * P},
        ),
        # a federation's coordinator: no island's state; the last two pushes' receive buffers and the last commit's
        # bytes twice kept between syncs (4P at fp32); at a sync its 2 islands' pushes; it saves beside the state
        # before the commit (2P), the pushes (2P), orbax's copy of θ (P) and its write buffers (0.8 of 2P)
        ({"islands": 0, "pushers": 2}, 6 * P, {"a sync": 4 * P + 5 * P, "a checkpoint": 2 * P + 2 * P + P + 1.6 * P}),
        # each process of a launch holds its runtime besides
        ({"islands": 0, "pushers": 2, "runtime": P // 2}, 6.5 * P, {"a sync": 9 * P}),
    ],
)
def test_the_cost_model(kw: dict, held: float, phases: dict[str, float]) -> None:
    process = _plan(**kw)
    assert process.held == held
    got = process.phases()
    for name, expected in phases.items():
        assert got[name] == expected, name
    assert process.peak == held + max(got.values())


def test_a_coordinator_alone_has_no_first_step() -> None:
    coordinator = _plan(islands=0, pushers=2)
    assert "a first step" not in coordinator.phases()
    assert coordinator.describe() == "the coordinator 600 MB and at the peak a sync 900 MB"


def test_a_launch_is_refused_in_one_line_when_its_processes_do_not_fit() -> None:
    island = _plan(islands=1, coordinator=False, global_copy=True)  # held 4P, peak 11.9P (its checkpoint)
    coordinator = _plan(islands=0, pushers=2)  # held 6P, peak 15P (a sync)
    plans = {"a": island, "b": island, COORDINATOR: coordinator}
    # the islands' peaks with the coordinator's held bytes (29.8P), or their states with its sync (23P)
    need = 2 * 11.9 * P + 6 * P
    assert launch_need(plans) == max(need, 2 * 4 * P + 15 * P) == need
    assert launch_refusal(plans, Room(int(need), "the host has enough")) is None
    assert launch_refusal(plans, None) is None  # the room unknown: no refusal on a guess
    line = launch_refusal(plans, Room(int(need) - 1, "the host has 2.98 GB available"))
    assert line is not None and "\n" not in line
    assert line.startswith("the 3 processes of this launch need about 2.98 GB together (peaks: a 1.19 GB, b 1.19 GB, ")
    assert "coordinator 1.50 GB), the host has 2.98 GB available; shrink the model" in line


def test_an_unknown_step_counts_its_copies_only() -> None:
    assert _plan(step=None).phases()["a first step"] == 3 * P


def test_the_description_names_the_parts() -> None:
    text = _plan().describe()
    assert text == "2 islands of 300 MB each, the coordinator 200 MB and at the peak a sync 900 MB"
    with_reference = _plan(reference=P).describe()
    assert (
        with_reference
        == "2 islands of 300 MB each, the coordinator 200 MB, the reference 100 MB and at the peak a sync 900 MB"
    )


def test_codec_ratios() -> None:
    assert codec_ratio(CodecSpec(kind="fp32")) == 1.0
    assert 0.25 < codec_ratio(CodecSpec(kind="int8")) < 0.27  # a byte per value and a scale per block
    assert codec_ratio(CodecSpec(kind="int4")) < codec_ratio(CodecSpec(kind="int8"))


def test_to_host_leaves_no_copy_inside_the_array() -> None:
    """np.asarray keeps its host copy inside a JAX array for the array's life: a second θ held by every island's
    Δ until its next step. `to_host` copies each shard and leaves the array as it was."""
    x = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4))
    host = to_host(x)
    np.testing.assert_array_equal(host, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert x._npy_value is None  # JAX's cache of np.asarray (which the old path filled)
    plain = np.ones(3, np.float32)
    assert to_host(plain) is plain  # host arrays as they are: no copy


def _islands(cfg_path: Path, overrides: list[str]) -> tuple:
    cfg = load_config(cfg_path, overrides)
    setup = build_setup(cfg)
    islands = [make_island(cfg, n, setup.model, setup.streams[n]) for n in cfg.islands.island_names]
    return cfg, setup, islands, Evaluator(setup.model, setup.eval_stack)


@pytest.mark.slow
def test_the_plan_is_measured_from_the_run(tiny_config: Path) -> None:
    cfg, setup, islands, evaluate = _islands(tiny_config, ["codec.uplink=int8", "codec.downlink=fp32"])
    process = plan(cfg, setup, islands, evaluate)
    n_params = sum(int(np.size(x)) for x in jax.tree.leaves(setup.init_params))
    assert process.params == 4 * n_params and process.islands == 2
    assert 2 * process.params <= process.inner_state <= 2 * process.params + 64  # AdamW's moments and its count
    assert process.outer_state == process.params  # Nesterov's momentum
    assert process.uplink_lossy and not process.downlink_lossy
    assert process.step is not None and process.step.temp > 0  # XLA's figure for the step
    assert process.evaluation is not None and process.evaluation.total > 0
    # Fits: the plan comes back. Injected rooms either side of its peak: the refusal is exactly at the peak.
    assert check_process(cfg, setup, islands, evaluate, room=Room(process.peak, "the host has enough")) == process
    with pytest.raises(OutOfMemoryError) as refused:
        check_process(cfg, setup, islands, evaluate, room=Room(process.peak - 1, "the host has 1 byte too few"))
    line = str(refused.value)
    assert line.startswith("this run needs about ") and "\n" not in line
    assert "2 islands of " in line and "the host has 1 byte too few" in line
    assert "lower islands.count (2)" in line and "lower train.batch_size (8)" in line
    assert all(island.state is None for island in islands)  # nothing was placed


@pytest.mark.slow
def test_islands_that_do_not_fit_together_are_one_line_before_any_step(
    tmp_path: Path, tiny_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each island's step fits on its own; the islands together do not: asked for as many as the host cannot hold
    (from what it has free now), `simulate` refuses in one line before any island's state exists."""
    widen = ["model.vocab_size=32768", "model.d_model=1024", "model.n_heads=8", "model.d_ff=1024", "model.n_layers=1"]
    cfg, setup, islands, evaluate = _islands(tiny_config, widen)
    room = host_room()
    assert room is not None
    each = plan(cfg, setup, islands[:1], evaluate).island_state
    count = math.ceil(room.free / each) + 1
    if count > 400:
        pytest.skip(f"this host would need {count} islands to run out")
    names = "[" + ",".join(f"'i{i}'" for i in range(count)) + "]"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run_dir = tmp_path / "run"
    args = ["simulate", str(tiny_config), *widen, f"islands.count={count}", f"islands.names={names}"]
    assert main([*args, "--run-dir", str(run_dir), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error: this run needs about "), err
    assert f"{count} islands of " in err and f"lower islands.count ({count})" in err, err
    assert "\n" not in err and "Traceback" not in err
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 2 * GB  # no island's state was ever placed
    events = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
    assert '"island_joined"' not in events and '"inner"' not in events


def test_an_aligned_host_copy_is_placed_without_another() -> None:
    """place_tree's copy is 64-byte aligned so that XLA:CPU takes it as its buffer (one θ per placement, not two):
    the premise checked on this JAX, and the copy is the caller's array's bytes, not the array."""
    x = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
    copy = aligned_copy(x)
    assert copy.ctypes.data % 64 == 0 and copy.dtype == x.dtype and not np.shares_memory(copy, x)
    np.testing.assert_array_equal(copy, x)
    placed = jax.device_put(copy, jax.devices("cpu")[0])
    assert placed.unsafe_buffer_pointer() == copy.ctypes.data
    as_f32 = aligned_copy(np.ones(3, np.float16), np.float32)
    assert as_f32.dtype == np.float32 and as_f32.ctypes.data % 64 == 0


def test_a_push_on_the_wire_keeps_its_bytes_and_residual_only() -> None:
    """An island process never reads the Δ̂ the coordinator decodes: the push it keeps until its commit comes back
    lets it go (one θ less through the wait, the pull and the checkpoint)."""
    delta = {"w": np.linspace(-1, 1, 4096, dtype=np.float32)}
    run = InnerRun(losses=np.ones(1, np.float32), tokens=8, seconds=0.0, first_step=0)
    push = RoundPush(run, compress_tree(delta, {"w": np.zeros(4096, np.float32)}, CodecSpec(kind="int8")))
    kept = push.for_the_wire()
    assert push.sent.decoded is not None and kept.sent.decoded is None
    assert kept.sent.encoded is push.sent.encoded and kept.sent.residual is push.sent.residual
    assert kept.for_the_wire() is kept


@pytest.mark.slow
def test_a_launch_plan_of_a_known_shape() -> None:
    """The SmolLM2 config at the bench's smoke size (a Llama of 278,848 parameters), int8 both ways, 2 islands: each
    process of its launch is planned with its runtime, an island process with its global copy and its own phases,
    the coordinator with both islands' pushes and what it keeps between syncs."""
    cfg = load_config(REPO / "configs" / "smollm2-135m.toml", SMOKE)
    plans = launch_plans(cfg, build_setup(cfg))
    assert set(plans) == {"us-east", "eu-west", COORDINATOR}
    island, coordinator = plans["us-east"], plans[COORDINATOR]
    P = island.params
    assert P == 4 * 278_848 and coordinator.params == P
    up, down = int(P * island.uplink_ratio), int(P * island.downlink_ratio)
    assert 0.25 < island.uplink_ratio == island.downlink_ratio < 0.27  # int8: a byte a value and its scales
    assert island.held == RUNTIME + P + island.inner_state + P + P  # θ, AdamW, the residual, the global copy
    assert set(island.phases()) == {"a first step", "a push", "a pull", "a checkpoint"}
    assert island.phases()["a pull"] == up + down + 2 * P
    assert coordinator.held == RUNTIME + 3 * P + 2 * up + 2 * down  # θ, momentum, residual; the kept bytes
    assert coordinator.phases()["a checkpoint"] == 3 * P + 2 * P + 2 * P + int(3 * P * CHECKPOINT_WRITE)
    assert launch_need(plans) == max(2 * island.peak + coordinator.held, 2 * island.held + coordinator.peak)
