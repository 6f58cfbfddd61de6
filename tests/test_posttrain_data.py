"""Post-training JSONL files: what reads back, and every refusal as one line naming FILE:LINE and the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from islands.posttrain import data
from islands.posttrain.data import (
    PostTrainDataError,
    PreferencePair,
    RlPrompt,
    SftExample,
    read_examples,
    utf8_length,
    write_examples,
)

SEQ = 64


def _file(tmp_path: Path, *lines: str | bytes, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def _refused(
    path: Path, kind: str, *fragments: str, max_tokens: int = SEQ, count: Callable[[str], int] = utf8_length
) -> str:
    with pytest.raises(PostTrainDataError) as err:
        read_examples(path, kind, count, max_tokens)
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


@pytest.mark.parametrize(
    ("kind", "examples"),
    [
        ("sft", [SftExample("37+485=", "522"), SftExample("naïve 日本 🎉\t?", ' "quoted"\\ ')]),
        ("dpo", [PreferencePair("1+1=", "2", "3"), PreferencePair("Ωmega", "yes", "no")]),
        ("rl", [RlPrompt("2+2=", "4"), RlPrompt("say hi"), RlPrompt("x", None)]),
    ],
)
def test_examples_written_read_back_equal(tmp_path: Path, kind: str, examples: list[data.Example]) -> None:
    path = tmp_path / f"{kind}.jsonl"
    write_examples(path, examples)
    assert read_examples(path, kind, utf8_length, SEQ) == examples
    if kind == "rl":  # an absent answer is left out of the line, not written as null
        assert json.loads(path.read_text().splitlines()[1]) == {"prompt": "say hi"}


def test_blank_lines_crlf_a_bom_and_a_null_answer_are_read(tmp_path: Path) -> None:
    path = tmp_path / "rl.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n   \n{"answer": null, "prompt": "b"}\r\n{"prompt": "c", "answer": "d"}'
    )
    assert read_examples(path, "rl", utf8_length, SEQ) == [RlPrompt("a"), RlPrompt("b"), RlPrompt("c", "d")]


BAD_LINES = [
    ("sft", '{"prompt": "a", "response": }', "not JSON (Expecting value at column 29)"),
    ("sft", "prompt=a response=b", "not JSON (Expecting value at column 1)"),
    ("sft", '["a", "b"]', 'not a JSON object (sft examples are {"prompt": ..., "response": ...}; got an array)'),
    (
        "dpo",
        '"text"',
        'not a JSON object (dpo examples are {"prompt": ..., "chosen": ..., "rejected": ...}; got a string)',
    ),
    ("sft", '{"prompt": "a"}', "missing field 'response'"),
    ("dpo", '{"prompt": "a", "chosen": "b"}', "missing field 'rejected'"),
    ("rl", '{"answer": "4"}', "missing field 'prompt'"),
    ("sft", '{"prompt": "a", "response": 3}', "field 'response' must be a string (got 3)"),
    ("sft", '{"prompt": null, "response": "b"}', "field 'prompt' must be a string (got null)"),
    ("rl", '{"prompt": "a", "answer": ["4"]}', "field 'answer' must be a string (got [\"4\"])"),
    ("sft", '{"prompt": "a", "response": " \\t "}', "field 'response' is empty"),
    ("rl", '{"prompt": "a", "answer": ""}', "field 'answer' is empty"),
    ("dpo", '{"prompt": "", "chosen": "b", "rejected": "c"}', "field 'prompt' is empty"),
    (
        "sft",
        '{"promt": "a", "response": "b"}',
        "unknown field 'promt' (did you mean 'prompt'? sft examples have prompt, response)",
    ),
    ("rl", '{"prompt": "a", "label": "b"}', "unknown field 'label' (rl examples have prompt, answer)"),
    ("sft", '{"prompt": "a", "prompt": "b", "response": "c"}', "field 'prompt' appears twice"),
    ("dpo", '{"prompt": "a", "chosen": "b ", "rejected": "b"}', "fields 'chosen' and 'rejected' are the same text"),
    ("sft", "[" * 200_000, "arrays or objects nested too deep"),
    ("sft", '{"prompt": ' + "7" * 5000 + "}", "not JSON we read (Exceeds the limit"),
    ("sft", b'{"prompt": "\xff", "response": "b"}', "not UTF-8 text (byte 13 of the line)"),
]


@pytest.mark.parametrize(("kind", "line", "says"), BAD_LINES)
def test_a_bad_line_is_one_line_naming_file_line_and_field(tmp_path: Path, kind: str, line: str, says: str) -> None:
    good = {"sft": '{"prompt": "p", "response": "r"}', "dpo": '{"prompt": "p", "chosen": "c", "rejected": "r"}'}
    path = _file(tmp_path, good.get(kind, '{"prompt": "p"}'), "", line, good.get(kind, '{"prompt": "p"}'))
    _refused(path, kind, f"{path}:3: ", says)


def test_a_long_value_or_field_name_is_cut_short_in_the_message(tmp_path: Path) -> None:
    name = "x" * 1000
    message = _refused(_file(tmp_path, json.dumps({"prompt": "a", name: "b"})), "sft", "unknown field 'xxxx")
    assert len(message) < len(str(tmp_path)) + 200


@pytest.mark.parametrize(
    ("kind", "record", "says"),
    [
        ("sft", {"prompt": "x" * 10, "response": "y" * 6}, "prompt 10 + response 6 + 1 stop token = 17 tokens"),
        ("sft", {"prompt": "日本", "response": "y" * 10}, "prompt 6 + response 10 + 1 stop token = 17 tokens"),
        ("dpo", {"prompt": "x" * 8, "chosen": "y", "rejected": "z" * 8}, "prompt 8 + rejected 8 + 1 stop token"),
        ("rl", {"prompt": "x" * 16}, "prompt 16 + 1 stop token = 17 tokens"),
        ("rl", {"prompt": "x" * 8, "answer": "y" * 8}, "prompt 8 + answer 8 + 1 stop token = 17 tokens"),
    ],
)
def test_an_example_longer_than_the_context_is_refused(
    tmp_path: Path, kind: str, record: dict[str, str], says: str
) -> None:
    _refused(_file(tmp_path, json.dumps(record)), kind, f"{tmp_path}/data.jsonl:1: too long", says, max_tokens=16)
    assert read_examples(_file(tmp_path, json.dumps(record)), kind, utf8_length, 17)  # one more token: it fits


def test_the_given_token_count_decides_the_length(tmp_path: Path) -> None:
    """A tokenizer of one token per word: the count is the caller's, not the bytes."""
    path = _file(tmp_path, json.dumps({"prompt": "one two three", "response": "four five"}))
    words = lambda text: len(text.split())  # noqa: E731
    assert len(read_examples(path, "sft", words, 6)) == 1
    _refused(
        path, "sft", "prompt 3 + response 2 + 1 stop token = 6 tokens > model.seq_len (5)", max_tokens=5, count=words
    )


def test_an_empty_file_and_a_blank_one_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    _refused(empty, "sft", f"{empty}: no sft examples (the file is empty or blank)")
    _refused(_file(tmp_path, "", "  ", "\t"), "dpo", "no dpo examples")


def test_an_unknown_kind_a_missing_file_and_a_directory_are_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, '{"prompt": "a"}')
    _refused(path, "ppo", "unknown post-training data kind 'ppo' (one of sft, dpo, rl)")
    _refused(tmp_path / "nope.jsonl", "rl", "nope.jsonl: cannot read the rl data (No such file or directory)")
    _refused(tmp_path, "rl", f"{tmp_path}: cannot read the rl data (Is a directory)")


def test_a_file_over_the_size_bound_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:  # sparse: nothing is written but the size
        f.truncate(data.MAX_FILE_BYTES + 1)
    _refused(path, "sft", f"{path}: {data.MAX_FILE_BYTES + 1} bytes, more than the {data.MAX_FILE_BYTES}")


def test_a_line_over_the_length_bound_is_refused(tmp_path: Path) -> None:
    fits = '{"prompt": "a", "response": "b"}'
    fits += " " * (data.MAX_LINE_BYTES - len(fits))  # whitespace after the object is JSON
    assert len(fits) == data.MAX_LINE_BYTES
    assert len(read_examples(_file(tmp_path, fits), "sft", utf8_length, SEQ)) == 1
    for tail in (" \n", " "):  # one byte more, with its newline or at the end of the file
        path = tmp_path / "long.jsonl"
        path.write_bytes(b'{"prompt": "a", "response": "b"}\n' + (fits + tail).encode())
        _refused(path, "sft", f"{path}:2: line longer than {data.MAX_LINE_BYTES} bytes")


def test_a_file_of_too_many_examples_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "MAX_EXAMPLES", 3)
    line = '{"prompt": "a"}'
    assert len(read_examples(_file(tmp_path, line, line, "", line), "rl", utf8_length, SEQ)) == 3
    _refused(_file(tmp_path, line, line, line, "", line), "rl", ":5: more than 3 examples")


def test_mangled_files_are_read_or_refused_in_one_line(tmp_path: Path) -> None:
    """Valid lines with bytes flipped, cut or doubled: each file reads or is one PostTrainDataError, never another
    exception."""
    rng = np.random.default_rng(0)
    good = b"\n".join(
        json.dumps({"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}).encode() for i in range(8)
    )
    outcomes = {"read": 0, "refused": 0}
    for trial in range(300):
        raw = bytearray(good)
        for _ in range(int(rng.integers(1, 6))):
            at = int(rng.integers(0, len(raw)))
            how = int(rng.integers(0, 3))
            if how == 0:
                raw[at] = int(rng.integers(0, 256))
            elif how == 1:
                del raw[at : at + int(rng.integers(1, 8))]
            else:
                raw[at:at] = raw[at : at + int(rng.integers(1, 8))]
        path = tmp_path / f"mangled-{trial}.jsonl"
        path.write_bytes(bytes(raw))
        try:
            read_examples(path, "dpo", utf8_length, SEQ)
            outcomes["read"] += 1
        except PostTrainDataError as err:
            assert "\n" not in str(err) and str(err).startswith(f"{path}:")
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100


def test_a_file_s_heldout_prompts_are_never_trained_on(tmp_path: Path) -> None:
    """The last workload.heldout_examples examples are held out, and every earlier example with one of their prompts
    leaves training (diloco/run/posttrain.py, `split_by_prompt`); a file whose every example shares a held-out
    prompt leaves none to train on, one line."""
    from diloco.config import ConfigError, load_config
    from diloco.run.posttrain import PostTraining, split_by_prompt
    from islands.workloads.config import IslandWorkload
    from tests.conftest import TINY_TOML, write_corpus

    rows = [("1+1=", "2"), ("2+2=", "4"), ("1+1=", "two"), ("3+3=", "6"), ("2+2=", "four"), ("1+1=", "2!")]
    examples = [SftExample(p, r) for p, r in rows]
    train, held = split_by_prompt(examples, 2)
    assert held == examples[4:] and train == [examples[3]]  # "1+1=" and "2+2=" are held out, every example of them
    assert split_by_prompt(examples, 0) == (examples, [])
    assert split_by_prompt(examples, 9) == ([], examples)

    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML.format(corpus=write_corpus(tmp_path / "corpus.txt")))
    path = _file(tmp_path, *(json.dumps({"prompt": p, "response": r}) for p, r in rows))

    def split(heldout: int) -> tuple[set[str], set[str]]:
        keys = ["workload.kind=sft", f"workload.path={path}", f"workload.heldout_examples={heldout}"]
        post = PostTraining(load_config(config, [*keys, "workload.max_new_tokens=8"]), None)
        loaded = post.examples(IslandWorkload("sft", str(path)))
        return {e.prompt for e in loaded.train}, {e.prompt for e in loaded.heldout}

    assert split(2) == ({"3+3="}, {"1+1=", "2+2="})
    with pytest.raises(ConfigError, match="held out with every example that shares their prompts: none is left"):
        split(3)
