"""The island's inner loop: same loss curve on 1 and 4 devices, with accumulation and with sharded params."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from diloco.config import load_config
from diloco.run.setup import build_setup
from islands.inner import make_inner_optimizer
from islands.island import Island
from islands.mesh import MeshError, accumulation_steps
from tests.conftest import REPO, child_env


def _curves(host_devices: int, *variants: str) -> subprocess.Popen[str]:
    """Start tests/island_curve.py in a process with `host_devices` CPU devices; `_result` reads its curves."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "island_curve.py"), *variants],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(host_devices),
        cwd=REPO,
    )


def _result(proc: subprocess.Popen[str]) -> list[dict]:
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_and_four_devices_give_the_same_curve() -> None:
    # devices:microbatch:shard_params. microbatch 2 on one device = 4 passes of 2 sequences; microbatch 1 on
    # four devices = 2 passes of 4 sequences. The two processes run at once (each compiles its own variants).
    procs = [_curves(1, "1:0:0", "1:2:0"), _curves(4, "4:0:0", "4:1:0", "4:0:1")]
    try:
        (one, accumulated), (four, four_accumulated, sharded) = [_result(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert (one["passes"], four["passes"], accumulated["passes"], four_accumulated["passes"]) == (1, 1, 4, 2)
    assert four["devices"] == 4 and sharded["sharded"] and not four["sharded"]
    assert one["losses"][-1] < one["losses"][0] - 0.3  # it learns
    assert all(c["caller_params_intact"] for c in (one, accumulated, four, four_accumulated, sharded))
    for other in (four, accumulated, four_accumulated, sharded):
        np.testing.assert_allclose(other["losses"], one["losses"], rtol=2e-4, atol=2e-4)
        assert other["param_sum"] == pytest.approx(one["param_sum"], rel=1e-4)


def test_accumulation_steps_keep_the_batch() -> None:
    assert accumulation_steps(16, 0, 4) == 1
    assert accumulation_steps(16, 2, 4) == 2
    assert accumulation_steps(16, 2, 2) == 4  # devices lost: more passes, same batch
    assert accumulation_steps(16, 4, 1) == 4
    with pytest.raises(MeshError, match="cannot be split"):
        accumulation_steps(16, 0, 3)


def test_island_asks_for_devices_it_does_not_have(tiny_config) -> None:
    cfg = load_config(tiny_config)
    setup = build_setup(cfg)
    tx = make_inner_optimizer(cfg.inner, 10)
    with pytest.raises(MeshError, match="xla_force_host_platform_device_count=64"):
        Island("x", setup.model, tx, setup.streams["island-0"], n_devices=64)


@pytest.mark.slow
def test_train_advances_step_cursor_and_never_frees_the_callers_params(tiny_config) -> None:
    cfg = load_config(tiny_config)
    setup = build_setup(cfg)
    island = Island("x", setup.model, make_inner_optimizer(cfg.inner, 10), setup.streams["island-0"])
    island.start(setup.init_params)
    run = island.train(3)
    assert island.state.step == 3 and island.state.data_cursor == 3 and run.tokens == 3 * 8 * 16
    # The params the island started from were donated only as copies: the caller's arrays are intact.
    assert all(not x.is_deleted() for x in jax.tree.leaves(setup.init_params))
    island.set_params(setup.init_params)
    island.train(1)
    assert all(not x.is_deleted() for x in jax.tree.leaves(setup.init_params))


def check_start_from_shapes(config: str) -> None:
    """In a process with 4 host devices (`test_an_island_process_starts_...`)."""
    cfg = load_config(config, ["islands.devices=4", "islands.shard_params=true"])
    setup = build_setup(cfg, islands=["island-0"], theta=False)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(setup.init_params))
    island = Island(
        "island-0", setup.model, make_inner_optimizer(cfg.inner, 10), setup.streams["island-0"], n_devices=4,
        shard_params=True,
    )  # fmt: skip
    island.start(setup.init_params)
    leaves = jax.tree.leaves(island.state.params)
    split = [x for x in leaves if len({str(s.index) for s in x.addressable_shards}) == 4]
    assert split and all(s.data.nbytes * 4 == x.nbytes for x in split for s in x.addressable_shards)
    assert all(not np.asarray(x).any() for x in leaves)  # zeros until the first pull or a checkpoint
    valued = build_setup(cfg, islands=["island-0"]).init_params
    island.set_params(valued)
    island.train(1)
    assert island.state.step == 1
    print("ok")


@pytest.mark.multiprocess
def test_an_island_process_starts_from_shapes_laid_out_on_its_devices(tiny_config) -> None:
    """An island process builds no θ_0 (`build_setup(theta=False)`: shapes only): it starts from zeros made on its
    devices in its layout, each device holding its shard alone (FSDP over 4 devices here), and trains once the global
    θ is set. (In a child process with 4 host devices.)"""
    code = f"from tests.test_island import check_start_from_shapes as c; c({str(tiny_config)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], env=child_env(4), cwd=REPO, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == ["ok"], done.stderr[-3000:]
