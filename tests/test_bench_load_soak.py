"""`diloco bench load` and `diloco bench soak`: small real runs that assert what the benchmarks claim, and the two
pieces of their logic that decide a verdict (the kill plan, the digest rule across a coordinator restart).

The real runs start a real coordinator (and, for the soak, real islands) and check the properties, never
timings: every planned round committed, bytes counted alike on both sides, every digest equal, every process
alive until it ended by itself with exit code 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diloco.bench.errors import BenchError
from diloco.bench.load import run_load_bench
from diloco.bench.soak import TAIL_ROUNDS, DigestWatch, SoakPlan, run_soak_bench


@pytest.mark.slow
@pytest.mark.multiprocess
def test_load_smoke(tmp_path: Path, shared_jax_cache: Path) -> None:
    islands, rounds = 8, 2
    out = run_load_bench(islands, rounds, tmp_path / "load")
    assert out["rounds_committed"] == rounds and len(out["round_seconds"]) == rounds
    assert len(out["push_to_commit_s"]) == rounds and all(x >= 0 for x in out["push_to_commit_s"])
    assert out["digest_mismatched_rounds"] == [] and out["islands_lost"] == 0 and out["rejected"] == 0
    assert out["coordinator_exit_code"] == 0
    coord = out["coordinator"]
    assert len(coord["rss_mib_per_round"]) == rounds and all(m > 0 for m in coord["rss_mib_per_round"])
    assert coord["rss_mib_peak"] >= max(coord["rss_mib_per_round"]) and coord["cpu_s_total"] > 0
    # fp32 both ways: a push, an update and the full θ each carry every parameter as 4 bytes.
    assert out["push_bytes"] == 4 * out["param_count"]
    moved = out["bytes"]
    assert moved["up_clients"] == moved["up_coordinator"] == islands * rounds * out["push_bytes"]
    assert moved["down_clients"] == moved["down_coordinator"] == islands * (rounds + 1) * out["push_bytes"]


@pytest.mark.slow
def test_load_grows_the_roster_while_rounds_go_on(tmp_path: Path, shared_jax_cache: Path) -> None:
    out = run_load_bench(2, 6, tmp_path / "load", admit=4)
    assert out["rounds_committed"] == 6 and out["islands_admitted"] == 4 and out["digest_mismatched_rounds"] == []
    assert out["islands_per_round"][0] == 2 and out["islands_per_round"][-1] == 6, out["islands_per_round"]
    assert len(out["coordinator"]["rss_mib_per_round"]) == 6 and out["admit_s_stats"]["max"] > 0
    # at most one push of each joiner comes too late for the round it joined during (refused as stale; it pulls on)
    assert out["rejected"] <= 4 and out["coordinator_exit_code"] == 0


@pytest.mark.bench  # ~2 minutes of process starts: outside README's test command, run with `pytest -m bench`
@pytest.mark.slow
@pytest.mark.multiprocess
def test_soak_smoke(tmp_path: Path) -> None:
    plan = SoakPlan(rounds=8, island_kills=2, coordinator_kills=1, seed=0, islands=3)
    out = run_soak_bench(plan, tmp_path / "soak", fault_free=False)
    run = out["faulted"]
    assert run["island_kills"] == 2 and run["coordinator_kills"] == 1, run["kills"]
    assert run["rounds_committed"] == 8 and run["commit_sequence_ok"]
    assert out["digest_mismatches"] == 0 and run["island_digest_mismatch_events"] == 0, run["mismatch_examples"]
    assert run["synced_checked"] >= 8  # the check is not vacuous: the islands synced rounds and were compared
    assert run["islands_at_final_round"] == ["island-0", "island-1", "island-2"]
    assert run["summary_digest_is_last_commit"]
    assert set(run["exit_codes"].values()) == {0}, run["exit_codes"]


def test_kill_plan_is_seeded_and_spread() -> None:
    plan = SoakPlan()
    kills = plan.schedule()
    assert kills == SoakPlan().schedule() and kills != SoakPlan(seed=1).schedule()
    assert len(kills) == 12 and sum(k.coordinator for k in kills) == 2
    rounds = [k.at_round for k in kills]
    assert rounds == sorted(rounds) and len(set(rounds)) == 12
    assert 1 <= rounds[0] and rounds[-1] <= plan.rounds - TAIL_ROUNDS - 1
    with pytest.raises(BenchError, match="no room"):
        SoakPlan(rounds=8, island_kills=5, coordinator_kills=1)


class _Files:
    """Stands in for a Federation: the coordinator's `round` events and the islands' `synced` ones, as lists."""

    def __init__(self) -> None:
        self.commits: list[dict[str, Any]] = []
        self.resumed: list[dict[str, Any]] = []
        self.synced: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}

    def rounds(self) -> list[dict[str, Any]]:
        return self.commits

    def events(self, event: str | None = None, island: str | None = None) -> list[dict[str, Any]]:
        if island is None:
            return self.resumed if event == "resumed" else []
        return self.synced[island] if event == "synced" else []


def synced(round_: int, digest: str, kind: str = "update") -> dict[str, Any]:
    return {"round": round_, "digest": digest, "kind": kind}


def test_digests_compare_with_the_last_commit_of_a_round() -> None:
    """A coordinator killed after logging round 1 but before saving it reruns round 1 with another digest: legal,
    since no island saw the lost commit. An island holding the lost θ is a mismatch, unless the coordinator resumed
    before that round and the island took a full θ in its place afterwards (it rolled back)."""
    files = _Files()
    watch = DigestWatch(("a", "b"))
    files.commits = [{"round": 0, "digest": "d0"}, {"round": 1, "digest": "lost"}]
    files.synced["a"] = [synced(0, "init", "full"), synced(1, "d0")]
    files.synced["b"] = [synced(0, "init", "full"), synced(1, "d0")]
    assert watch.observe(files) == 1
    files.commits = [{"round": 0, "digest": "d0"}]  # the restarted coordinator truncated round 1 ...
    files.resumed = [{"round": 1}]
    watch.observe(files)
    files.commits = [{"round": 0, "digest": "d0"}, {"round": 1, "digest": "d1"}, {"round": 2, "digest": "d2"}]
    for name in ("a", "b"):  # ... and committed it again
        files.synced[name] += [synced(2, "d1"), synced(3, "d2")]
    result = watch.final(files, rounds=3)
    assert result["commit_sequence_ok"] and result["rounds_recommitted"] == [1]
    assert result["digest_mismatches"] == 0 and result["live_digest_mismatches"] == 0
    assert result["synced_checked"] == 6 and result["islands_at_final_round"] == ["a", "b"]
    assert result["rolled_back_syncs"] == 0

    kept = list(files.synced["b"])
    files.synced["b"] = [*kept, synced(2, "lost")]  # an island that kept the lost commit
    assert watch.final(files, rounds=3)["digest_mismatches"] == 1
    # the same θ, then the coordinator's full θ in its place: a roll-back, counted and legal
    files.synced["b"] = [*kept[:3], synced(2, "lost"), synced(2, "d1", "full"), synced(3, "d2")]
    rolled = watch.final(files, rounds=3)
    assert rolled["digest_mismatches"] == 0 and rolled["rolled_back_syncs"] == 1, rolled
    files.resumed = [{"round": 2}]  # a coordinator that resumed at round 2 cannot have served a lost θ_2
    assert watch.final(files, rounds=3)["digest_mismatches"] == 1
