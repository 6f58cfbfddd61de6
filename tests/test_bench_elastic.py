"""`diloco bench elastic` end to end on real processes: two islands admitted into the live run, one SIGKILLed and
back, one retired, one lost and retired by timeout, then the run lengthened on resume; the bench checks every
island's θ against the coordinator's commits from the run's own records and raises on any disagreement."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.bench.elastic import EXTRA_ROUNDS, JOINERS, run_elastic_bench
from tests.conftest import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.bench, pytest.mark.timeout(900)]


@pytest.mark.usefixtures("shared_jax_cache")
def test_the_elastic_scenario_keeps_every_island_on_the_coordinators_theta(tmp_path: Path) -> None:
    # islands.retire_after_s: eu-west, SIGKILLed, must be back before it would be retired for its absence, and a
    # new JAX process takes more than the config's 30 s to start on a busy machine; af-south, lost for good, is
    # retired all the same, later. While it is, us-east holds its push of round 6: the round's deadline must be
    # longer than that wait, or it closes without us-east.
    overrides = ["train.inner_steps=4", "train.eval_batches=1", "model.n_layers=1", "model.d_model=32"]
    overrides += ["islands.retire_after_s=90", "quorum.min_deadline_s=180", "quorum.max_deadline_s=300"]
    result = run_elastic_bench(REPO / "configs" / "elastic.toml", overrides, tmp_path)
    assert result["rounds"] == 8 + EXTRA_ROUNDS
    assert result["admitted"] == list(JOINERS)
    assert result["retired"][JOINERS[0]] == "region closed"
    assert "islands.retire_after_s" in result["retired"][JOINERS[1]]
    assert all(result["synced_checked"][name] > 0 for name in ("us-east", "eu-west", *JOINERS)), result
    assert max(result["islands_per_round"]) == 4 and result["islands_per_round"][-1] == 2
    assert result["config_changed"][-1]["train.rounds"] == [8, 8 + EXTRA_ROUNDS]
    assert result["b_back_in_rounds"] and result["a_in_every_round"]
    assert result["final_eval_loss_elastic"] < 5.0 and result["final_eval_loss_fixed"] < 5.0
