"""A run from a Hugging Face checkpoint and `diloco export --format hf` of it, end to end; and, where a Python with
torch and transformers is at hand (`reference` marker), exports loaded by transformers itself
(tests/fixtures/hf/make_fixtures.py check) giving the fixtures' logits and greedy continuations."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from diloco.cli import main
from diloco.config import IslandsConfig, load_config
from diloco.ops.export import special_token_ids, tokenizer_files, write_hf
from diloco.ops.trained import Trained, load_trained
from diloco.run.warm_start import checkpoint_params
from islands.data import DataConfig
from islands.models.config import ModelConfig
from islands.models.hf.checkpoint import RUN_FILES, copy_files, parse_size
from islands.models.hf.families import open_import
from islands.models.registry import ARCHITECTURES, build_model
from islands.models.transformer import forward
from islands.workloads.config import WorkloadConfig
from pytrees.digest import tree_digest
from pytrees.naming import flatten_named
from tests.conftest import TINY_TOML, fails, write_corpus
from tests.test_hf_import import FAMILIES, FIXTURES, run_config, tensors_of

MAKE_FIXTURES = FIXTURES / "make_fixtures.py"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """A one-round `diloco simulate` from the llama fixture, and its `export --format hf` (the CLI's JSON)."""
    tmp = tmp_path_factory.mktemp("hf-run")
    run_dir, out = tmp / "run", tmp / "export"
    assert main(["simulate", str(run_config(tmp, FIXTURES / "llama")), "--run-dir", str(run_dir), "--no-progress"]) == 0
    assert main(["export", str(run_dir), "--out", str(out), "--format", "hf", "--max-shard-size", "60KB"]) == 0
    return run_dir, out, json.loads((out / "config.json").read_text())


@pytest.mark.slow
def test_a_run_from_a_checkpoint_keeps_its_files_and_starts_from_its_weights(exported) -> None:
    run_dir, _, _ = exported
    kept = sorted(p.name for p in (run_dir / RUN_FILES).iterdir())
    assert kept == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (start,) = [e for e in events if e.get("event") == "warm_start"]
    cfg = load_config(run_dir / "config.toml")
    assert cfg.model.kind == "llama" and cfg.model.rope_scaling == "llama3" and cfg.model.vocab_size == 320
    like = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    assert start["digest"] == tree_digest(checkpoint_params(cfg, FIXTURES / "llama", like))
    assert start["source"] == str(FIXTURES / "llama") and start["format"] == "hf"


@pytest.mark.slow
def test_export_writes_the_runs_theta_in_hugging_faces_layout(exported) -> None:
    run_dir, out, config = exported
    assert config == json.loads((FIXTURES / "llama" / "config.json").read_text())
    assert (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
    assert sorted(tensors_of(out)) == sorted(tensors_of(FIXTURES / "llama"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (FIXTURES / "llama" / name).read_bytes()
    trained = load_trained(run_dir)
    cfg = load_config(run_dir / "config.toml")
    shapes = {n: a.shape for n, a in flatten_named(trained.params).items()}
    back = open_import(out, cfg.model, shapes, "test").read()  # the export imports to the run's θ, bit for bit
    assert all(np.array_equal(back[n], a) for n, a in flatten_named(trained.params).items())


@pytest.mark.slow
def test_export_refuses_what_it_cannot_write(exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _, _ = exported
    out = tmp_path / "x"
    fails(capsys, ["export", str(run_dir), "--out", str(out), "--format", "hf", "--dtype", "int8"], "--dtype must be")
    fails(
        capsys,
        ["export", str(run_dir), "--out", str(out), "--format", "hf", "--max-shard-size", "5XB"],
        "--max-shard-size",
    )
    assert not out.exists()


def test_a_run_trained_here_exports_the_special_tokens_and_chat_template_it_read(tmp_path: Path) -> None:
    """A run trained from scratch on a corpus prepared with a checkpoint's tokenizer (its tokenizer_config.json
    beside it, as `diloco data prepare --tokenizer` keeps it) reads conversations through that chat template and
    stops at its EOS: the export carries both, and config.json names the ids that transformers' generate uses."""
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURES / "llama" / name, prepared / name)
    data = DataConfig(kind="jsonl", path=str(tmp_path / "docs.jsonl"), tokenizer=str(prepared / "tokenizer.json"))
    trained = Trained(tmp_path, tmp_path, 1, ModelConfig(), data, IslandsConfig(), WorkloadConfig(), {})
    out = tmp_path / "export"
    out.mkdir()
    assert tokenizer_files(trained, out) == ["tokenizer.json", "tokenizer_config.json"]
    theirs = json.loads((FIXTURES / "llama" / "tokenizer_config.json").read_text())
    assert json.loads((out / "tokenizer_config.json").read_text()) == theirs  # chat_template and special tokens
    assert special_token_ids(data, 320) == {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}
    (prepared / "chat_template.jinja").write_text(theirs["chat_template"])  # as transformers 4.50 on writes it
    assert tokenizer_files(trained, out) == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    assert (out / "chat_template.jinja").read_text() == theirs["chat_template"]
    (prepared / "chat_template.jinja").unlink()
    (prepared / "tokenizer_config.json").unlink()  # a tokenizer without one: no special tokens, the class named
    assert tokenizer_files(trained, out) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"tokenizer_class": "PreTrainedTokenizerFast"}
    assert not (out / "chat_template.jinja").exists()  # an export --force replaces, it does not keep another's
    assert special_token_ids(data, 320) == {}


# -- transformers itself (opt in) ----------------------------------------------------------------------------------


def reference_python() -> str | None:
    """A Python that imports transformers and torch: $DILOCO_REFERENCE_PYTHON, else this one if it can."""
    if os.environ.get("DILOCO_REFERENCE_PYTHON"):
        return os.environ["DILOCO_REFERENCE_PYTHON"]
    has = all(importlib.util.find_spec(m) is not None for m in ("transformers", "torch"))
    return sys.executable if has else None


def transformers_check(export: Path, fixture: Path) -> dict:
    python = reference_python()
    assert python is not None
    out = subprocess.run(
        [python, str(MAKE_FIXTURES), "check", str(export), str(fixture)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_transformers = pytest.mark.skipif(reference_python() is None, reason="no Python with transformers and torch")


@pytest.mark.reference
@needs_transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_an_export_and_gives_the_fixtures_logits(tmp_path: Path, family: str) -> None:
    cfg = load_config(run_config(tmp_path, FIXTURES / family))
    like = jax.eval_shape(build_model(cfg.model).init, jax.random.key(0))
    shapes = {n: tuple(a.shape) for n, a in flatten_named(like, to_numpy=False).items()}
    params = open_import(FIXTURES / family, cfg.model, shapes, "init.from").read()
    out = tmp_path / "export"
    out.mkdir()
    # float32 whatever the fixture's dtype: the logits are then of the very weights the fixture's were
    write_hf(out, cfg.model, params, FIXTURES / family / "config.json", "float32", parse_size("60KB"))
    copy_files(FIXTURES / family, out)
    result = transformers_check(out, FIXTURES / family)
    print(json.dumps(result))
    assert result["max_abs_logit_diff"] < 1e-5 and result["greedy_equal"], result
    assert "<|im_start|>user\nhi<|im_end|>" in result["chat"]


@pytest.mark.reference
@needs_transformers
def test_transformers_loads_the_cli_export_of_a_run(exported) -> None:
    _, out, _ = exported
    result = transformers_check(out, FIXTURES / "llama")
    assert result["architecture"] == "LlamaForCausalLM" and result["tokens_of_hi"]


@pytest.fixture(scope="module")
def byte_level_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A one-round byte-level GPT-2-shape run trained here (no checkpoint to start from), exported as hf."""
    tmp = tmp_path_factory.mktemp("bytes-run")
    config = tmp / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp / "corpus.txt")))
    run_dir, out = tmp / "run", tmp / "export"
    assert main(["simulate", str(config), "--run-dir", str(run_dir), "--no-progress", "train.rounds=1"]) == 0
    assert main(["export", str(run_dir), "--out", str(out), "--format", "hf"]) == 0
    return run_dir, out


@pytest.mark.slow
def test_a_run_trained_here_exports_as_gpt2_with_a_byte_tokenizer(byte_level_export) -> None:
    from tokenizers import Tokenizer

    run_dir, out = byte_level_export
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_positions"] == 16
    text = "the island\tré"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.encode(text).ids == list(text.encode()) and tokenizer.decode(list(text.encode())) == text
    theirs = tensors_of(out)
    assert not theirs["transformer.h.0.attn.c_attn.bias"].any()  # the run has no attention biases: zeros
    trained = flatten_named(load_trained(run_dir).params)
    assert np.array_equal(theirs["transformer.h.0.attn.c_attn.weight"], trained["blocks/0/attn/wqkv"])


@pytest.mark.reference
@needs_transformers
def test_transformers_gives_a_byte_level_exports_logits(byte_level_export, tmp_path: Path) -> None:
    """transformers' logits of the export of a run trained here against the project's forward of the run's θ."""
    run_dir, out = byte_level_export
    trained = load_trained(run_dir)
    ids = np.array([list(b"the island "), list(b"outer delta")], np.int32)
    logits, _ = forward(trained.params, ids, trained.model, ARCHITECTURES[trained.model.kind])
    expected = tmp_path / "expected"
    expected.mkdir()
    np.save(expected / "logits.npy", np.asarray(logits))
    greedy = [[int(np.asarray(logits)[r, -1].argmax())] for r in range(len(ids))]
    (expected / "reference.json").write_text(
        json.dumps({"family": "trained", "input_ids": ids.tolist(), "greedy": greedy})
    )
    result = transformers_check(out, expected)
    print(json.dumps(result))
    assert result["architecture"] == "GPT2LMHeadModel" and result["max_abs_logit_diff"] < 1e-5, result
    assert result["tokens_of_hi"] == list(b"hi")
