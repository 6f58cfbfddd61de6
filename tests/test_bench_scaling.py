"""`diloco bench scaling`: sizes, per-size grids and LM / Ls against parameters (diloco/bench/scaling.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.bench.errors import BenchError
from diloco.bench.scaling import grids_for, run_scaling_bench
from diloco.bench.variants import Variant, parse_variant
from diloco.config import load_config


def test_a_variant_is_a_name_and_its_overrides() -> None:
    spec = "S:model.d_model=32,model.n_layers=2"
    assert parse_variant(spec, "--size") == Variant("S", ("model.d_model=32", "model.n_layers=2"))


@pytest.mark.parametrize("spec", ["model.d_model=32", "S:", "S:model.d_model", "two words:model.d_model=8"])
def test_malformed_variants_are_refused_naming_the_flag(spec: str) -> None:
    with pytest.raises(BenchError, match="--size .* must look like NAME:section.key=v"):
        parse_variant(spec, "--size")


def test_grids_apply_to_every_size_or_to_the_named_one() -> None:
    specs = ["all:outer.lr=0.7", "S@LM:inner.lr=1e-2,2e-2", "L@all:inner.lr=3e-3"]
    assert grids_for("S", specs, ["S", "L"]) == ["all:outer.lr=0.7", "LM:inner.lr=1e-2,2e-2"]
    assert grids_for("L", specs, ["S", "L"]) == ["all:outer.lr=0.7", "all:inner.lr=3e-3"]
    with pytest.raises(BenchError, match="names size 'M', not one of the --size names"):
        grids_for("S", ["M@LM:inner.lr=1e-2"], ["S", "L"])


def test_sizes_must_be_two_with_distinct_names(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config)
    with pytest.raises(BenchError, match="at least two --size"):
        run_scaling_bench(cfg, tmp_path / "runs", ["S:model.d_model=16"])
    with pytest.raises(BenchError, match="--size: the names must be distinct"):
        run_scaling_bench(cfg, tmp_path / "runs", ["S:model.d_model=16", "S:model.d_model=32"])
    assert not (tmp_path / "runs").exists()


def test_parameter_count_follows_the_size(tiny_config: Path) -> None:
    from islands.models.registry import parameter_count

    small = load_config(tiny_config, ["model.d_model=16", "model.d_ff=32"])
    large = load_config(tiny_config, ["model.d_model=32", "model.d_ff=64"])
    assert 2 * parameter_count(small.model) < parameter_count(large.model)


@pytest.mark.bench  # the bench's end-to-end smoke run: pytest -m bench, like the other benches' smoke runs
def test_each_size_compares_lm_with_ls_at_its_best(tiny_config: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny_config, ["train.rounds=2", "train.inner_steps=2", "train.checkpoint_every=0"])
    sizes = ["S:model.d_model=16,model.d_ff=32", "L:model.d_model=32,model.d_ff=64"]
    result = run_scaling_bench(
        cfg, tmp_path / "runs", sizes, islands=2, grids=["S@LM:inner.lr=1e-4,3e-3"], plot=tmp_path / "gap.png"
    )
    small, large = result["sizes"]
    assert [small["size"], large["size"]] == ["S", "L"] and small["parameters"] < large["parameters"]
    assert result["parameter_span"] == round(large["parameters"] / small["parameters"], 2)
    assert [r["overrides"] for r in small["grid"]["L2"]] == [["inner.lr=1e-4"], ["inner.lr=3e-3"]]
    assert [r["overrides"] for r in large["grid"]["L2"]] == [[]]  # the grid named S only
    assert "L1" not in small["grid"]  # one island alone is not run
    for row in (small, large):
        assert row["ratio_LM_over_Ls"] == round(row["LM"] / row["Ls"], 4)
        run = Path(row["grid"]["Ls"][0]["run_dir"])
        assert run.parent.name == row["size"] and json.loads((run / "summary.json").read_text())["rounds"] == 2
    assert (tmp_path / "gap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
