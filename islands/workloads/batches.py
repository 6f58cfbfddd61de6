"""Post-training examples as fixed-shape arrays, and the streams an island draws its batches from.

A sequence is one row of seq_len + 1 tokens (the width of an lm batch's row, so the model sees the same shapes):

    tokens   prompt ids, answer ids, the stop token, then padding (PAD) to the row's end
    mask     over target positions (tokens[1:], what `token_logprobs` scores): 1 where the target is an answer token
             or the stop, 0 over the prompt and the padding

so a prompt of p tokens and an answer of a tokens (stop included) set mask[p-1 : p-1+a]. Every table is a dict of
NumPy arrays with the examples on axis 0 (`sft_table`, `pair_table`); `ExampleStream` draws an island's batches from
its table as `islands.data.BatchStream` draws windows: batch k is a pure function of (seed, island, k), rows drawn
with replacement, so the only state is the cursor k, checkpointed with the island.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from islands.workloads.text import AnswerText

PAD = 0
"""The id of padding (never a target: the mask is 0 there)."""

Table = dict[str, np.ndarray]


def pack(prompt: Sequence[int], answer: Sequence[int], stop: int, width: int, pad: int = PAD
         ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(tokens int32 [width], mask float32 [width - 1]) of prompt + answer + stop, right-padded with `pad`. The caller
    has checked that it fits (islands/posttrain/data.py refuses examples longer than model.seq_len)."""
    ids = [*prompt, *answer, stop]
    if len(ids) > width or not prompt:
        raise ValueError(f"a sequence of {len(ids)} tokens (prompt {len(prompt)}) does not fit a row of {width}")
    tokens = np.full(width, pad, np.int32)
    tokens[: len(ids)] = ids
    mask = np.zeros(width - 1, np.float32)
    mask[len(prompt) - 1 : len(ids) - 1] = 1.0
    return tokens, mask


def chat_row(codec: AnswerText, text: str, spans: Sequence[tuple[int, int]], width: int
             ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(tokens int32 [width], mask float32 [width - 1]) of a rendered conversation, right-padded: the mask is 1 where
    the target token starts inside an assistant span (islands/chat.py). The caller has checked that it fits."""
    from islands.chat import trained_tokens

    ids, offsets = codec.codec.encode_offsets(text)  # type: ignore[attr-defined]
    if len(ids) > width:
        raise ValueError(f"a conversation of {len(ids)} tokens does not fit a row of {width}")
    tokens = np.full(width, codec.pad, np.int32)
    tokens[: len(ids)] = ids
    mask = np.zeros(width - 1, np.float32)
    trained = np.asarray(trained_tokens(offsets, spans), np.float32)
    mask[: len(ids) - 1] = trained[1:]
    return tokens, mask


def _packed(prompts: Sequence[str], answers: Sequence[str], codec: AnswerText, width: int) -> tuple[np.ndarray, ...]:
    rows = [
        pack(codec.encode(p), codec.encode(a), codec.stop, width, codec.pad)
        for p, a in zip(prompts, answers, strict=True)
    ]
    return np.stack([t for t, _ in rows]), np.stack([m for _, m in rows])


def sft_table(prompts: Sequence[str], responses: Sequence[str], codec: AnswerText, seq_len: int) -> Table:
    """{tokens int32 [N, seq_len + 1], mask float32 [N, seq_len]}."""
    tokens, mask = _packed(prompts, responses, codec, seq_len + 1)
    return {"tokens": tokens, "mask": mask}


def pair_table(
    prompts: Sequence[str], chosen: Sequence[str], rejected: Sequence[str], codec: AnswerText, seq_len: int
) -> Table:
    """{chosen, rejected int32 [N, seq_len + 1], chosen_mask, rejected_mask float32 [N, seq_len]}."""
    c, c_mask = _packed(prompts, chosen, codec, seq_len + 1)
    r, r_mask = _packed(prompts, rejected, codec, seq_len + 1)
    return {"chosen": c, "chosen_mask": c_mask, "rejected": r, "rejected_mask": r_mask}


def prompt_table(prompts: Sequence[str], codec: AnswerText, width: int) -> Table:
    """{prompt int32 [N, width] (left-aligned, padded), prompt_len int32 [N]}: what `islands.sampling.generate`
    continues."""
    ids = [codec.encode(p) for p in prompts]
    out = np.full((len(ids), width), codec.pad, np.int32)
    for i, row in enumerate(ids):
        if not 1 <= len(row) <= width:
            raise ValueError(f"prompt {i} has {len(row)} tokens; a prompt row holds 1 to {width}")
        out[i, : len(row)] = row
    return {"prompt": out, "prompt_len": np.array([len(row) for row in ids], np.int32)}


def answer_rows(prompt: np.ndarray, prompt_len: np.ndarray, new: np.ndarray, lengths: np.ndarray, width: int
                ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Generated answers as training rows: (tokens int32 [B, width], mask float32 [B, width - 1]) of each row's
    prompt (its first prompt_len tokens) followed by its first lengths[b] new tokens (the stop, when drawn,
    included), right-padded; the mask covers the new tokens. `generate` keeps prompt + new within the context."""
    b = len(prompt)
    tokens = np.full((b, width), PAD, np.int32)
    mask = np.zeros((b, width - 1), np.float32)
    for i in range(b):
        p, n = int(prompt_len[i]), int(lengths[i])
        tokens[i, :p] = prompt[i, :p]
        tokens[i, p : p + n] = new[i, :n]
        mask[i, p - 1 : p - 1 + n] = 1.0
    return tokens, mask


def rows_of(table: Table, rows: np.ndarray) -> Table:
    """The table's rows `rows`, every column."""
    return {name: column[rows] for name, column in table.items()}


class ExampleStream:
    """An island's batches of examples (an `islands.island.Batches`): batch k is `batch_size` rows of its table drawn
    for (seed, stream_id, k), as BatchStream draws windows, so a resumed island at cursor k neither repeats nor skips
    a batch."""

    def __init__(self, table: Table, batch_size: int, seq_len: int, seed: int, stream_id: int, cursor: int = 0) -> None:
        self.table = table
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.stream_id = stream_id
        self.cursor = cursor
        self.rows = len(next(iter(table.values())))
        if not self.rows:
            raise ValueError("an island's examples are empty")

    def batch_at(self, k: int) -> Table:
        rng = np.random.default_rng((self.seed, self.stream_id, k))
        return rows_of(self.table, rng.integers(0, self.rows, size=self.batch_size))

    def next(self) -> Table:
        batch = self.batch_at(self.cursor)
        self.cursor += 1
        return batch

    def empty(self) -> Table:
        """A batch of no rows: the columns' shapes and dtypes (`islands.island.empty_batch`)."""
        return rows_of(self.table, np.zeros(0, np.int64))
