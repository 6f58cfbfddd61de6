"""Conversations rendered through a checkpoint's chat template, as transformers' `apply_chat_template` renders them,
and which characters of a rendering are the assistant's (what the loss is on).

The template is tokenizer_config.json's `chat_template` (islands/text.py), a Jinja template rendered in a sandbox with
transformers' environment: trim_blocks and lstrip_blocks, the loopcontrols extension, the `tojson` filter,
`raise_exception(message)`, and the variables `messages`, `add_generation_prompt` and the special tokens (`bos_token`,
`eos_token`, ...). `strftime_now(format)` renders a fixed day, CHAT_DAY, not the clock's: every island and every
re-run must render the same tokens. `{% generation %}...{% endgeneration %}` markers are accepted and render their
body; the assistant's characters come from rendering prefixes, as TRL's completion-only loss finds a completion:

    turn i (an assistant message) covers render(messages[:i+1])[len(render(messages[:i], add_generation_prompt=True)):]

cut after the first eos_token in it (the turn's end, which a sampler stops at; what follows it, a newline, is the
template's, not the assistant's). A template that renders an earlier turn differently once more messages follow has no
such prefix and is refused in one line, as is any template error, naming the data's file and line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from islands.data import DataError

CHAT_EXTRA = "pip install 'diloco[tokenize]'"
CHAT_DAY = (2026, 1, 1)
"""The day `strftime_now` renders (templates print it in a system prompt)."""

Message = dict[str, Any]
Span = tuple[int, int]


class ChatError(DataError):
    """A conversation the chat template cannot render, or a template that cannot be split into turns."""


def _jinja() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise DataError(f"a chat template needs the jinja2 package, which is not installed: {CHAT_EXTRA}") from None
    return jinja2


def _environment() -> Any:
    jinja2 = _jinja()
    from datetime import date

    class Generation(jinja2.ext.Extension):  # type: ignore[misc, name-defined]
        """`{% generation %}BODY{% endgeneration %}` renders BODY (TRL's assistant markers)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: date(*CHAT_DAY).strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template with its tokenizer's special tokens; renders conversations and finds their
    assistant turns."""

    def __init__(self, source: str, special: Mapping[str, str], where: str) -> None:
        jinja2 = _jinja()
        self.where = where
        self.special = dict(special)
        self.eos = self.special.get("eos_token")
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            message = " ".join(str(err).split())
            raise ChatError(f"{where}: the chat template is not Jinja (line {err.lineno}: {message})") from None
        self._errors = (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool, where: str) -> str:
        """The template's text for `messages`; a ChatError naming `where` (the data's FILE:LINE) when it fails."""
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                **self.special,
            )  # fmt: skip
        except self._errors as err:
            message = " ".join(str(err).split())[:120]
            raise ChatError(f"{where}: the chat template of {self.where} fails to render ({message})") from None

    def prompt(self, messages: Sequence[Message], where: str) -> str:
        """The text a reply to `messages` continues: rendered with the generation prompt."""
        return self.render(messages, True, where)

    def turn(self, messages: Sequence[Message], where: str) -> tuple[str, Span]:
        """(the rendering of messages, the character span of its last message, an assistant turn)."""
        before = self.prompt(messages[:-1], where)
        through = self.render(messages, False, where)
        if not through.startswith(before):
            raise ChatError(
                f"{where}: the chat template renders the conversation before message {len(messages)} differently "
                "once the assistant's reply follows, so the reply cannot be told apart"
            )
        end = len(through)
        if self.eos:
            cut = through.find(self.eos, len(before))
            end = cut + len(self.eos) if cut >= 0 else end
        return through, (len(before), end)

    def assistant_spans(self, messages: Sequence[Message], where: str) -> tuple[str, list[Span]]:
        """(the whole conversation's rendering, the character spans of its assistant turns, in order)."""
        text = self.render(messages, False, where)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            through, span = self.turn(messages[: i + 1], where)
            if not text.startswith(through[: span[1]]):
                raise ChatError(
                    f"{where}: the chat template renders assistant message {i + 1} differently once more messages "
                    "follow, so its turn cannot be told apart"
                )
            spans.append(span)
        return text, spans

    def reply(self, prompt: Sequence[Message], reply: Sequence[Message], where: str) -> str:
        """The text that follows `prompt`'s rendering with the generation prompt when `reply` is appended, up to (not
        including) the first eos_token: an answer whose stop token is the tokenizer's EOS."""
        through, (start, end) = self.turn([*prompt, *reply], where)
        text = through[start:end]
        if self.eos and text.endswith(self.eos):
            return text[: -len(self.eos)]
        raise ChatError(
            f"{where}: the chat template of {self.where} ends the assistant's turn without eos_token {self.eos!r}, "
            "which answers stop at"
        )


def trained_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[bool]:
    """For each token (its character range), whether it starts inside an assistant span."""
    out = []
    for start, end in offsets:
        out.append(any(lo <= start < hi for lo, hi in spans) and end > start)
    return out
