"""Conversation data through a checkpoint's chat template (islands/chat.py, islands/posttrain/data.py): rendering as
transformers renders, the loss on the assistant's turns only, EOS as the stop token, one line for a template that
fails."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from islands.chat import ChatError, ChatTemplate
from islands.posttrain.data import ChatSft, PostTrainDataError, PreferencePair, RlPrompt, read_examples
from islands.text import TokenizerText
from islands.workloads.batches import chat_row
from islands.workloads.text import with_stop
from tests.conftest import TINY_TOML, fails
from tests.tiny_tokenizer import CHATML, write_tokenizer

pytestmark = pytest.mark.timeout(60)

SPECIAL = {"bos_token": "<s>", "eos_token": "<|im_end|>"}
TALK = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "two plus two?"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "and one more?"},
    {"role": "assistant", "content": "five"},
]


@pytest.fixture
def tokenizer(tmp_path: Path) -> TokenizerText:
    return TokenizerText(write_tokenizer(tmp_path / "tok"), 300, "test")


def chat() -> ChatTemplate:
    return ChatTemplate(CHATML, SPECIAL, "tokenizer_config.json")


def test_renders_as_apply_chat_template_does() -> None:
    t = chat()
    assert t.render(TALK[:2], True, "x") == (
        "<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\ntwo plus two?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.render(TALK[:3], False, "x").endswith("<|im_start|>assistant\nfour<|im_end|>\n")
    with pytest.raises(ChatError, match="data.jsonl:3: the chat template of tokenizer_config.json fails to render "
                                        r"\(unknown role tool\)"):  # fmt: skip
        t.render([{"role": "tool", "content": "x"}], False, "data.jsonl:3")
    marked = ChatTemplate("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}",
                          SPECIAL, "c")  # fmt: skip
    assert marked.render(TALK[:2], False, "x") == "be brieftwo plus two?"
    assert ChatTemplate("{{ strftime_now('%Y') }}", SPECIAL, "c").render([], False, "x") == "2026"


def test_the_loss_is_on_the_assistant_turns_and_their_eos_only(tokenizer: TokenizerText) -> None:
    text, spans = chat().assistant_spans(TALK, "x")
    assert [text[a:b] for a, b in spans] == ["four<|im_end|>", "five<|im_end|>"]
    codec = with_stop(tokenizer)
    tokens, mask = chat_row(codec, text, spans, 96)
    targets = tokens[1:][mask == 1]
    eos = tokenizer.eos
    assert codec.stop == eos
    assert tokenizer.decode(targets.tolist()) == "four<|im_end|>five<|im_end|>"
    assert int(mask.sum()) == len(targets) and (targets == eos).sum() == 2
    ids = tokenizer.encode(text)
    assert tokens[: len(ids)].tolist() == ids and not tokens[len(ids) :].any()


def write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_trl_layouts_are_read(tmp_path: Path, tokenizer: TokenizerText) -> None:
    t = chat()
    count = lambda s: len(tokenizer.encode(s))  # noqa: E731
    (sft,) = read_examples(write(tmp_path / "s.jsonl", [{"messages": TALK}]), "sft", count, 128, t)
    assert isinstance(sft, ChatSft) and sft.response == "five" and sft.prompt.endswith("<|im_start|>assistant\n")
    prompt, good, bad = TALK[:2], [{"role": "assistant", "content": "four"}], [{"role": "assistant", "content": "3"}]
    explicit = {"prompt": prompt, "chosen": good, "rejected": bad}
    implicit = {"chosen": prompt + good, "rejected": prompt + bad}
    pairs = read_examples(write(tmp_path / "d.jsonl", [explicit, implicit]), "dpo", count, 128, t)
    assert pairs[0] == pairs[1] == PreferencePair(t.prompt(prompt, "x"), "four", "3")
    (rl,) = read_examples(write(tmp_path / "r.jsonl", [{"prompt": prompt, "answer": "4"}]), "rl", count, 128, t)
    assert rl == RlPrompt(t.prompt(prompt, "x"), "4")


@pytest.mark.parametrize(
    ("record", "template", "message"),
    [
        ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}, CHATML,
         "c.jsonl:1: the chat template of tokenizer_config.json fails to render (unknown role tool)"),
        ({"messages": [{"role": "user", "content": 3}]}, CHATML, "c.jsonl:1: messages message 1 needs a string 'content'"),
        ({"messages": TALK[:2]}, CHATML, "c.jsonl:1: the last message must be the assistant's"),
        ({"messages": TALK}, None, "c.jsonl:1: a conversation, and the run's tokenizer has no chat template"),
        ({"messages": TALK}, "{{ messages[9]['content'].upper() }}", "c.jsonl:1: the chat template of"),
    ],
)  # fmt: skip
def test_a_conversation_that_does_not_render_is_one_line(
    tmp_path: Path, record: object, template: str | None, message: str
) -> None:
    t = None if template is None else ChatTemplate(template, SPECIAL, "tokenizer_config.json")
    with pytest.raises(PostTrainDataError) as err:
        read_examples(write(tmp_path / "c.jsonl", [record]), "sft", lambda s: len(s), 4096, t)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_template_that_is_not_jinja_names_its_file() -> None:
    with pytest.raises(ChatError, match=r"tokenizer_config.json: the chat template is not Jinja \(line 1"):
        ChatTemplate("{% for m in messages %}", SPECIAL, "tokenizer_config.json")


@pytest.mark.slow
def test_sft_on_conversations_trains_in_simulate_and_a_bad_line_is_one_line(
    tmp_path: Path, tokenizer: TokenizerText, capsys: pytest.CaptureFixture[str]
) -> None:
    from diloco.cli import main

    corpus = write(tmp_path / "corpus.jsonl", [{"text": "the island trains a model " * 4}] * 40)
    talks = [[{"role": "user", "content": f"{a} plus {a}?"}, {"role": "assistant", "content": f"{2 * a}"}]
             for a in range(24)]  # fmt: skip
    bad = {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY_TOML.format(corpus="unused"))
    run_dir = tmp_path / "run"
    args = ["simulate", str(cfg), "data.kind=jsonl", f"data.path={corpus}", f"data.tokenizer={tokenizer.path}",
            f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=300", "model.seq_len=64", "workload.kind=sft",
            "workload.heldout_examples=4", "train.rounds=2", "train.checkpoint_every=0", "--run-dir", str(run_dir),
            "--no-progress"]  # fmt: skip
    data = write(tmp_path / "chat.jsonl", [{"messages": t} for t in talks[:3]] + [bad])
    fails(capsys, [*args, f"workload.path={data}"], f"{data}:4: the chat template of {tokenizer.path.parent}")
    data = write(tmp_path / "chat.jsonl", [{"messages": t} for t in talks])
    assert main([*args, f"workload.path={data}"]) == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["final_scores"]["sft_ce"] < summary["initial_scores"]["sft_ce"]


def test_sampling_and_answers_stop_at_the_tokenizers_eos(tokenizer: TokenizerText) -> None:
    assert tokenizer.special_id("bos_token") == 0 and tokenizer.eos == 2
    assert with_stop(tokenizer).stop == 2
    no_config = TokenizerText.__new__(TokenizerText)  # a prepared corpus's tokenizer: no tokenizer_config.json
    (tokenizer.path.parent / "tokenizer_config.json").unlink()
    no_config.__init__(tokenizer.path, 300, "test")  # type: ignore[misc]
    assert no_config.eos is None and with_stop(no_config).stop == tokenizer.encode("\n")[0]
    assert np.array_equal(with_stop(no_config).encode("ab"), tokenizer.encode("ab"))
