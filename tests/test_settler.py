"""The settler's stop is bounded: a commit whose evaluation or checkpoint never ends makes a stopping coordinator
exit with one line (`WaitedTooLong`, exit 69) instead of hanging (docs/architecture.md, "Commits off the critical
path")."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import diloco.coordinator.settler as settler_module
from diloco.coordinator.settler import Settler
from floor.errors import WaitedTooLong


class StuckWorld:
    """Stands in for `GlobalRun`: its evaluation blocks until the test lets it go (a hung disk, a stuck device)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.evaluating = threading.Event()
        self.done = False
        self.store = None

    def checkpoint_meta(self) -> dict:
        return {}

    def evaluate_commit(self, pending: object) -> float:
        self.evaluating.set()
        self.release.wait()
        return 1.0


@pytest.mark.timeout(30)
def test_a_stop_waits_for_a_stuck_settle_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settler_module, "SETTLE_WAIT_S", 0.1)
    world = StuckWorld()
    cond = threading.Condition()
    settler = Settler(cond, world, keep=lambda job, loss: None, islands_done=lambda pending: True)  # type: ignore[arg-type]
    with cond:
        settler.enqueue(SimpleNamespace(commit=SimpleNamespace(round=0), round_closed=True), restore=None)  # type: ignore[arg-type]
    assert world.evaluating.wait(20)
    with pytest.raises(WaitedTooLong, match="1 commit\\(s\\) were not evaluated and checkpointed within 0.1 s"):
        settler.close()
    assert WaitedTooLong.exit_code == 69
    world.release.set()  # the settle ends after all: so does the settler's thread
    assert settler.settled(20)
