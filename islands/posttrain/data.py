"""Post-training data as JSON Lines: prompt and response pairs (SFT), preference pairs (DPO), prompts (RL).

One example per line: a JSON object with exactly these fields, each a non-empty string (UTF-8):

    sft   {"prompt": "37+485=", "response": "522"}
    dpo   {"prompt": "37+485=", "chosen": "522", "rejected": "512"}
    rl    {"prompt": "37+485=", "answer": "522"}        answer may be left out (or null)

Conversations, TRL's conversational layouts, where the run's tokenizer has a chat template (islands/chat.py):

    sft   {"messages": [{"role": "user", "content": "37+485="}, {"role": "assistant", "content": "522"}, ...]}
    dpo   {"prompt": [MESSAGE, ...], "chosen": [MESSAGE, ...], "rejected": [MESSAGE, ...]}
          {"chosen": [MESSAGE, ...], "rejected": [MESSAGE, ...]}    the prompt is the messages they share
    rl    {"prompt": [MESSAGE, ...], "answer": "522"}               answer may be left out (or null)

A MESSAGE is an object with a string "role" and a string "content" (other fields go to the template as they are). A
conversation is rendered once, here: an sft example's loss is on every assistant turn (`ChatSft`'s spans), its last
assistant message the reference a held-out greedy answer is compared with; a dpo or rl prompt is its messages rendered
with the generation prompt, and a chosen or rejected reply the text the template gives it up to its eos_token, which
the stop token (the tokenizer's EOS) then stands for. A template that fails to render is one line naming FILE:LINE.

The prompt is the text the model continues. A response, a chosen or a rejected text is what follows the prompt,
without the stop token: the tokenizer appends one, so that the model learns to end its answer. An RL prompt's answer
is a reference a reward function may use (a verifier compares against it); the model writes its own. Blank lines are
skipped; `diloco data task` writes files of each kind to start from (islands/posttrain/task.py).

`read_examples` refuses, each with one line "FILE:LINE: ..." naming the field: a line that is not JSON or not an
object; a field that is missing, unknown (a typo must not pass silently), repeated, not a string or empty (blank);
chosen equal to rejected; an example that does not fit the model's context (prompt + its longest answer + 1 stop
token > max_tokens, model.seq_len, each text counted on its own with the run's `count_tokens`, as it is tokenized);
and a file without examples. Every byte of the file is untrusted: a file larger than MAX_FILE_BYTES is refused
before it is read, lines are read one at a time and none may be longer than MAX_LINE_BYTES, nor the file hold more
than MAX_EXAMPLES examples, so a hostile file cannot make the reader hold more than about MAX_FILE_BYTES of text.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, BinaryIO

from floor.errors import UserError
from floor.files import write_atomically
from islands.chat import ChatError, ChatTemplate, Message

MAX_FILE_BYTES = 1 << 28
"""256 MiB: the largest post-training file read (a million examples of 256 bytes)."""

MAX_LINE_BYTES = 1 << 20
"""1 MiB: the longest line read (its newline not counted); far beyond any example a model's context holds."""

MAX_EXAMPLES = 1 << 20
"""The most examples one file may hold (each is a few Python objects besides its text)."""

STOP_TOKENS = 1
"""Tokens the tokenizer appends after each answer: its stop token."""

SHOWN_CHARS = 40
"""The most characters of a value or a field name that an error message shows."""


@dataclass(frozen=True)
class SftExample:
    """A prompt and the response to learn (the loss is on the response)."""

    prompt: str
    response: str


@dataclass(frozen=True)
class PreferencePair:
    """A prompt, a preferred answer and a worse one (DPO)."""

    prompt: str
    chosen: str
    rejected: str


@dataclass(frozen=True)
class RlPrompt:
    """A prompt the policy answers; `answer` is a reference a reward may compare with (None: the reward needs
    none)."""

    prompt: str
    answer: str | None = None


@dataclass(frozen=True)
class ChatSft(SftExample):
    """A conversation to learn: its rendering and the character spans of its assistant turns (the loss is on those).
    prompt and response are its last assistant turn's prompt (rendered with the generation prompt) and content."""

    text: str = ""
    spans: tuple[tuple[int, int], ...] = ()


Example = SftExample | PreferencePair | RlPrompt

KINDS: dict[str, type[SftExample] | type[PreferencePair] | type[RlPrompt]] = {
    "sft": SftExample,
    "dpo": PreferencePair,
    "rl": RlPrompt,
}
"""A kind of data -> the example its lines hold (its fields are the line's fields; one with a default is optional)."""


class PostTrainDataError(UserError, ValueError):
    """A post-training data file that cannot be used; one line, "FILE:LINE: ..." naming the field."""


class _RepeatedField(ValueError):
    """A JSON object that names a field twice (json.loads would keep the last one silently)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _clip(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _shown(value: object) -> str:
    """A JSON value as a user wrote it, cut short."""
    return _clip(json.dumps(value, ensure_ascii=False))


def _object_without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            raise _RepeatedField(name)
        seen[name] = value
    return seen


def _json_type(value: object) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def utf8_length(text: str) -> int:
    """Tokens of text for a byte-level model (vocab 256): its UTF-8 bytes."""
    return len(text.encode("utf-8"))


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_object_without_repeats)
    except _RepeatedField as err:
        raise PostTrainDataError(f"{where}: field {_clip(err.name)!r} appears twice") from None
    except json.JSONDecodeError as err:
        raise PostTrainDataError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
    except ValueError as err:  # a number too long for int(); the message says which limit
        raise PostTrainDataError(f"{where}: not JSON we read ({_clip(str(err))})") from None
    except RecursionError:
        raise PostTrainDataError(f"{where}: not JSON we read (arrays or objects nested too deep)") from None


def _messages(value: object, name: str, where: str) -> list[Message]:
    """A field that holds a conversation: a non-empty array of {"role": str, "content": str, ...}."""
    if not isinstance(value, list) or not value:
        raise PostTrainDataError(f"{where}: field {name!r} must be a non-empty array of messages (got {_shown(value)})")
    for i, message in enumerate(value, 1):
        if not isinstance(message, dict):
            raise PostTrainDataError(f"{where}: {name} message {i} is not an object (got {_json_type(message)})")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise PostTrainDataError(
                    f"{where}: {name} message {i} needs a string {key!r} (got {_shown(message.get(key))})"
                )
    return value


def _conversational(record: object) -> bool:
    """Whether a record is in a conversational layout (a message array where the plain one has a string)."""
    if not isinstance(record, dict):
        return False
    return "messages" in record or any(isinstance(record.get(k), list) for k in ("prompt", "chosen", "rejected"))


def _chat_example(record: dict[str, Any], kind: str, chat: ChatTemplate | None, where: str) -> Example:
    """The example a conversational record holds, rendered through the chat template."""
    if chat is None:
        raise PostTrainDataError(
            f"{where}: a conversation, and the run's tokenizer has no chat template (tokenizer_config.json's "
            "chat_template) to render it"
        )
    fields = {"sft": ("messages",), "dpo": ("prompt", "chosen", "rejected"), "rl": ("prompt", "answer")}[kind]
    for name in record:
        if name not in fields:
            raise PostTrainDataError(
                f"{where}: unknown field {_clip(name)!r} ({kind} conversations have {', '.join(fields)})"
            )
    try:
        if kind == "sft":
            messages = _messages(record.get("messages"), "messages", where)
            if messages[-1]["role"] != "assistant":
                raise PostTrainDataError(f"{where}: the last message must be the assistant's (the reply to learn)")
            text, spans = chat.assistant_spans(messages, where)
            return ChatSft(chat.prompt(messages[:-1], where), messages[-1]["content"], text, tuple(spans))
        if kind == "rl":
            answer = record.get("answer")
            if answer is not None and not (isinstance(answer, str) and answer.strip()):
                raise PostTrainDataError(f"{where}: field 'answer' must be a non-empty string (got {_shown(answer)})")
            return RlPrompt(chat.prompt(_messages(record.get("prompt"), "prompt", where), where), answer)
        chosen = _messages(record.get("chosen"), "chosen", where)
        rejected = _messages(record.get("rejected"), "rejected", where)
        if "prompt" in record:
            prompt = _messages(record["prompt"], "prompt", where)
        else:  # TRL's implicit prompt: the messages both conversations start with
            n = 0
            while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
                n += 1
            if n == 0:
                raise PostTrainDataError(
                    f"{where}: 'chosen' and 'rejected' share no prompt messages (or give 'prompt')"
                )
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        pair = PreferencePair(chat.prompt(prompt, where), chat.reply(prompt, chosen, where),
                              chat.reply(prompt, rejected, where))  # fmt: skip
    except ChatError as err:
        raise PostTrainDataError(str(err)) from None
    if pair.chosen == pair.rejected:
        raise PostTrainDataError(f"{where}: fields 'chosen' and 'rejected' are the same conversation")
    return pair


def _example(record: object, kind: str, where: str, chat: ChatTemplate | None = None) -> Example:
    """The example a parsed line holds, every field checked."""
    if _conversational(record):
        return _chat_example(record, kind, chat, where)  # type: ignore[arg-type]
    cls = KINDS[kind]
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    if not isinstance(record, dict):
        shape = ", ".join(f'"{name}": ...' for name in names)
        raise PostTrainDataError(
            f"{where}: not a JSON object ({kind} examples are {{{shape}}}; got {_json_type(record)})"
        )
    for name in record:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise PostTrainDataError(
                f"{where}: unknown field {_clip(name)!r} ({hint}{kind} examples have {', '.join(names)})"
            )
    values: dict[str, str] = {}
    for field in fields:
        optional = field.default is None
        if field.name not in record:
            if optional:
                continue
            raise PostTrainDataError(f"{where}: missing field {field.name!r}")
        value = record[field.name]
        if value is None and optional:
            continue
        if not isinstance(value, str):
            raise PostTrainDataError(f"{where}: field {field.name!r} must be a string (got {_shown(value)})")
        if not value.strip():
            raise PostTrainDataError(f"{where}: field {field.name!r} is empty")
        values[field.name] = value
    if kind == "dpo" and values["chosen"].strip() == values["rejected"].strip():
        raise PostTrainDataError(f"{where}: fields 'chosen' and 'rejected' are the same text")
    return cls(**values)


def _check_fits(example: Example, count_tokens: Callable[[str], int], max_tokens: int, where: str) -> None:
    """Refuse an example whose prompt, longest answer and stop token together exceed max_tokens (a conversation: its
    rendering)."""
    if isinstance(example, ChatSft):
        total = count_tokens(example.text)
        if total > max_tokens:
            raise PostTrainDataError(
                f"{where}: too long for the model: the conversation renders to {total} tokens > model.seq_len "
                f"({max_tokens})"
            )
        return
    prompt = count_tokens(example.prompt)
    answers = {
        f.name: count_tokens(getattr(example, f.name))
        for f in dataclasses.fields(example)
        if f.name != "prompt" and getattr(example, f.name) is not None
    }
    longest = max(answers, key=lambda name: answers[name], default=None)
    total = prompt + (answers[longest] if longest else 0) + STOP_TOKENS
    if total > max_tokens:
        parts = f"prompt {prompt} + {longest} {answers[longest]}" if longest else f"prompt {prompt}"
        raise PostTrainDataError(
            f"{where}: too long for the model: {parts} + {STOP_TOKENS} stop token = {total} tokens "
            f"> model.seq_len ({max_tokens})"
        )


def _lines(f: BinaryIO, path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line, each read whole only when within MAX_LINE_BYTES and the file within
    MAX_FILE_BYTES."""
    read = 0
    for number in count(1):
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        read += len(line)
        if read > MAX_FILE_BYTES:  # a file that grows while it is read, or a device
            raise PostTrainDataError(f"{path}: more than {MAX_FILE_BYTES} bytes (the most a post-training file holds)")
        body = line[:-1] if line.endswith(b"\n") else line
        if len(body) > MAX_LINE_BYTES:
            raise PostTrainDataError(
                f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes (the longest a post-training line may be)"
            )
        try:
            yield number, body.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as err:
            raise PostTrainDataError(f"{path}:{number}: not UTF-8 text (byte {err.start + 1} of the line)") from None


def read_examples(
    path: Path, kind: str, count_tokens: Callable[[str], int], max_tokens: int, chat: ChatTemplate | None = None
) -> list[SftExample] | list[PreferencePair] | list[RlPrompt]:
    """The examples of a JSON Lines file of this kind ("sft", "dpo" or "rl"), in file order, every line checked as
    the module docstring says. count_tokens gives a text's tokens as the run tokenizes it (`utf8_length` for a
    byte-level model); max_tokens is what one sequence holds (model.seq_len); chat renders conversations (None: the
    run's tokenizer has no chat template, and a conversation is refused)."""
    if kind not in KINDS:
        raise PostTrainDataError(f"unknown post-training data kind {kind!r} (one of {', '.join(KINDS)})")
    path = Path(path)
    try:
        f = path.open("rb")
    except OSError as err:
        raise PostTrainDataError(f"{path}: cannot read the {kind} data ({err.strerror or err})") from None
    examples: list[Example] = []
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_FILE_BYTES:
            raise PostTrainDataError(f"{path}: {size} bytes, more than the {MAX_FILE_BYTES} a post-training file holds")
        for number, text in _lines(f, path):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            if len(examples) == MAX_EXAMPLES:
                raise PostTrainDataError(f"{where}: more than {MAX_EXAMPLES} examples (the most one file holds)")
            example = _example(_parse(text, where), kind, where, chat)
            _check_fits(example, count_tokens, max_tokens, where)
            examples.append(example)
    if not examples:
        raise PostTrainDataError(f"{path}: no {kind} examples (the file is empty or blank)")
    return examples  # type: ignore[return-value]


def write_examples(path: Path, examples: Sequence[Example]) -> None:
    """Write examples as JSON Lines that `read_examples` reads back equal (an absent RL answer is left out), whole
    or not at all."""
    lines = []
    for example in examples:
        record = {k: v for k, v in dataclasses.asdict(example).items() if v is not None}
        lines.append(json.dumps(record) + "\n")  # non-ASCII escaped: the file is the same in every locale
    write_atomically(Path(path), "".join(lines))
