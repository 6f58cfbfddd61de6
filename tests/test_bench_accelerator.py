"""`diloco bench accelerator`: its arithmetic by hand (PaLM's flops per token, the peak table, tokens/s to TFLOP/s and
MFU, the roster and memory share of N islands), XLA's count of a loop, bad input as one line before anything starts,
and (`pytest -m bench`) the whole bench at smoke size on this CPU host: every island count and kind of round, its
figures checked against the runs' own push events."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from diloco.bench.accelerator import SMOKE, device_peak, island_env, rates, roster, run_accelerator_bench
from diloco.bench.flops import PEAK_TFLOPS, train_flops_per_token, xla_flops
from diloco.bench.utilization import WARMUP_ROUNDS
from diloco.cli import main
from diloco.config import load_config
from diloco.run.rundir import read_events
from tests.conftest import REPO

SMOLLM2 = REPO / "configs" / "smollm2-135m.toml"


@pytest.mark.timeout(30)
def test_model_flops_are_palms_count() -> None:
    cfg = load_config(REPO / "configs" / "llama-3.2-1b.toml").model
    # 6 N + 12 L H Q T: 16 layers, 32 heads of 64, 2048 tokens of context.
    assert train_flops_per_token(cfg, 1_235_814_400) == 6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 2048


@pytest.mark.timeout(30)
def test_the_peak_is_given_or_the_tables_or_none() -> None:
    assert device_peak("NVIDIA H200", None) == (989.0, "flops.PEAK_TFLOPS['NVIDIA H200'], dense bfloat16")
    assert device_peak("TPU v5 lite", None)[0] == 197.0
    assert device_peak("cpu", 2.5) == (2.5, "--peak-tflops")
    for unknown in ("cpu", "TPU v4 lite", "NVIDIA H100 NVL"):  # no guess: a kind not in the table has no peak
        assert unknown not in PEAK_TFLOPS and device_peak(unknown, None) == (None, None)


@pytest.mark.timeout(30)
def test_rates_of_islands_sharing_devices() -> None:
    # 1e6 flops a token; a at 2e5 tokens/s is 0.2 TFLOP/s, b at 3e5 is 0.3; two devices of 1 TFLOP/s each.
    out = rates({"a": 2e5, "b": 3e5}, 1_000_000, 1.0, devices=2)
    assert out["tokens_per_s"] == {"per_island": {"a": 2e5, "b": 3e5}, "total": 5e5}
    assert out["achieved_tflops"] == {"per_island": {"a": 0.2, "b": 0.3}, "total": 0.5}
    assert out["mfu"] == {"per_island": {"a": 0.1, "b": 0.15}, "total": 0.25}
    assert rates({"a": 2e5}, 1_000_000, None, devices=1)["mfu"] is None


@pytest.mark.timeout(30)
def test_roster_and_memory_share_of_n_islands() -> None:
    cfg = load_config(SMOLLM2)
    assert roster(cfg, 1) == ["islands.count=1", "islands.names=[us-east]", "quorum.min_islands=1"]
    assert roster(cfg, 3) == ["islands.count=3", "islands.names=[]", "quorum.min_islands=3"]  # island-0, island-1, ...
    three = load_config(SMOLLM2, roster(cfg, 3))
    assert three.islands.island_names == ("island-0", "island-1", "island-2") and three.quorum.min_islands == 3
    assert island_env("gpu", 2) == {"JAX_PLATFORMS": "gpu", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450"}


@pytest.mark.timeout(60)
def test_xla_counts_a_loops_body_once() -> None:
    """Why the bench divides XLA's count of a step by the tokens of one pass (diloco/bench/flops.py)."""

    def passes(w: jax.Array, xs: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, x: (c + x @ w, None), jnp.zeros((32, 32)), xs)[0]

    w = jnp.ones((32, 32))
    one, four = (xla_flops(jax.jit(passes).lower(w, jnp.ones((n, 32, 32))).compile()) for n in (1, 4))
    assert one >= 2 * 32**3 and four == pytest.approx(one, rel=0.05)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--islands", "0"], "--islands takes island counts >= 1 (got [0])"),
        (["--islands", "1", "-1"], "--islands takes island counts >= 1"),
        (["--rounds", "2"], "--rounds must be >= 3"),
        (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
        (["nope.key=1"], "unknown config key 'nope'"),
        (["--islands", "1", "2", "train.nope=1"], "unknown config key 'train.nope'"),  # an override after the counts
        (["--fragments", "3"], "train.inner_steps (10) must be a multiple of stream.fragments (3)"),
    ],
)
def test_bad_input_is_one_line(
    args: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "accelerator"
    assert main(["bench", "accelerator", str(SMOLLM2), "--smoke", "--run-dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diloco: error:") and "\n" not in err and fragment in err, err
    assert not run_dir.exists()  # refused before any process started


def _pushes_after_warm_up(run_dir: Path) -> list[dict]:
    return [p for p in read_events(run_dir / "metrics.jsonl", "push") if p["round"] >= WARMUP_ROUNDS]


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # 6 federations and 2 probes start JAX on a shared 2-core host
def test_accelerator_smoke(tmp_path: Path, shared_jax_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_accelerator_bench(SMOLLM2, [], tmp_path / "cpu", [1, 2], smoke=True)
    cfg = load_config(SMOLLM2, SMOKE)
    m = cfg.model
    device = out["device"]
    assert device["backend"] == device["kind"] == device["coordinator"] == "cpu" and device["mesh_per_island"] == 1
    assert out["peak_tflops"] is None and out["peak_source"] is None
    n_params = out["model"]["param_count"]
    assert out["flops_per_token"]["model"] == 6 * n_params + 12 * m.n_layers * m.n_heads * m.head_size * m.seq_len
    assert 0.5 < out["flops_per_token"]["xla"] / out["flops_per_token"]["model"] < 2  # same order: XLA counts more ops
    assert out["rounds"] == WARMUP_ROUNDS + 1 and out["H"] == 10
    cases = [(c["islands"], c["mode"], c["fragments"], c["overlap_steps"]) for c in out["cases"]]
    assert cases == [(1, "plain", 1, 0), (1, "streaming", 5, 2), (2, "plain", 1, 0), (2, "streaming", 5, 2)]
    for case in out["cases"]:
        names = list(cfg.islands.names[: case["islands"]])
        pushes = _pushes_after_warm_up(Path(case["run_dir"]))
        assert case["param_count"] == n_params  # the runs' own count (summary.json)
        assert case["mem_fraction"] == pytest.approx(0.9 / case["islands"], abs=1e-3)
        tokens = case["tokens_per_s"]["per_island"]
        assert list(tokens) == names and all(rate > 0 for rate in tokens.values())
        for name in names:
            mine = [p["tokens"] / p["compute_s"] for p in pushes if p["island"] == name]
            assert tokens[name] == pytest.approx(statistics.median(mine), abs=0.05)
            achieved = case["achieved_tflops"]["per_island"][name]
            assert achieved == pytest.approx(tokens[name] * out["flops_per_token"]["model"] / 1e12, abs=1e-6)
        assert case["tokens_per_s"]["total"] == pytest.approx(sum(tokens.values()), abs=0.1)
        assert 0 < case["utilization"] <= 1
        measured = sum(p["compute_s"] for p in pushes) / sum(p["wall_s"] for p in pushes)
        assert case["utilization"] == pytest.approx(measured, abs=1e-4)
        assert case["mfu"] is None  # a CPU has no peak in the table: no MFU, not an invented one

    # The CLI with a peak given: its JSON on stdout, MFU = achieved / (peak x the island's one device).
    capsys.readouterr()
    run_dir = tmp_path / "peak"
    args = ["bench", "accelerator", str(SMOLLM2), "--smoke", "--islands", "1", "--peak-tflops", "2", "--run-dir"]
    assert main([*args, str(run_dir)]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["peak_tflops"] == 2.0 and given["peak_source"] == "--peak-tflops"
    assert [c["islands"] for c in given["cases"]] == [1, 1]
    for case in given["cases"]:
        (achieved,) = case["achieved_tflops"]["per_island"].values()
        (mfu,) = case["mfu"]["per_island"].values()
        assert isinstance(mfu, float) and 0 < mfu == pytest.approx(achieved / 2.0, abs=1e-6)
        assert case["mfu"]["total"] == pytest.approx(mfu, abs=1e-6)
