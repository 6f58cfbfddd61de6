"""`diloco bench utilization`'s arithmetic: the plain round's cost model and the measured utilization, by hand."""

from __future__ import annotations

import pytest

from diloco.bench.errors import BenchError
from diloco.bench.utilization import measured_utilization, plain_round_model

pytestmark = pytest.mark.timeout(30)


def test_the_slowest_island_sets_everyones_period() -> None:
    # a: 1 s of steps, up 0.2, down 0.3 -> 1.5 s to its push; b: 0.5 s of steps, up 0.1, down 0.1 -> 0.7 s.
    model = plain_round_model({"a": 1.0, "b": 0.5}, {"a": 0.2, "b": 0.1}, {"a": 0.3, "b": 0.1}, close_s=0.5)
    assert model["period_s"] == pytest.approx(1.5 + 0.5)
    assert model["utilization"] == pytest.approx(((1.0 + 0.5) / 2) / 2.0)  # mean compute 0.75 s of a 2 s period
    assert model["wire_share"] == pytest.approx(0.5 / 2.0)


def test_no_link_and_no_close_is_full_utilization() -> None:
    model = plain_round_model({"a": 0.4}, {"a": 0.0}, {"a": 0.0}, close_s=0.0)
    assert model == {"period_s": pytest.approx(0.4), "utilization": pytest.approx(1.0), "wire_share": 0.0}


def test_measured_utilization_leaves_out_round_0() -> None:
    pushes = [
        {"island": "a", "round": 0, "compute_s": 1.0, "wall_s": 30.0},  # start-up: left out
        {"island": "b", "round": 0, "compute_s": 1.0, "wall_s": 25.0},  # start-up: left out
        {"island": "a", "round": 1, "compute_s": 1.0, "wall_s": 2.0},
        {"island": "b", "round": 1, "compute_s": 2.0, "wall_s": 2.0},
    ]
    assert measured_utilization(pushes) == pytest.approx(3.0 / 4.0)
    with pytest.raises(BenchError, match="raise --rounds"):
        measured_utilization(pushes[:2])
