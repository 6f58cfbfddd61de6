"""A run's text for post-training: its token ids as `islands.text` reads them (the run's tokenizer, `tokenizer_file`:
data.tokenizer, a checkpoint's by default, or the one `diloco data prepare` wrote beside a token corpus; else UTF-8
bytes), and the stop token that ends every answer.

Every answer ends with a stop token, so that a model learns where its answer ends and generation knows where to cut:
the tokenizer's end-of-sequence id where its tokenizer_config.json names one (a Hugging Face checkpoint's eos_token),
else the id of a newline (byte 10 for byte-level runs; the tokenizer's one token for "\\n" otherwise, which a
tokenizer that splits it refuses in one line). A prompt or an answer holding a newline itself is fine for training;
an answer is read back up to its first stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from islands.data import DataConfig, DataError
from islands.text import ByteText, TextCodec, TokenizerText, text_codec

STOP_TEXT = "\n"
"""What the stop token stands for."""


@dataclass(frozen=True)
class AnswerText:
    """The run's text codec, its stop token and the id that pads a row (never a target: any id would do; the
    tokenizer's pad_token where it names one, for rows that read as the checkpoint's own)."""

    codec: TextCodec
    stop: int
    pad: int = 0

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)


def answer_text(data: DataConfig, vocab_size: int) -> AnswerText:
    """How this run's post-training turns text into tokens, with its stop token."""
    return with_stop(text_codec(data, vocab_size, "post-training ([workload])"))


def with_stop(codec: TextCodec) -> AnswerText:
    """`codec` with its stop token: the tokenizer's EOS when it has one, else the id of a newline (a codec that makes
    more than one token of it is refused)."""
    if isinstance(codec, TokenizerText) and codec.eos is not None:
        return AnswerText(codec, codec.eos, codec.special_id("pad_token") or 0)
    stop = codec.encode(STOP_TEXT)
    if len(stop) != 1:
        raise DataError(f"the run's tokenizer makes {len(stop)} tokens of a newline; answers need one stop token")
    return AnswerText(codec, stop[0])


def byte_text(vocab_size: int = 256) -> AnswerText:
    """A byte-level run's: UTF-8 bytes, a newline (10) the stop."""
    return with_stop(ByteText(vocab_size))
