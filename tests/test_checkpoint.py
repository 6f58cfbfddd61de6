"""diloco/run/checkpoint.py: a step saved again holds the newer state (orbax alone keeps the first one silently)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from diloco.run import checkpoint
from diloco.run.checkpoint import CheckpointStore
from tests.conftest import child_env

pytestmark = pytest.mark.timeout(60)


def test_a_step_saved_again_is_replaced(tmp_path: Path) -> None:
    # An island that resynced behind a restarted coordinator saves round 2 again, from a different θ_2.
    store = CheckpointStore(tmp_path / "ckpt")
    try:
        store.save(2, {"a": np.zeros(3, np.float32)}, {"version": 1})
        store.save(2, {"a": np.ones(3, np.float32)}, {"version": 2})
        store.wait()
        state, meta = store.restore(2, {"a": np.zeros(3, np.float32)})
        assert meta == {"version": 2}
        np.testing.assert_array_equal(state["a"], np.ones(3, np.float32))
        assert store.steps() == [2]
        assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["2"]  # the old step is gone, not set aside
    finally:
        store.close()


def test_a_replacement_interrupted_by_a_kill_leaves_no_half_step(tmp_path: Path) -> None:
    # A kill after the old step was moved aside and before its removal finished: the half-removed copy must be
    # neither a step nor left behind.
    store = CheckpointStore(tmp_path / "ckpt")
    store.save(1, {"a": np.zeros(3, np.float32)}, {"version": 1})
    store.close()
    half = tmp_path / "ckpt" / ".replaced-2-dead"
    (half / "state").mkdir(parents=True)
    reopened = CheckpointStore(tmp_path / "ckpt")
    try:
        assert reopened.steps() == [1]
        assert not half.exists()
    finally:
        reopened.close()


@pytest.mark.slow  # a child process that imports JAX
def test_a_save_killed_midway_leaves_the_last_step_and_no_temporary_directory(tmp_path: Path) -> None:
    """A process SIGKILLed while orbax writes step 2 (its temporary directory on disk): the next store opened there
    restores step 1 and removes step 2's temporary directory, which would otherwise stay for good (orbax removes it
    on a thread of its own, awaited by the next save)."""
    ckpt = tmp_path / "ckpt"
    child = (
        "import os, signal, sys\n"
        "import numpy as np\n"
        "from pathlib import Path\n"
        "from diloco.run.checkpoint import CheckpointStore\n"
        "store = CheckpointStore(Path(sys.argv[1]))\n"
        "store.save(1, {'a': np.zeros(3, np.float32)}, {'version': 1})\n"
        "store.wait()\n"
        "store.save(2, {'a': np.ones(1 << 24, np.float32)}, {'version': 2})  # 64 MB, written asynchronously\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", child, str(ckpt)], env=child_env(), timeout=50)
    assert done.returncode == -signal.SIGKILL
    assert [p.name for p in ckpt.iterdir() if "tmp" in p.name], "the kill came after step 2 was whole"
    store = CheckpointStore(ckpt)
    try:
        assert store.steps() == [1]
        _, meta = store.restore(1, {"a": np.zeros(3, np.float32)})
        assert meta == {"version": 1}
        store.save(3, {"a": np.zeros(3, np.float32)}, {"version": 3})
        store.wait()
        assert sorted(p.name for p in ckpt.iterdir()) == ["1", "3"]
    finally:
        store.close()


def test_an_array_larger_than_the_write_window_widens_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """orbax writes at most the window's bytes at once (its buffers stay within it) and refuses an array larger than
    the window: the store widens the window to the state's largest array, and the step restores whole."""
    monkeypatch.setattr(checkpoint, "WRITE_WINDOW", 1000)
    store = CheckpointStore(tmp_path / "ckpt")
    try:
        state = {"big": jnp.arange(1 << 20, dtype=jnp.float32), "small": jnp.ones(3)}  # 4 MiB > 1000 + 1 MiB
        store.save(0, state, {"round": 0})
        store.wait()
        restored, meta = store.restore(0, {k: jnp.zeros_like(v) for k, v in state.items()})
        assert meta == {"round": 0}
        for name, array in state.items():
            np.testing.assert_array_equal(restored[name], array)
    finally:
        store.close()
