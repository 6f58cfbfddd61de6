"""`diloco bench fuzz`, small: a hundred hostile messages against a real coordinator process with island secrets
(wrong and missing secrets, invented names, and insiders whose pushes pass every wire check). Every one is answered
with a status that is neither UNKNOWN nor INTERNAL, none starves the server, the coordinator lives, and real islands
complete a round afterwards (diloco/bench/fuzz.py). The run without secrets ("open") is the full bench's other half:
`diloco bench fuzz`; the suite leaves it out for time (tests/test_fuzz_server.py fuzzes an open live server)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_fuzzed_coordinator_answers_everything_and_goes_on(tmp_path: Path, shared_jax_cache: Path) -> None:
    from diloco.bench.fuzz import run_fuzz_bench

    r = run_fuzz_bench(messages=100, seed=0, run_dir=tmp_path / "fuzz", modes=("auth",))
    assert r["messages_sent"] == 100 and set(r["runs"]) == {"auth"}
    assert r["unknown_or_internal"] == 0, [run["unknown_or_internal_shots"] for run in r["runs"].values()]
    assert r["coordinator_alive"], {mode: run["coordinator_alive"] for mode, run in r["runs"].items()}
    assert r["legit_round_completed"], {mode: run["legit_round"] for mode, run in r["runs"].items()}
    for mode, run in r["runs"].items():
        assert run["client_deadline_exceeded"] == 0, mode
        probes = run["idle_flood"]["probes_meanwhile"]
        assert probes["status"]["code"] == probes["heartbeat"]["code"] == "OK", (mode, probes)
        assert "OK" not in run["idle_flood"]["codes"] and "CANCELLED" in run["idle_flood"]["codes"], mode
        assert set(run["codes"]) - {"OK"}, f"{mode}: every hostile message was accepted?"
