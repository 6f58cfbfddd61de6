"""`diloco sample` and `diloco export` on real run directories: θ as the run committed it, continuations as the
sampler makes them, safetensors that the real package loads bit for bit, docs/export.md's NumPy forward, and one
line for every bad argument."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco.cli import main
from diloco.config import load_config, to_dict
from diloco.ops.trained import load_trained
from diloco.run.setup import build_setup
from diloco.run.warm_start import find_source, read_item
from diloco.simulator.simulate import run_simulation
from islands.models import transformer
from islands.sampling import generate
from pytrees.naming import flatten_named
from tests.conftest import REPO, TINY_TOML, fails, write_corpus

RUN = ["model.seq_len=32", "train.rounds=2"]
"""The tiny config with room for a continuation."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A finished tiny `simulate` run directory and its summary."""
    tmp = tmp_path_factory.mktemp("trained")
    config = tmp / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp / "corpus.txt")))
    summary = run_simulation(load_config(config, RUN), tmp / "run", show_progress=False)
    return tmp / "run", summary


def cli_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict:
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def committed_theta(run_dir: Path) -> dict:
    """θ of the run's newest coordinator checkpoint, read as init.from reads it (into a freshly built θ_0)."""
    cfg = load_config(run_dir / "config.toml")
    return read_item(find_source(run_dir).step_dir, "params", build_setup(cfg).init_params, "parameters")


@pytest.mark.slow
def test_sample_continues_with_the_newest_committed_theta(run, capsys):
    run_dir, summary = run
    out = cli_json(capsys, ["sample", str(run_dir), "--prompt", "the island ", "--prompt", "x", "--temperature", "0",
                            "--max-new-tokens", "12", "--json"])  # fmt: skip
    assert out["digest"] == summary["params_digest"] and out["round"] == summary["rounds"] == 2
    assert out["max_new_tokens"] == 12 and out["text"] == "bytes"
    cfg = load_config(run_dir / "config.toml")
    theta = committed_theta(run_dir)
    for sample in out["samples"]:
        ids = list(sample["prompt"].encode())
        tokens, lengths = generate(
            theta, cfg.model, jnp.asarray([ids]), jnp.asarray([len(ids)]), key=jax.random.key(0), max_new_tokens=12,
            temperature=0.0,
        )  # fmt: skip
        assert sample["tokens"] == np.asarray(tokens[0]).tolist() and int(lengths[0]) == 12
        assert sample["continuation"] == bytes(sample["tokens"]).decode("utf-8", errors="replace")
    assert (
        main(["sample", str(run_dir), "--prompt", "the island ", "--temperature", "0", "--max-new-tokens", "12"]) == 0
    )
    assert capsys.readouterr().out == out["samples"][0]["continuation"] + "\n"


@pytest.mark.slow
def test_sample_follows_its_seed_and_reads_a_relative_run_dir(run, capsys, monkeypatch):
    run_dir, _ = run
    monkeypatch.chdir(run_dir.parent)  # orbax wants absolute paths: a relative RUN_DIR (or init.from) is made one

    def draw(seed: int) -> list[int]:
        args = ["sample", run_dir.name, "--prompt", "inner", "--seed", str(seed), "--top-p", "0.9", "--json"]
        return cli_json(capsys, args)["samples"][0]["tokens"]

    assert draw(1) == draw(1) != draw(2)
    assert len(draw(1)) == 32 - len("inner")  # the default fills what the context leaves


@pytest.mark.slow
def test_sample_bad_input_is_one_line(run, tmp_path, capsys):
    run_dir, _ = run
    ok = ["sample", str(run_dir), "--prompt", "abc"]
    fails(capsys, [*ok, "--temperature", "-1"], "--temperature must be a finite number >= 0 (got -1.0")
    fails(capsys, [*ok, "--top-p", "0"], "--top-p must be in (0, 1] (got 0.0")
    fails(capsys, [*ok, "--top-p", "1.5"], "--top-p must be in (0, 1] (got 1.5")
    fails(capsys, [*ok, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1")
    fails(capsys, ["sample", str(run_dir), "--prompt", ""], "--prompt 1 is empty")
    fails(
        capsys,
        [*ok, "--prompt", "y" * 32],
        "--prompt 2 is 32 tokens: with 1 new token(s) that is beyond model.seq_len (32)",
    )
    fails(capsys, [*ok, "--max-new-tokens", "30"], "ask for at most 29 new tokens")
    fails(
        capsys,
        ["sample", str(tmp_path / "nowhere"), "--prompt", "a"],
        f"RUN_DIR: '{tmp_path / 'nowhere'}' does not exist",
    )
    empty = tmp_path / "empty"
    (empty / "checkpoints" / "coordinator").mkdir(parents=True)
    shutil.copy(run_dir / "config.toml", empty / "config.toml")
    fails(capsys, ["sample", str(empty), "--prompt", "a"], f"RUN_DIR: '{empty}' holds no checkpoint")
    fails(capsys, ["export", str(empty), "--out", str(tmp_path / "e")], f"RUN_DIR: '{empty}' holds no checkpoint")


@pytest.mark.slow
def test_export_writes_what_safetensors_loads_bit_for_bit(run, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    run_dir, summary = run
    out = tmp_path / "export"
    printed = cli_json(capsys, ["export", str(run_dir), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert printed == {"out": str(out), **config}
    assert config["digest"] == summary["params_digest"] and config["round"] == 2
    assert config["format"] == "diloco-export/1" and config["text"] == "bytes" and config["tokenizer"] is None
    assert config["model"] == to_dict(load_config(run_dir / "config.toml").model)
    theta = flatten_named(committed_theta(run_dir))
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == theta.keys() and config["tensors"] == len(theta)
    for name, array in theta.items():
        assert loaded[name].dtype == np.float32 and loaded[name].shape == array.shape
        assert loaded[name].tobytes() == array.tobytes(), name
    with safe_open(str(out / "model.safetensors"), framework="np") as f:
        assert f.metadata()["digest"] == summary["params_digest"]
    assert config["param_count"] == sum(a.size for a in theta.values())


@pytest.mark.slow
def test_export_refuses_a_directory_that_holds_something_unless_forced(run, tmp_path, capsys):
    run_dir, _ = run
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    fails(capsys, ["export", str(run_dir), "--out", str(out)], f"--out '{out}' is not empty")
    assert main(["export", str(run_dir), "--out", str(out), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    capsys.readouterr()
    fails(capsys, ["export", str(run_dir), "--out", str(out / "notes.txt")], "is a file, not a directory")


def doc_block() -> str:
    """docs/export.md's ```python block: a safetensors reader and a NumPy forward that need nothing of this project."""
    text = (REPO / "docs" / "export.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    return block


@pytest.mark.slow
def test_the_documented_numpy_forward_matches_the_model(run, tmp_path, capsys):
    run_dir, _ = run
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    block = doc_block()
    assert re.findall(r"^(?:import|from) (\w+)", block, re.M) == ["json", "numpy"]  # nothing of this project
    doc: dict = {}
    exec(compile(block, "docs/export.md", "exec"), doc)  # the documentation's own code
    weights = doc["load_safetensors"](out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())["model"]
    trained = load_trained(run_dir)
    for name, array in flatten_named(trained.params).items():
        assert weights[name].tobytes() == array.tobytes()
    tokens = np.frombuffer(b"the wan link loss step", np.uint8).astype(np.int64)
    ours, _ = transformer.forward(trained.params, jnp.asarray(tokens)[None], trained.model)
    np.testing.assert_allclose(doc["forward"](weights, cfg, tokens), np.asarray(ours[0]), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_tokens_run_samples_and_exports_through_its_tokenizer(tmp_path, capsys, monkeypatch):
    from tokenizers import Tokenizer

    corpus = write_corpus(tmp_path / "corpus.txt")
    prepared = tmp_path / "prepared"
    assert main(["data", "prepare", str(corpus), "--out", str(prepared), "--train-vocab", "300", "--no-progress"]) == 0
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=prepared))
    overrides = [*RUN, "data.kind=tokens", "model.vocab_size=300", "train.rounds=1"]
    run_simulation(load_config(config, overrides), tmp_path / "run", show_progress=False)
    capsys.readouterr()
    out = cli_json(capsys, ["sample", str(tmp_path / "run"), "--prompt", "the island", "--temperature", "0", "--json"])
    tokenizer = Tokenizer.from_file(str(prepared / "tokenizer.json"))
    (sample,) = out["samples"]
    assert out["text"] == "tokenizer" and len(sample["tokens"]) == 32 - len(tokenizer.encode("the island").ids)
    assert sample["continuation"] == tokenizer.decode(sample["tokens"], skip_special_tokens=False)
    exported = cli_json(capsys, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    assert exported["text"] == "tokenizer" and exported["tokenizer"] == "tokenizer.json"
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now raises ImportError
    fails(capsys, ["sample", str(tmp_path / "run"), "--prompt", "a"], "pip install 'diloco[tokenize]'")
    monkeypatch.delitem(sys.modules, "tokenizers")
    (prepared / "tokenizer.json").unlink()
    fails(capsys, ["sample", str(tmp_path / "run"), "--prompt", "a"], "holds no tokenizer.json")


@pytest.mark.multiprocess
def test_sample_reads_a_launched_federations_theta(shared_launch, capsys):
    assert shared_launch.returncode == 0, shared_launch.stderr
    summary = json.loads((shared_launch.run_dir / "summary.json").read_text())
    out = cli_json(capsys, ["sample", str(shared_launch.run_dir), "--prompt", "the", "--json"])
    assert out["digest"] == summary["params_digest"] and out["round"] == summary["rounds"]
    assert len(out["samples"][0]["tokens"]) == 16 - 3
