"""A dead island is noticed at once, not when its lease runs out (diloco/worker/supervisor.py, `island_worker.say_gone`).

Real processes: a coordinator, a survivor and a supervised victim (`diloco island` without --no-supervise). The
victim's *worker* is SIGKILLed where it stopped after training round 1, before its push (a named point,
diloco/faults.py), once the survivor's push of that round is in; its supervisor sees the death, sends a Leave with the island's own
credentials, and restarts the worker. The lease is 120 s, and so is the grace a broken presence call gets
(transport/presence.py: the worker's death breaks it too; tests/test_presence.py and test_federation.py test that
path), so a round that closes in seconds closed because of that Leave.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from diloco.harness.procs import Federation
from tests.conftest import JAX_CACHE, JAX_CACHE_ENV, REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

H = 4
"""Inner steps per round: tiny, the victim waits at a named point for its kill (diloco/faults.py)."""
ENV = {
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "PYTHONWARNINGS": JAX_CACHE_ENV["PYTHONWARNINGS"],
}
KILL_AT = "island-1:before_push:1"
"""The victim's worker dies after training round 1, before its push."""


@pytest.mark.timeout(600)
def test_a_killed_worker_is_reported_by_its_supervisor_and_the_round_goes_on(tiny_config: Path, tmp_path: Path) -> None:
    overrides = [
        f"train.inner_steps={H}",
        "train.rounds=3",
        "quorum.lease_s=120",
        "quorum.reconnect_grace_s=120",
        "quorum.min_deadline_s=1",
        "quorum.max_deadline_s=300",
        "network.pull_wait_s=2",
        "train.checkpoint_every=1",
    ]
    with Federation(
        tiny_config, overrides, tmp_path / "run", cwd=REPO, env=ENV, jax_cache=JAX_CACHE, pause_at=[KILL_AT]
    ) as fed:
        fed.start_coordinator()
        # The victim first: a supervised island starts seconds later than a bare one, and the survivor alone could
        # finish the whole run before the victim joined.
        fed.start_island("island-1", supervised=True)
        fed.wait_for(lambda: fed.events("joined", island="island-1"), 300, "island-1 to join")
        fed.start_island("island-0")
        # Kill the victim's worker where it stopped, once the survivor's push of round 1 is in: round 1 then waits
        # for the victim alone (the deadline is max_deadline_s until three rounds have been timed).
        worker = fed.paused(KILL_AT, 300)["pid"]
        fed.wait_for(
            lambda: [e for e in fed.events("push") if e["round"] == 1 and e["island"] == "island-0"],
            300,
            "island-0's push of round 1",
        )
        assert [r["round"] for r in fed.wait_rounds(1, 300)] == [0]
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        left = fed.wait_for(lambda: fed.events("island_left"), 60, "the supervisor's Leave")
        closed = fed.wait_rounds(2, 120)[1]
        closed_after_s = time.monotonic() - killed_at
        summary = fed.wait_done(300)
    assert left[0]["island"] == "island-1" and left[0]["reason"] == "worker died (signal 9)", left
    # Round 1 closed without the victim, at its supervisor's Leave: its restarted worker takes seconds to rejoin.
    assert closed["islands"] == ["island-0"] and closed["reason"].startswith("all 1 live islands pushed"), closed
    assert closed_after_s < 60, closed_after_s  # long before its 120 s lease (seconds, on a quiet machine)
    assert summary["rounds"] == 3 and summary["islands_lost"] == 0  # a Leave, not a lease expiry
    print(f"round 1 closed {closed_after_s:.2f} s after the SIGKILL")
