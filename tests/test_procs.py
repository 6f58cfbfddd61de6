"""The process harness's environment (diloco/harness/procs.py): what a child JAX process is given."""

from __future__ import annotations

import pytest

from diloco.harness.procs import devices_env


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
