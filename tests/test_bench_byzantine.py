"""`diloco bench byzantine`: the attacks are what they say, bad flags are one line, and a tiny run shows the mean
lost to one Byzantine island while a robust rule keeps training (BENCHMARKS.md has the real figures)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diloco.bench.byzantine import ATTACKS, SCALE, run_byzantine_bench
from diloco.cli import main
from diloco.config import load_config

pytestmark = pytest.mark.timeout(240)

F32_MAX = np.finfo(np.float32).max
DELTA = {"a": np.array([[0.5, -2.0], [0.0, 1e-3]], np.float32), "b": np.array([-3.0], np.float32)}


def _flat(tree: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(tree[k]) for k in sorted(tree)]).astype(np.float64)


@pytest.mark.parametrize(
    ("attack", "expected"),
    [
        ("scale", SCALE * _flat(DELTA)),
        ("signflip", -_flat(DELTA)),
        ("maxfinite", np.array([F32_MAX, -F32_MAX, F32_MAX, F32_MAX, -F32_MAX], np.float64)),
    ],
)
def test_deterministic_attacks(attack: str, expected: np.ndarray) -> None:
    got = ATTACKS[attack](DELTA, np.random.default_rng(0))
    np.testing.assert_allclose(_flat(got), expected, rtol=1e-6)
    assert all(got[k].dtype == np.float32 and got[k].shape == DELTA[k].shape for k in DELTA)


def test_random_attack_keeps_the_norm_not_the_direction() -> None:
    got = _flat(ATTACKS["random"](DELTA, np.random.default_rng(0)))
    want = _flat(DELTA)
    np.testing.assert_allclose(np.linalg.norm(got), np.linalg.norm(want), rtol=1e-6)
    assert abs(got @ want) < 0.99 * np.linalg.norm(want) ** 2


@pytest.mark.parametrize(("flag", "value"), [("--rules", "mean,krum"), ("--attacks", "scale,,nope"), ("--rules", ",")])
def test_unknown_names_are_one_line(
    capsys: pytest.CaptureFixture[str], tiny_config: Path, flag: str, value: str
) -> None:
    assert main(["bench", "byzantine", str(tiny_config), flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and "\n" not in err and flag in err, err


@pytest.mark.slow
@pytest.mark.timeout(480)  # four islands compile their inner step one after the other: minutes on 2 busy cores
def test_tiny_run_mean_breaks_and_median_holds(tiny_config: Path) -> None:
    cfg = load_config(tiny_config, ["train.rounds=2", "train.inner_steps=2", "train.checkpoint_every=0"])
    out = run_byzantine_bench(cfg, ["scale"], ["mean", "median"], islands=4, show=False)
    mean, med = out["results"]["mean"], out["results"]["median"]
    assert out["byzantine"] == "island-3" and out["islands"] == 4
    assert mean["scale"]["ratio_to_fault_free"] > 2  # θ moved by ~1000 steps' worth
    assert med["scale"]["finite"] and med["scale"]["ratio_to_fault_free"] < 1.1
    assert med["scale"]["kept_byzantine"] < med["none"]["kept_byzantine"]
    assert out["fault_free_digest_equals_mean"]["mean"] is True
