"""A full disk is an operational event (diloco/run/checkpoint.py, DiskFullError): one line saying where, how much and
what to do, a non-zero exit, the last complete checkpoint intact, and the same command resumes once space is freed.

The free-space check is tested anywhere by making the disk look full; the whole story on a real 3 MB tmpfs where
root may mount one (skipped elsewhere), against an uninterrupted run's parameters.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from diloco.config import load_config
from diloco.run.checkpoint import CheckpointStore
from diloco.run.rundir import DiskFullError
from diloco.simulator.simulate import run_simulation
from tests.conftest import run_cli


def test_a_save_that_cannot_fit_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    try:
        store.save(1, {"a": np.zeros(1000, np.float32)}, {})
        store.wait()
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1000))
        with pytest.raises(DiskFullError) as info:
            store.save(2, {"a": np.ones(1000, np.float32)}, {})
        message = str(info.value)
        assert message.startswith(f"no disk space for checkpoint 2 in {tmp_path / 'ckpt'} (needs about 1.1 MB, ")
        assert "run the same command again" in message and "\n" not in message
        assert store.steps() == [1] and sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1"]
    finally:
        store.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MB tmpfs (root only), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_run_whose_disk_fills_stops_in_one_line_and_resumes_once_space_is_freed(
    tiny_config: Path, tmp_path: Path, small_disk: Path
) -> None:
    overrides = ["train.rounds=4", "train.inner_steps=2"]
    args = [str(tiny_config), "--no-progress", *overrides]
    expected = run_simulation(load_config(tiny_config, overrides), tmp_path / "ref", show_progress=False)
    run_dir = small_disk / "run"
    full = run_cli("simulate", *args, "--run-dir", str(run_dir))
    assert full.returncode == 2, full.stderr
    lines = full.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco: error: no disk space for checkpoint "), full.stderr
    assert "free some space" in lines[0] and "run the same command again" in lines[0]
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # space freed
    resumed = run_cli("simulate", *args, "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    done = json.loads(resumed.stdout)
    assert done["rounds"] == 4 and done["params_digest"] == expected["params_digest"], (done, expected)
