"""The process harness (diloco/harness/procs.py): what a child JAX process is given, and what a failed wait shows."""

from __future__ import annotations

import pytest

from diloco.config import load_config
from diloco.harness.procs import MALLOC_ARENAS, MMAP_THRESHOLD, STACK_HEADER, FederationError, child_env, devices_env
from tests.conftest import REPO


@pytest.mark.parametrize(
    "given, devices, want",
    [
        ("", 1, "--xla_force_host_platform_device_count=1"),
        # A thread limit set in the launching shell reaches the islands (it used to be replaced wholesale).
        (
            "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
            2,
            "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 --xla_force_host_platform_device_count=2",
        ),
        # The run's device count wins over one in the shell.
        (
            "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x",
            4,
            "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4",
        ),
    ],
)
def test_a_child_keeps_the_users_xla_flags_with_the_runs_device_count(given: str, devices: int, want: str) -> None:
    assert devices_env(devices, given) == {"XLA_FLAGS": want}


def test_a_child_has_bounded_malloc_arenas_and_mmap_threshold_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each launched process gets MALLOC_ARENA_MAX=2 (glibc's per-thread arenas kept a commit's worth of memory each
    time another gRPC thread ran the coordinator's commit); a value the user set is kept."""
    cfg = load_config(REPO / "configs" / "smollm2-135m.toml", [])
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert child_env(cfg, {})["MALLOC_ARENA_MAX"] == MALLOC_ARENAS == "2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert child_env(cfg, {})["MALLOC_ARENA_MAX"] == "8"
    # and freed blocks of 1 MiB or more go back to the system (the processes of one host peak at different times)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert child_env(cfg, {})["MALLOC_MMAP_THRESHOLD_"] == MMAP_THRESHOLD == str(1 << 20)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert child_env(cfg, {})["MALLOC_MMAP_THRESHOLD_"] == "33554432"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_wait_that_runs_out_shows_where_each_live_process_waits(federation) -> None:
    """When a wait of the harness runs out, every live process is asked for its threads' stacks (SIGUSR1), goes on,
    and the failure shows them: island-0, held at a named point, is seen waiting there."""
    from tests.conftest import WAIT_S

    fed = federation(pause_at=["island-0:before_push:0"])
    fed.start_coordinator()
    fed.start_island("island-0")
    fed.paused("island-0:before_push:0", WAIT_S)
    with pytest.raises(FederationError) as failure:
        fed.wait_for(lambda: None, 0.0, "a condition that never holds")
    shown = str(failure.value)
    assert "waiting for a condition that never holds" in shown
    island = shown[shown.index("island-0.log") :]
    assert STACK_HEADER in island and "in _stop" in island, shown
    assert all(proc.poll() is None for proc in fed.processes().values())  # the signal ended nothing
