"""The fuzz targets of diloco/bench/fuzz_decoders.py: seeded random inputs here, coverage-guided ones in the bench.

A target swallows only the documented refusals (CodecError, Rejected, protobuf's DecodeError); any other exception
fails the test with the input that caused it. A short coverage-guided run (atheris, libFuzzer) per target follows.
"""

from __future__ import annotations

import random

import pytest

from diloco.bench.fuzz_decoders import TARGETS, run_fuzz_decoders
from tests.conftest import REPO


def _inputs(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    return [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 256))) for _ in range(n)]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_targets_refuse_random_bytes_only_with_their_documented_errors(target: str) -> None:
    for data in _inputs(seed=sorted(TARGETS).index(target), n=1500):
        try:
            TARGETS[target](data)
        except Exception as exc:  # noqa: BLE001 - any escape is the finding this test reports
            pytest.fail(f"{target} let {type(exc).__name__} escape on input {data!r}: {exc}")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_short_coverage_guided_run_finds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("atheris")
    monkeypatch.chdir(REPO)
    result = run_fuzz_decoders(sorted(TARGETS), runs=20_000, seconds=20)
    for name, run in result["targets"].items():
        assert run["finding"] is None, (name, run)
        assert run["executions"] > 0 and run["coverage_edges"], (name, run)
    assert result["findings"] == 0
