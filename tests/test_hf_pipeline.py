"""README's "From an open checkpoint": a Hugging Face directory -> SFT on conversations -> GRPO -> `diloco export
--format hf`, each stage a DiLoCo run over islands started from the last (`init.from`). A run from a run that started
from a checkpoint is a run from that checkpoint as trained so far (islands/models/hf/checkpoint.py `kept_checkpoint`):
its [model], its tokenizer and the files its export writes back go down the chain.

No hub is reachable here, so the end-to-end test makes its checkpoint with the project: a tiny Llama-family model
pre-trained on a corpus that `diloco data prepare` tokenized with the llama fixture's tokenizer (a ChatML template and
special tokens in its tokenizer_config.json, tests/fixtures/hf/make_fixtures.py), exported with `--format hf`."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer

from diloco.config import InitConfig, load_config
from diloco.ops.trained import kept_tokenizer, load_trained
from diloco.run.rundir import read_events
from islands.data import DataConfig
from islands.models.hf.checkpoint import kept_checkpoint
from islands.models.hf.families import open_import
from islands.models.registry import ARCHITECTURES, build_model
from islands.models.transformer import forward
from pytrees.naming import flatten_named, unflatten_named
from tests.conftest import REPO, child_env
from tests.test_hf_export import needs_transformers, transformers_check
from tests.test_hf_import import FIXTURES, run_config

LLAMA = FIXTURES / "llama"
HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def finished_run(path: Path, checkpoint: Path | None) -> Path:
    """A run directory as a run from `checkpoint` leaves it (config.toml, a checkpoint step, RUN/hf/ with the
    checkpoint's files; no RUN/hf/ for a run from scratch): what the config loader reads of it."""
    (path / "checkpoints" / "coordinator" / "3" / "state").mkdir(parents=True)
    (path / "config.toml").write_text("[run]\nname = 'sft'\n")
    if checkpoint is not None:
        (path / "hf").mkdir()
        for name in HF_FILES:
            shutil.copyfile(checkpoint / name, path / "hf" / name)
    return path


def test_a_run_from_a_run_from_a_checkpoint_is_from_that_checkpoint(tmp_path: Path) -> None:
    sft = finished_run(tmp_path / "sft", LLAMA)
    for source in (sft, sft / "checkpoints" / "coordinator", sft / "checkpoints" / "coordinator" / "3"):
        assert kept_checkpoint(source) == sft / "hf"
        cfg = load_config(run_config(tmp_path, source))
        assert (cfg.model.kind, cfg.model.vocab_size, cfg.model.rope_scaling) == ("llama", 320, "llama3")
        assert cfg.data.tokenizer == str(sft / "hf" / "tokenizer.json")
    assert kept_checkpoint(LLAMA) == LLAMA
    scratch = finished_run(tmp_path / "scratch", None)  # a run trained here: no checkpoint behind it
    assert kept_checkpoint(scratch) is None and kept_checkpoint(tmp_path / "absent") is None
    assert load_config(run_config(tmp_path, scratch), ["model.kind=transformer"]).model.kind == "transformer"


def test_a_chained_run_decodes_with_its_own_copy_once_its_source_is_gone(tmp_path: Path) -> None:
    """diloco/ops/trained.py `kept_tokenizer`: the tokenizer the loader named in the source run's RUN/hf/ is read from
    this run's RUN/hf/ (copied there when it started); a tokenizer the run named itself is kept."""
    grpo = finished_run(tmp_path / "grpo", LLAMA)
    named = DataConfig(kind="jsonl", path="docs.jsonl", tokenizer=str(tmp_path / "sft" / "hf" / "tokenizer.json"))
    for source in ("sft", "sft/checkpoints/coordinator/3"):
        init = InitConfig(from_=str(tmp_path / source))
        assert kept_tokenizer(named, init, grpo).tokenizer == str(grpo / "hf" / "tokenizer.json")
    own = DataConfig(kind="jsonl", path="docs.jsonl", tokenizer=str(tmp_path / "mine" / "tokenizer.json"))
    assert kept_tokenizer(own, InitConfig(from_=str(tmp_path / "sft")), grpo) == own


# -- the pipeline, end to end --------------------------------------------------------------------------------------

README = REPO / "README.md"
PRETRAIN = ["train.rounds=2", "model.seq_len=64", "model.vocab_size=320", "data.kind=tokens", "data.path=data/pre"]
"""configs/llama-tiny.toml, shortened, on the task's pretrain.txt in the fixture tokenizer's ids: the checkpoint."""


def readme_commands() -> list[str]:
    """The shell lines of README's "From an open checkpoint" block, with the CKPT= line left to the caller."""
    section = README.read_text().split("### From an open checkpoint\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("CKPT=")]


def shell(line: str, cwd: Path, ckpt: Path) -> None:
    """One README line, as a user's shell runs it in `cwd` (configs/ there is the repository's), with this test's
    Python for `.venv/bin/diloco`."""
    command = line.replace(".venv/bin/diloco", f"{shlex.quote(sys.executable)} -m diloco.cli")
    env = {**child_env(jax_cache=True), "CKPT": str(ckpt)}
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir / "metrics.jsonl") if e.get("event") == name]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """README's lines run as written in a fresh directory, from a checkpoint made here (module docstring); the GRPO
    stage through `simulate` (the same arguments: `launch` ends with its digest, tests/test_hf_tokenizer.py)."""
    home = tmp_path_factory.mktemp("pipeline")
    (home / "configs").symlink_to(REPO / "configs")
    ckpt = home / "models" / "ckpt"
    data, sft, grpo, export = readme_commands()
    assert " launch configs/from-checkpoint-grpo.toml " in grpo
    shell(data, home, ckpt)
    shell(f".venv/bin/diloco data prepare data/chat/pretrain.txt --out data/pre --tokenizer {LLAMA / 'tokenizer.json'}",
          home, ckpt)  # fmt: skip
    shell(f".venv/bin/diloco simulate configs/llama-tiny.toml --run-dir runs/pre {' '.join(PRETRAIN)}", home, ckpt)
    shell(".venv/bin/diloco export runs/pre --out models/ckpt --format hf", home, ckpt)
    shell(sft, home, ckpt)
    shell(grpo.replace(" launch ", " simulate "), home, ckpt)
    shell(export, home, ckpt)
    return home


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_each_stage_starts_where_the_last_ended(pipeline: Path) -> None:
    runs, ckpt = pipeline / "runs", pipeline / "models" / "ckpt"
    (to_sft,) = events(runs / "ckpt-sft", "warm_start")
    assert to_sft["source"] == str(ckpt) and to_sft["format"] == "hf"  # $CKPT
    assert to_sft["digest"] == summary(runs / "pre")["params_digest"]  # exported and imported bit for bit
    (to_grpo,) = events(runs / "ckpt-grpo", "warm_start")
    assert to_grpo["source"].startswith("runs/ckpt-sft/checkpoints/coordinator/")
    assert to_grpo["digest"] == summary(runs / "ckpt-sft")["params_digest"]
    assert summary(runs / "ckpt-grpo")["params_digest"] != to_grpo["digest"]  # GRPO trained
    for name in HF_FILES:  # the checkpoint's files went down the chain, into the final export
        assert (runs / "ckpt-grpo" / "hf" / name).read_bytes() == (ckpt / name).read_bytes()
        assert (pipeline / "models" / "ckpt-grpo" / name).read_bytes() == (ckpt / name).read_bytes()
    template = json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"]
    assert template == json.loads((LLAMA / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_sft_learns_the_conversations_and_grpo_scores_its_answers(pipeline: Path) -> None:
    sft, grpo = summary(pipeline / "runs" / "ckpt-sft"), summary(pipeline / "runs" / "ckpt-grpo")
    assert sft["workload"] == "sft" and sft["final_scores"]["sft_ce"] < sft["initial_scores"]["sft_ce"]
    assert grpo["workload"] == "rl" and set(grpo["final_scores"]) == {"rl_reward", "rl_exact_match"}
    steps = [e for e in events(pipeline / "runs" / "ckpt-grpo", "inner") if "reward" in e]
    assert steps and all(0.0 <= e["reward"] <= 1.0 for e in steps)
    assert max(e["kl"] for e in steps) > 0  # the policy left its reference, the SFT's θ


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_the_final_export_gives_the_runs_own_logits(pipeline: Path) -> None:
    trained = load_trained(pipeline / "runs" / "ckpt-grpo")
    out = pipeline / "models" / "ckpt-grpo"
    shapes = {name: array.shape for name, array in flatten_named(trained.params).items()}
    back = open_import(out, trained.model, shapes, "test").read()
    assert all(np.array_equal(back[n], a) for n, a in flatten_named(trained.params).items())
    ids = np.array([Tokenizer.from_file(str(out / "tokenizer.json")).encode("<|im_start|>user\n37+48=").ids])
    ours, _ = forward(trained.params, ids, trained.model, ARCHITECTURES[trained.model.kind])
    like = jax.eval_shape(build_model(trained.model).init, jax.random.key(0))
    theirs, _ = forward(unflatten_named(back, like), ids, trained.model, ARCHITECTURES[trained.model.kind])
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.reference
@needs_transformers
@pytest.mark.timeout(1200)
def test_transformers_gives_the_final_exports_logits(pipeline: Path, tmp_path: Path) -> None:
    """transformers' AutoModelForCausalLM and AutoTokenizer on the final export (make_fixtures.py check) against the
    project's forward of the GRPO run's θ."""
    trained = load_trained(pipeline / "runs" / "ckpt-grpo")
    ids = np.array([[1, 84, 85, 86, 87, 88, 89, 90], [1, 91, 92, 93, 94, 95, 96, 97]], np.int32)
    logits, _ = forward(trained.params, ids, trained.model, ARCHITECTURES[trained.model.kind])
    np.save(tmp_path / "logits.npy", np.asarray(logits))
    greedy = [[int(np.asarray(logits)[r, -1].argmax())] for r in range(len(ids))]
    (tmp_path / "reference.json").write_text(
        json.dumps({"family": "grpo", "input_ids": ids.tolist(), "greedy": greedy})
    )
    result = transformers_check(pipeline / "models" / "ckpt-grpo", tmp_path)
    print(json.dumps(result))
    assert result["architecture"] == "LlamaForCausalLM" and result["max_abs_logit_diff"] < 1e-5, result
    assert result["chat"].startswith("<|im_start|>user\nhi<|im_end|>")
