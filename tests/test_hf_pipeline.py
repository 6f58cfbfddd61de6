"""README's "From an open checkpoint": a Hugging Face directory -> SFT on conversations -> GRPO -> `diloco export
--format hf`, each stage a DiLoCo run over islands started from the last (`init.from`). A run from a run that started
from a checkpoint is a run from that checkpoint as trained so far (islands/models/hf/checkpoint.py `kept_checkpoint`):
its [model], its tokenizer and the files its export writes back go down the chain.

No hub is reachable here, so the end-to-end test makes its checkpoint with the project: a tiny Llama-family model
pre-trained on a corpus that `diloco data prepare` tokenized with the llama fixture's tokenizer (a ChatML template and
special tokens in its tokenizer_config.json, tests/fixtures/hf/make_fixtures.py), exported with `--format hf`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from diloco.config import InitConfig, load_config
from diloco.ops.trained import kept_tokenizer
from islands.data import DataConfig
from islands.models.hf.checkpoint import kept_checkpoint
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


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
