"""`diloco bench load`, `diloco bench soak` and `diloco bench churn-soak`: small real runs that assert what the
benchmarks claim, and the pieces of their logic that decide a verdict (the kill plans, the digest rule across a
coordinator restart, the churn soak's cycles).

The real runs start a real coordinator (and, for the soak, real islands) and check the properties, never
timings: every planned round committed, bytes counted alike on both sides, every digest equal, every process
alive until it ended by itself with exit code 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diloco.bench.churn_soak import CONFIGURED, ChurnPlan, Cycle, bounded, roster, run_churn_soak_bench
from diloco.bench.errors import BenchError
from diloco.bench.load import run_load_bench
from diloco.bench.soak import TAIL_ROUNDS, DigestWatch, SoakPlan, run_soak_bench
from diloco.faults import COMMIT_POINTS, parse


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
    # every kill lands at a named point, never at a time: the coordinator's at one of its points, an island's before
    # its push, each a DILOCO_PAUSE_AT entry of its own
    assert all(k.point in COMMIT_POINTS if k.coordinator else k.point == "before_push" for k in kills)
    entries = [k.entry(("a", "b", "c", "d")) for k in kills]
    assert len(set(entries)) == 12 and len(parse(",".join(entries))) == 12
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


@pytest.mark.bench  # ~2 minutes of process starts: outside README's test command, run with `pytest -m bench`
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_churn_soak_smoke(tmp_path: Path, shared_jax_cache: Path) -> None:
    """Three cycles: joiners with and without their own source, each admitted, pushing and retired; an island and
    the coordinator SIGKILLed at their stops in each; the second restart adds ap-south, the third ends the run. The
    memory and disk bounds compare the two cycles after the warm-up one (with fewer, they would hold by
    construction)."""
    out = run_churn_soak_bench(ChurnPlan(cycles=3, warm_up=1), tmp_path / "churn")
    assert out["cycles"] == 3 and out["islands_admitted"] == 3 and out["islands_retired"] == 3, out["cycle_log"]
    assert out["coordinator_resumes"] >= 3 and [c["s"] for c in out["cycle_log"]]
    grown = {"islands.names": [list(CONFIGURED[:-1]), list(CONFIGURED)]}
    assert any(grown.items() <= change.items() for change in out["config_changes"]), out["config_changes"]
    chunks = out["chunks"]
    assert len(chunks["by_source"]) == 3 and all(s["sequences_consumed"] > 0 for s in chunks["by_source"].values())
    assert out["exactly_once"], (chunks, out["summary_sequences"])
    assert out["digests_ok"] and out["digests"]["synced_checked"] > 0, out["digests"]
    assert out["exits_explained"], out["exits"]
    assert {out["exits"][f"join-{k}"]["rc"] for k in range(3)} == {2}, out["exits"]
    assert len(out["coordinator_rss_mib"]) == 3, out["coordinator_rss_mib"]
    for bound in ("rss", "disk"):
        assert out[bound]["samples_after_warm_up"] == 2 and out[bound]["within_bound"], (bound, out[bound])
    assert out["passed"]


def test_churn_cycles_stop_where_they_act() -> None:
    """Each cycle's stops are its own (no entry fires in another cycle), name only islands of its roster, and put
    the island kill before the coordinator's; the roster changes every other restart."""
    cycles = [Cycle(k) for k in range(8)]
    entries = [e for c in cycles for e in c.stops()]
    assert len(set(entries)) == len(entries) and len(parse(",".join(entries))) == len(entries)
    for c in cycles:
        names = roster(c.index)
        assert c.victim in names and set(c.steady) == set(names) - {c.victim}
        assert len(c.stops()) == 2 * len(
            names
        )  # each island before its push of b + 1, the steady ones of b + 2 too, the coordinator
        (victim_round,) = {int(e.split(":")[2].rstrip("+")) for e in c.stops() if e.startswith(f"{c.victim}:")}
        assert victim_round < int(c.coordinator_stop.split(":")[2].rstrip("+"))
    assert [len(roster(k)) for k in range(6)] == [2, 2, 3, 3, 2, 2]
    assert {c.coordinator_stop.split(":")[1] for c in cycles} == set(COMMIT_POINTS)
    assert len({c.victim for c in cycles}) == len(CONFIGURED)  # every configured island is killed in turn
    with pytest.raises(BenchError, match="one of --cycles"):
        ChurnPlan()
    with pytest.raises(BenchError, match="--cycles must be >= 2"):
        ChurnPlan(cycles=1)
    assert bounded([300.0, 100.0, 105.0, 104.0], 1, 1.10)["within_bound"]
    assert not bounded([100.0, 100.0, 111.0], 1, 1.10)["within_bound"]
