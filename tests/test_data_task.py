"""`diloco data task`: a built-in task's data written as files that read back, never over a user's edits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from diloco.cli import main
from islands.chat import ChatTemplate
from islands.posttrain.data import PreferencePair, RlPrompt, SftExample, read_examples, utf8_length
from islands.posttrain.rewards import load_reward, score
from islands.posttrain.task import Addition, in_heldout
from islands.text import TokenizerText
from tests.conftest import fails, run_cli
from tests.test_hf_import import FIXTURES

ARGS = ["--n", "40", "--heldout", "10", "--pretrain", "30", "--digits", "2", "--seed", "7"]


def test_the_files_read_back_as_the_task_made_them(tmp_path: Path) -> None:
    out = tmp_path / "data" / "addition"
    done = run_cli("data", "task", "addition", "--out", str(out), *ARGS, timeout=60)
    assert done.returncode == 0, done.stderr
    meta = json.loads((out / "task.json").read_text())
    assert json.loads(done.stdout) == {"out": str(out), **meta}
    assert meta["task"] == "addition" and meta["seed"] == 7 and meta["digits"] == 2 and meta["stop"] == "\n"
    task = Addition(seed=7, digits=2)
    for kind, split, made, n in [
        ("sft", "train", task.sft, 40),
        ("dpo", "train", task.pairs, 40),
        ("rl", "train", task.prompts, 40),
        ("sft", "heldout", task.sft, 10),
        ("dpo", "heldout", task.pairs, 10),
        ("rl", "heldout", task.prompts, 10),
    ]:
        name = f"{kind}.jsonl" if split == "train" else f"{kind}-heldout.jsonl"
        assert read_examples(out / name, kind, utf8_length, 16) == made(n, split)
        assert meta["files"][name] == {"split": split, "examples": n}
    assert (out / "pretrain.txt").read_text() == task.pretraining_text(30)
    rl = read_examples(out / "rl-heldout.jsonl", "rl", utf8_length, 16)
    assert all(isinstance(r, RlPrompt) and in_heldout(*map(int, r.prompt[:-1].split("+"))) for r in rl)
    rewards = score(load_reward(meta["reward"]), [r.prompt for r in rl], [r.answer or "" for r in rl])
    assert rewards.tolist() == [1.0] * 10
    sft = read_examples(out / "sft.jsonl", "sft", utf8_length, 16)
    dpo = read_examples(out / "dpo.jsonl", "dpo", utf8_length, 16)
    assert isinstance(sft[0], SftExample) and isinstance(dpo[0], PreferencePair)


def test_chat_writes_the_same_examples_as_conversations(tmp_path: Path) -> None:
    """--chat: each file's examples as conversations that a chat template (the llama fixture's ChatML) renders back
    into the task's prompts and answers."""
    out = tmp_path / "chat"
    assert main(["data", "task", "addition", "--out", str(out), *ARGS, "--chat"]) == 0
    assert json.loads((out / "task.json").read_text())["layout"] == "chat"
    codec = TokenizerText(FIXTURES / "llama" / "tokenizer.json", 320, "test")
    assert codec.chat_template is not None
    chat = ChatTemplate(codec.chat_template, codec.special, "the fixture")
    task = Addition(seed=7, digits=2)
    for kind, made in (("sft", task.sft), ("dpo", task.pairs), ("rl", task.prompts)):
        read = read_examples(out / f"{kind}.jsonl", kind, len, 256, chat)
        for theirs, ours in zip(read, made(40, "train"), strict=True):
            assert theirs.prompt == f"<|im_start|>user\n{ours.prompt}<|im_end|>\n<|im_start|>assistant\n"
            assert dataclasses.replace(ours, prompt=theirs.prompt) == type(ours)(
                **{f.name: getattr(theirs, f.name) for f in dataclasses.fields(ours)}
            )


def test_existing_files_are_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "task"
    assert main(["data", "task", "addition", "--out", str(out), *ARGS]) == 0
    edited = '{"prompt": "1+1=", "response": "2"}\n'
    (out / "sft.jsonl").write_text(edited)
    capsys.readouterr()
    fails(capsys, ["data", "task", "addition", "--out", str(out)], f"--out {out} already holds sft.jsonl")
    assert (out / "sft.jsonl").read_text() == edited


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--n", "0"], "--n must be from 1 to 1048576 (got 0)"),
        (["--heldout", "-1"], "--heldout must be from 1 to 1048576 (got -1)"),
        (["--digits", "12"], "addition's digits must be an integer from 1 to 9 (got 12)"),
        (["--seed", "-2"], "the task's seed must be an integer >= 0 (got -2)"),
        (["--digits", "1", "--n", "200"], "1-digit addition has 98 train problems, fewer than the 200 asked for"),
    ],
)
def test_a_request_the_task_cannot_meet_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    out = tmp_path / "task"
    fails(capsys, ["data", "task", "addition", "--out", str(out), *args], says)
    assert not out.exists()


def test_an_out_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    fails(capsys, ["data", "task", "addition", "--out", str(tmp_path / "file")], "not a directory")
