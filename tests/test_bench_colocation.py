"""`diloco bench colocation`'s fair share, by hand: an island's lone step on its share of the cores, stretched by
how many islands each core serves, from the mean of the lone steps measured before and after the variants."""

from __future__ import annotations

import pytest

from diloco.bench.colocation import fair_share_step_s

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("lone_share_s", "islands", "per_island", "cores", "expected"),
    [
        ((0.4, 0.4), 3, 1, 2, 0.6),  # 3 islands on 2 cores: 2/3 of a core each, 0.4 s stretched by 3/2
        ((0.4, 0.5), 3, 1, 2, 0.675),  # the host slowed during the run: the mean, 0.45 s, is the base
        ((0.3, 0.3), 2, 1, 2, 0.3),  # a core each: no stretch
        ((0.3, 0.3), 2, 2, 4, 0.3),  # two cores each on four
        ((0.5, 0.5), 4, 1, 2, 1.0),  # 4 islands on 2 cores: half a core each
        ((0.2, 0.2), 3, 2, 8, 0.2),  # more cores than the islands' shares need: never faster than alone
    ],
)
def test_fair_share(
    lone_share_s: tuple[float, float], islands: int, per_island: int, cores: int, expected: float
) -> None:
    assert fair_share_step_s(lone_share_s, islands, per_island, cores) == pytest.approx(expected)
