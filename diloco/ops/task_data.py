"""`diloco data task NAME --out DIR`: a built-in task's post-training data, as files to look at, edit and train on.

    diloco data task addition --out data/addition                  # 2-digit addition, seed 0
    diloco data task addition --out data/add3 --digits 3 --n 5000 --heldout 500 --seed 1
    diloco data task addition --out data/chat --chat               # conversations, for a checkpoint's chat template

DIR gets, in the formats of islands/posttrain/data.py (the task: islands/posttrain/task.py):

    sft.jsonl  dpo.jsonl  rl.jsonl                          --n examples each, of the train split
    sft-heldout.jsonl  dpo-heldout.jsonl  rl-heldout.jsonl  --heldout examples each, of the held-out split
    pretrain.txt                                            --pretrain lines "A+B=SUM" of the train split (text)
    task.json                                               what made them: task, seed, digits, counts, reward, stop

With --chat the JSONL files hold the same examples as conversations (TRL's conversational layouts: the prompt a user
message, each answer an assistant message), which a run renders through its tokenizer's chat template.

Files are written whole or not at all, task.json last. An --out that holds any of them is refused, so that data a
user edited is never overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from floor.files import write_atomically
from islands.posttrain.data import MAX_EXAMPLES, Example, PreferencePair, SftExample, write_examples
from islands.posttrain.rewards import BUILTIN
from islands.posttrain.task import Task, TaskError, builtin_task

KINDS: tuple[str, ...] = ("sft", "dpo", "rl")
PRETRAIN_FILE = "pretrain.txt"
META_FILE = "task.json"


def file_name(kind: str, split: str) -> str:
    """The file of one kind of data and split: sft.jsonl, sft-heldout.jsonl, ..."""
    return f"{kind}.jsonl" if split == "train" else f"{kind}-{split}.jsonl"


def _examples(task: Task, kind: str, n: int, split: str) -> list[Any]:
    make = {"sft": task.sft, "dpo": task.pairs, "rl": task.prompts}[kind]
    return make(n, split)


def conversation(example: Example) -> dict[str, Any]:
    """An example as the conversational record of its kind (islands/posttrain/data.py): the prompt a user message,
    each answer an assistant message; an rl example's reference answer stays a string."""
    user = [{"role": "user", "content": example.prompt}]

    def reply(text: str) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": text}]

    if isinstance(example, SftExample):
        return {"messages": user + reply(example.response)}
    if isinstance(example, PreferencePair):
        return {"prompt": user, "chosen": reply(example.chosen), "rejected": reply(example.rejected)}
    return {"prompt": user} | ({"answer": example.answer} if example.answer is not None else {})


def write_task(
    name: str, out: Path, n: int, heldout: int, pretrain: int, seed: int, digits: int, chat: bool = False
) -> dict[str, Any]:
    """Write task `name`'s data into `out` (module docstring); returns what task.json records.

    Everything is made before the first file is written: a request the task cannot meet (more problems than a split
    holds) leaves `out` as it was."""
    for flag, value in (("--n", n), ("--heldout", heldout), ("--pretrain", pretrain)):
        if not 1 <= value <= MAX_EXAMPLES:
            raise TaskError(f"{flag} must be from 1 to {MAX_EXAMPLES} (got {value})")
    task = builtin_task(name, seed, digits)
    if out.exists() and not out.is_dir():
        raise TaskError(f"--out {out}: not a directory")
    wanted = [(kind, split, count) for split, count in (("train", n), ("heldout", heldout)) for kind in KINDS]
    present = [f for f in [*(file_name(k, s) for k, s, _ in wanted), PRETRAIN_FILE, META_FILE] if (out / f).exists()]
    if present:
        raise TaskError(f"--out {out} already holds {present[0]}: remove it or choose another directory")
    data = {file_name(kind, split): _examples(task, kind, count, split) for kind, split, count in wanted}
    text = task.pretraining_text(pretrain)
    out.mkdir(parents=True, exist_ok=True)
    for file, examples in data.items():
        if chat:
            write_atomically(out / file, "".join(json.dumps(conversation(e)) + "\n" for e in examples))
        else:
            write_examples(out / file, examples)
    write_atomically(out / PRETRAIN_FILE, text)
    meta = {
        "task": task.name,
        "seed": seed,
        "digits": digits,
        "reward": BUILTIN + task.name,
        "stop": task.stop,
        "layout": "chat" if chat else "plain",
        "files": {
            **{file_name(kind, split): {"split": split, "examples": count} for kind, split, count in wanted},
            PRETRAIN_FILE: {"split": "train", "lines": pretrain},
        },
    }
    write_atomically(out / META_FILE, json.dumps(meta, indent=2) + "\n")
    return meta
