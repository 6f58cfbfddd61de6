"""`diloco bench generate`: bad arguments are one line; a small run reports figures that agree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.cli import main
from tests.conftest import fails


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--new-tokens", "1"], "--new-tokens >= 2"),
        (["--batch", "0"], "--batch and --repeats must be >= 1"),
        (["--prompt-len", "10", "--new-tokens", "7"], "make 17 positions, beyond model.seq_len (16)"),
        (["model.kind=custom", "model.entry=tests.custom_model:build"], "a custom model has no forward"),
    ],
)
def test_a_bad_argument_is_one_line(tiny_config: Path, capsys: pytest.CaptureFixture[str], args, message) -> None:
    fails(capsys, ["bench", "generate", str(tiny_config), *args], message)


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_the_bench_times_training_and_generation(tiny_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "generate", str(tiny_config), "--batch", "4", "--prompt-len", "6", "--repeats", "2"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["batch"], out["prompt_len"], out["new_tokens"]) == (4, 6, 10)  # N defaults to what the context leaves
    assert all(len(out["seconds"][k]) == 2 for k in ("train", "generate", "first"))
    assert out["generate_over_train"] == pytest.approx(out["generate_tokens_per_s"] / out["train_tokens_per_s"], 1e-3)
    assert out["generate_tokens_per_s"] > 0 and out["time_to_first_token_s"] > 0
    assert out["cost_model"]["decode_flops_per_token"] == 2 * out["param_count"] + 4 * 1 * 15 * 32


@pytest.mark.parametrize(
    "model",
    [
        ["model.kind=transformer"],  # GPT-2: every head cached, d_model wide
        # A grouped-query Llama-family model: 1 key/value head for 4 query heads, head_dim 16 (not d_model / n_heads),
        # so its cache is 16 wide where d_model is 32; cached in bfloat16.
        ["model.kind=llama", "model.n_kv_heads=1", "model.head_dim=16", "model.compute_dtype=bfloat16"],
    ],
)
def test_the_cost_models_cache_is_the_real_caches_size(model: list[str]) -> None:
    from diloco.bench.generate import cost_model
    from diloco.config import load_config
    from islands.models.transformer import init_cache

    cfg = load_config(None, ["data.kind=synthetic", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", *model])
    batch, prompt_len, new_tokens = 3, 6, 5
    cache = init_cache(cfg.model, batch, prompt_len + new_tokens - 1)
    predicted = cost_model(cfg, 1000, batch, prompt_len, new_tokens)["decode_step_cache_bytes"]
    assert predicted == cache.k.nbytes + cache.v.nbytes
