"""An elastic federation of real processes: an island admitted into a live run joins at the next sync point without
holding up the round open when it arrives, trains on θ bit-identical to the coordinator's, and is retired again;
its credential is refused from then on (docs/architecture.md, "Elastic federation")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from diloco.harness.procs import Federation
from tests.conftest import ENV, REPO, WAIT_S

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

OPERATOR = {"DILOCO_TEST_OPERATOR": "the-operators-secret"}
ELASTIC = [
    "quorum.min_islands=1.0",
    "quorum.min_deadline_s=30",
    "quorum.max_deadline_s=60",
    "quorum.lease_s=60",
    "network.operator_secret=env:DILOCO_TEST_OPERATOR",
    "islands.max=3",
]
"""A federation the operator may grow by one island: every live island waited for, faults noticed by presence."""


def operator_command(fed: Federation, *argv: str) -> dict:
    """`diloco admit|retire ...` as the operator types it, against the federation's coordinator; its JSON answer."""
    done = subprocess.run(
        [sys.executable, "-m", "diloco.cli", *argv, "--coordinator", fed.address, *fed.overrides],
        env={**os.environ, **ENV, **OPERATOR},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_an_island_admitted_into_a_live_run_joins_trains_and_is_retired(
    federation: Callable[..., Federation], tmp_path: Path
) -> None:
    rounds = 7
    # island-0 waits before its push of round 2 while sa-east is admitted and starts: sa-east joins during round 2
    # without θ_2, so round 2 must not wait for it (it closes as soon as island-0 and island-1 pushed). sa-east waits
    # before a push of round 2 until round 2 is committed: on a busy machine its push could otherwise land before
    # island-0's, and round 2 take it (a late joiner's push counts when it comes in time). island-1 waits before its
    # push of round 5 while sa-east is retired. Neither configured island pushes round 0 before both hold it: one that
    # starts much later on a busy machine would otherwise join as a late joiner, rounds behind.
    first = ["island-0:before_push:0", "island-1:before_push:0"]
    pauses = [*first, "island-0:before_push:2", "island-1:before_push:5", "sa-east:before_push:2"]
    fed = federation(f"train.rounds={rounds}", *ELASTIC, pause_at=pauses)
    fed.env.update(OPERATOR)
    fed.start()
    fed.release_together(first, WAIT_S)
    fed.paused("island-0:before_push:2", WAIT_S)
    kit = operator_command(fed, "admit", fed.config, "sa-east", "--out", str(tmp_path / "kit"))
    assert kit["round"] == 2 and kit["secret"] == f"file:{tmp_path / 'kit' / 'sa-east.secret'}", kit
    fed.start_island("sa-east", args=["--secret", kit["secret"]])
    fed.wait_for(lambda: fed.events("island_joined") and fed.events("island_joined")[-1]["island"] == "sa-east",
                 WAIT_S, "sa-east to join")  # fmt: skip
    fed.release("island-0:before_push:2")
    fed.wait_rounds(3, WAIT_S)
    fed.release("sa-east:before_push:2")  # reached or not (its first pull may bring θ_3): it goes on
    first = fed.wait_for(
        lambda: [r for r in fed.rounds() if "sa-east" in r["islands"]], WAIT_S, "a round with sa-east's push"
    )[0]
    round2 = next(r for r in fed.rounds() if r["round"] == 2)
    assert round2["islands"] == ["island-0", "island-1"] and first["round"] >= 3, (round2, first)

    fed.paused("island-1:before_push:5", WAIT_S)
    done = operator_command(fed, "retire", fed.config, "sa-east", "--reason", "region closed")
    assert "retired" in done["detail"], done
    fed.release("island-1:before_push:5")
    # once retired, its credential opens nothing: its process is refused, says why in one line and stops with the
    # code of a user error, which its supervisor does not retry
    retired = fed.wait_for(lambda: fed.others["sa-east"].poll() is not None and fed.others.pop("sa-east"), WAIT_S,
                           "sa-east to stop")  # fmt: skip
    assert retired.returncode == 2 and "not on this run's roster" in fed.last_line("sa-east"), fed.last_line("sa-east")
    fed.wait_exit(WAIT_S)

    rounds_done = fed.rounds()
    assert [r["round"] for r in rounds_done] == list(range(rounds))
    assert all("sa-east" not in r["islands"] for r in rounds_done if r["round"] >= 6), rounds_done
    # sa-east's θ was the coordinator's, bit for bit, after every commit it applied
    digest_after = {r["round"] + 1: r["digest"] for r in rounds_done}
    synced = fed.events("synced", island="sa-east")
    assert len([s for s in synced if s["round"] >= 3]) >= 2, synced
    for s in synced:
        assert s["digest"] == digest_after[s["round"]], s
    assert not fed.events("digest_mismatch", island="sa-east")
    summary = json.loads((fed.run_dir / "summary.json").read_text())
    assert summary["islands_admitted"] == 1 and summary["islands_retired"] == 1, summary
    roster = json.loads((fed.run_dir / "roster.json").read_text())
    assert roster["retired"]["sa-east"]["reason"] == "region closed" and roster["admitted"] == {}, roster


def test_an_island_that_stops_with_retire_on_stop_retires_itself(federation: Callable[..., Federation]) -> None:
    import signal

    # An island retires itself with its own credential only (without island secrets only the operator retires it).
    secrets = {"DILOCO_TEST_S0": "secret-of-island-0", "DILOCO_TEST_S1": "secret-of-island-1"}
    fed = federation(
        "train.rounds=6",
        "quorum.lease_s=60",
        'network.secrets=["env:DILOCO_TEST_S0","env:DILOCO_TEST_S1"]',
        # island-0 holds round 1 open, so island-1 trains it however late it starts on a loaded machine
        pause_at=["island-0:before_push:1", "island-1:before_push:1"],
    )
    fed.start_coordinator(env=secrets)
    fed.start_island("island-0", env=secrets)
    fed.start_island("island-1", args=["--retire-on-stop"], env=secrets)
    fed.paused("island-1:before_push:1", WAIT_S)
    fed.signal("island-1", signal.SIGTERM)  # a clean stop: it leaves at its next sync point, then retires itself
    fed.release("island-1:before_push:1")
    fed.release("island-0:before_push:1")
    retired = fed.wait_for(lambda: fed.events("island_retired"), WAIT_S, "island-1 retired")
    assert [(e["island"], e["reason"]) for e in retired] == [("island-1", "retired on stop: SIGTERM")], retired
    fed.wait_exit(WAIT_S)  # island-1 stopped cleanly (exit 0); island-0 ends the run alone
    assert '"retired": true' in fed.last_line("island-1"), fed.last_line("island-1")
    assert all(r["islands"] == ["island-0"] for r in fed.rounds() if r["round"] >= 2), fed.rounds()
    roster = json.loads((fed.run_dir / "roster.json").read_text())
    assert roster["retired"]["island-1"]["reason"] == "retired on stop: SIGTERM", roster
