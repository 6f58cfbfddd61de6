"""`diloco bench big` at smoke size: a real federation (coordinator and 2 island processes over gRPC) of the SmolLM2
config's family, shrunk (`--smoke`), one round. What it checks is the benchmark's claim, never a timing: each
process's peak is a real measurement (the `memory_peak` its own run directory holds, a JAX process's hundreds of
MiB), each ratio is that peak over that process's plan, and the bytes per round are the run's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench.big import MIB, RATIO_BOUND, run_big_bench
from diloco.run.rundir import read_events
from tests.conftest import REPO


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # three processes start JAX on a shared 2-core host
def test_big_smoke(tmp_path: Path, shared_jax_cache: Path) -> None:
    run_dir = tmp_path / "big"
    out = run_big_bench(REPO / "configs" / "smollm2-135m.toml", [], run_dir, rounds=1, smoke=True)
    names = ["us-east", "eu-west"]
    assert out["codec"] == {"uplink": "int8", "downlink": "int8"} and out["rounds"] == 1
    assert set(out["processes"]) == {*names, "coordinator"}
    logged = {name: read_events(run_dir / "islands" / name / "metrics.jsonl", "memory_peak") for name in names}
    logged["coordinator"] = read_events(run_dir / "metrics.jsonl", "memory_peak")
    for name, process in out["processes"].items():
        (event,) = logged[name]
        assert process["peak_rss_mib"] == round(event["rss_peak_bytes"] / MIB, 1)
        assert process["peak_rss_mib"] > 100  # a process that imported JAX and gRPC: measured, not planned
        assert process["plan_mib"] == pytest.approx(process["plan_held_mib"] + process["plan_peak_phase_mib"], abs=0.2)
        assert process["ratio"] == pytest.approx(process["peak_rss_mib"] / process["plan_mib"], rel=1e-2)
        assert process["within_1_5x"] == (1 / RATIO_BOUND <= process["ratio"] <= RATIO_BOUND)
    assert out["processes"]["coordinator"]["plan_peak_phase"] == "a sync"
    assert out["all_within_1_5x"] == all(p["within_1_5x"] for p in out["processes"].values())
    assert set(out["tokens_per_s"]) == set(names) and all(rate > 0 for rate in out["tokens_per_s"].values())
    # one round: both islands' int8 pushes up; their pulls down (θ_0 whole at the join, then the update)
    (up,), (down,) = out["bytes_up_per_round"], out["bytes_down_per_round"]
    pushes = read_events(run_dir / "metrics.jsonl", "push")
    assert len(pushes) == 2 and up == sum(p["bytes_up"] for p in pushes) > 0
    assert down > up
