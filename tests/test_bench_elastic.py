"""`diloco bench elastic` end to end on real processes: two islands admitted into the live run, one retired, one
lost and retired by timeout, then the run lengthened on resume and one of its islands SIGKILLed and back; the bench
checks every island's θ against the coordinator's commits from the run's own records and raises on any
disagreement. Every act waits for a named point or a record, never for a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench.elastic import EXTRA_ROUNDS, JOINERS, run_elastic_bench
from diloco.bench.errors import BenchError
from tests.conftest import REPO

CONFIG = REPO / "configs" / "elastic.toml"


@pytest.mark.timeout(30)
def test_a_round_deadline_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A deadline would close a round the scenario holds at a named point without the island that holds it."""
    with pytest.raises(BenchError, match=r"quorum.min_deadline_s = quorum.max_deadline_s = inf.*\(got 60;"):
        run_elastic_bench(CONFIG, ["quorum.min_deadline_s=60", "quorum.max_deadline_s=60"], tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("shared_jax_cache")
def test_the_elastic_scenario_keeps_every_island_on_the_coordinators_theta(tmp_path: Path) -> None:
    overrides = ["train.inner_steps=4", "train.eval_batches=1", "model.n_layers=1", "model.d_model=32"]
    result = run_elastic_bench(CONFIG, overrides, tmp_path)
    assert result["rounds"] == 8 + EXTRA_ROUNDS
    assert result["admitted"] == list(JOINERS)
    assert result["retired"][JOINERS[0]] == "region closed"
    assert "islands.retire_after_s" in result["retired"][JOINERS[1]]
    assert all(result["synced_checked"][name] > 0 for name in ("us-east", "eu-west", *JOINERS)), result
    assert max(result["islands_per_round"]) == 4 and result["islands_per_round"][-1] == 2
    assert result["config_changed"][-1]["train.rounds"] == [8, 8 + EXTRA_ROUNDS]
    assert result["islands_per_round"][9] == 1 and result["b_back_in_rounds"]  # eu-west killed before round 9's push
    assert result["a_in_every_round"]
    assert result["config_changed"][-1]["islands.retire_after_s"][1] == 0  # B's restart is never retired as slow
    assert result["final_eval_loss_elastic"] < 5.0 and result["final_eval_loss_fixed"] < 5.0
