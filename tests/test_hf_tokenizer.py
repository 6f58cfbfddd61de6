"""A run from a Hugging Face checkpoint reads all its text through the checkpoint's tokenizer (islands/text.py
`tokenizer_file`): its post-training conversations through the checkpoint's chat template, ending at its EOS, and
`diloco sample`'s prompts of the finished run, from the copy in RUN/hf/ once the checkpoint is gone; a run resumed
after its checkpoint moved is the same run while the tokenizer's bytes are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from diloco.cli import main
from diloco.config import load_config
from diloco.run.posttrain import PostTraining
from diloco.run.rundir import read_events
from islands.text import TokenizerText
from islands.workloads.batches import chat_row
from islands.workloads.config import IslandWorkload
from tests.conftest import fails, run_cli
from tests.test_hf_import import FIXTURES, run_config

pytestmark = pytest.mark.timeout(180)

LLAMA = FIXTURES / "llama"
TALKS = [
    [{"role": "user", "content": f"{a} plus {a}?"}, {"role": "assistant", "content": f"{2 * a}"}] for a in range(12)
]


def sft_config(tmp: Path, source: Path) -> tuple[Path, list[str]]:
    """A run config from `source` whose islands learn conversations (its [data], a byte corpus, is not trained on)."""
    chats = tmp / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": t}) + "\n" for t in TALKS))
    config = run_config(tmp, source)
    overrides = ["data.kind=text", f"data.path={tmp / 'corpus.txt'}", "workload.kind=sft",
                 f"workload.path={chats}", "workload.heldout_examples=2", "workload.max_new_tokens=4"]  # fmt: skip
    return config, overrides


def test_post_training_conversations_are_the_checkpoints_tokens_ending_at_its_eos(tmp_path: Path) -> None:
    config, overrides = sft_config(tmp_path, LLAMA)
    cfg = load_config(config, overrides)
    post = PostTraining(cfg, None)
    codec = post.codec.codec
    assert isinstance(codec, TokenizerText) and codec.path == LLAMA / "tokenizer.json"
    theirs = Tokenizer.from_file(str(LLAMA / "tokenizer.json"))
    assert post.codec.stop == theirs.token_to_id("<|im_end|>") and post.codec.pad == theirs.token_to_id("<|endoftext|>")
    example = post.examples(IslandWorkload("sft", cfg.workload.path)).train[0]
    assert example.text.startswith("<|im_start|>user\n")  # type: ignore[union-attr]  # the checkpoint's template
    tokens, mask = chat_row(post.codec, example.text, example.spans, cfg.model.seq_len)  # type: ignore[union-attr]
    ids = theirs.encode(example.text, add_special_tokens=False).ids
    assert tokens[: len(ids)].tolist() == ids and max(ids) >= 256  # the tokenizer's ids, not bytes
    targets = tokens[1:][mask == 1]
    assert theirs.decode(targets.tolist(), skip_special_tokens=False) == f"{example.response}<|im_end|>"


def test_a_chat_template_in_its_own_file_is_the_tokenizers(tmp_path: Path) -> None:
    """transformers' save_pretrained (4.50 on) writes the template to chat_template.jinja, not tokenizer_config.json:
    it is the run's template, and it wins over one in tokenizer_config.json, as in transformers."""
    config = json.loads((LLAMA / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    shutil.copyfile(LLAMA / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert TokenizerText(tmp_path / "tokenizer.json", 320, "test").chat_template is None
    (tmp_path / "chat_template.jinja").write_text(template)
    text = TokenizerText(tmp_path / "tokenizer.json", 320, "test")
    assert text.chat_template == template and text.template_file == tmp_path / "chat_template.jinja"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'older' }}"}))
    assert TokenizerText(tmp_path / "tokenizer.json", 320, "test").chat_template == template
    prepared = tmp_path / "prepared"
    (tmp_path / "text.txt").write_text("the island round delta\n")
    assert main(["data", "prepare", str(tmp_path / "text.txt"), "--out", str(prepared), "--tokenizer",
                 str(tmp_path / "tokenizer.json"), "--no-progress"]) == 0  # fmt: skip
    assert (prepared / "chat_template.jinja").read_text() == template  # it goes along with the tokenizer


@pytest.mark.slow
def test_an_sft_run_from_a_checkpoint_samples_through_its_tokenizer_once_the_checkpoint_is_gone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "llama"
    shutil.copytree(LLAMA, source)
    config, overrides = sft_config(tmp_path, source)
    run_dir = tmp_path / "run"
    assert main(["simulate", str(config), *overrides, "--run-dir", str(run_dir), "--no-progress"]) == 0
    capsys.readouterr()
    shutil.rmtree(source)  # the run decodes with the tokenizer it copied into RUN/hf/
    prompt = "<|im_start|>user\n3 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    assert main(["sample", str(run_dir), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "6",
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "tokenizer" and out["stop"] == "<|im_end|>"
    theirs = Tokenizer.from_file(str(run_dir / "hf" / "tokenizer.json"))
    (sample,) = out["samples"]
    eos, tokens = theirs.token_to_id("<|im_end|>"), sample["tokens"]
    assert eos not in tokens[:-1] and (tokens[-1] == eos or len(tokens) == 6)  # it stops at the checkpoint's EOS
    shown = tokens[:-1] if tokens[-1] == eos else tokens
    assert sample["continuation"] == theirs.decode(shown, skip_special_tokens=False)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_launch_from_a_checkpoint_ends_with_simulates_parameters(tmp_path: Path) -> None:
    """Two island processes and a coordinator, each reading the conversations through the checkpoint's tokenizer,
    end where one `diloco simulate` process ends."""
    config, overrides = sft_config(tmp_path, LLAMA)
    overrides += ["islands.count=2", "train.rounds=2", "quorum.min_islands=2"]  # each round holds both islands
    digests = []
    for command in ("launch", "simulate"):
        run_dir = tmp_path / command
        out = run_cli(command, str(config), *overrides, "--run-dir", str(run_dir), "--no-progress", timeout=180)
        assert out.returncode == 0, out.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds"] == 2
        digests.append(summary["params_digest"])
    assert digests[0] == digests[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_resumes_from_its_moved_checkpoint_while_the_tokenizers_bytes_are_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.tokenizer holds the checkpoint's path; resumed with init.from at the checkpoint's new place, the run goes
    on (the tokenizer compared by content: the run's copy in RUN/hf/ against the new file), and another tokenizer
    there is refused in one line naming data.tokenizer."""
    first = tmp_path / "llama"
    shutil.copytree(LLAMA, first)
    config = run_config(tmp_path, first)
    run_dir = tmp_path / "run"
    assert main(["simulate", str(config), "--run-dir", str(run_dir), "--no-progress"]) == 0
    moved = tmp_path / "moved"
    first.rename(moved)
    resume = ["simulate", str(config), "--run-dir", str(run_dir), "--no-progress", f"init.from={moved}"]
    assert main([*resume, "train.rounds=2"]) == 0
    [changed] = read_events(run_dir / "metrics.jsonl", "config_changed")
    assert changed["changes"]["data.tokenizer"] == [str(first / "tokenizer.json"), str(moved / "tokenizer.json")]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
    capsys.readouterr()
    elsewhere = tmp_path / "elsewhere"  # the same config.json beside another tokenizer
    shutil.copytree(moved, elsewhere)
    tokenizer = json.loads((elsewhere / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = tokenizer["added_tokens"][:-1]
    (elsewhere / "tokenizer.json").write_text(json.dumps(tokenizer))
    args = ["simulate", str(config), "--run-dir", str(run_dir), "--no-progress", f"init.from={elsewhere}"]
    fails(capsys, [*args, "train.rounds=3"], "config differs in: data.tokenizer")
