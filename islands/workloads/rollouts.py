"""rl's batches: answers sampled from the island's current policy, scored, and turned into a GRPO batch.

Batch k (`Rollouts.next_for(θ)`, an `islands.island.PolicyBatches`):

    prompts     batch_size / group_size prompts of the island's share, drawn for (seed, island, k) as every stream
                draws its rows, each repeated group_size times
    answers     `islands.sampling.generate` from θ (workload.temperature, top_p, max_new_tokens, the stop token), its
                key folded from (seed, island, k): a pure function of θ and k, so an island resumed at cursor k
                with the same θ samples the same answers, and `simulate` and an island process agree bit for bit
    rewards     the reward function of (prompt, answer text up to the stop), on the host (islands/posttrain/rewards.py:
                a reward that raises or is not a finite number is one line naming the prompt)
    advantages  standardized within each group (`losses.group_advantages`)
    reference   the frozen reference's log-probabilities of the same rows at workload.temperature, the
                distribution they were drawn from (`losses.sampled_logprobs`; the KL penalty's other side)

θ is read by the generation and the reference's forward before the step that donates it runs: the answers are
fetched to the host for their rewards, which waits for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from islands.models.base import Params
from islands.models.config import ModelConfig
from islands.sampling import generate
from islands.workloads.batches import Table, answer_rows, rows_of
from islands.workloads.config import WorkloadConfig
from islands.workloads.losses import group_advantages, sampled_logprobs
from islands.workloads.text import AnswerText

Scorer = Callable[[Sequence[str], Sequence[str]], np.ndarray]
"""(prompts, answers) -> float32 rewards, one per answer."""


def answer_texts(codec: AnswerText, new: np.ndarray, lengths: np.ndarray) -> list[str]:
    """Each generated row's answer text: its tokens up to, not including, the stop token."""
    texts = []
    for row, n in zip(new, lengths, strict=True):
        ids = [int(t) for t in row[: int(n)]]
        texts.append(codec.decode(ids[:-1] if ids and ids[-1] == codec.stop else ids))
    return texts


class Rollouts:
    """An rl island's on-policy batches (module docstring)."""

    def __init__(
        self,
        prompts: Table,
        texts: Sequence[str],
        scorer: Scorer,
        codec: AnswerText,
        reference: Params,
        model_cfg: ModelConfig,
        workload: WorkloadConfig,
        batch_size: int,
        seed: int,
        stream_id: int,
        cursor: int = 0,
        view: Callable[[Params], Params] | None = None,
    ) -> None:
        """`prompts`: the island's share as `batches.prompt_table` makes it, `texts` the same prompts as text (what
        the reward reads); `reference`: the frozen θ_ref, on the device the island's steps run on; `view`: what turns
        the trained θ into the model's parameters (workload.lora: the adapters merged into their base)."""
        self.prompts, self.texts, self.scorer, self.codec = prompts, list(texts), scorer, codec
        self.reference, self.model_cfg, self.workload = reference, model_cfg, workload
        self.batch_size, self.seq_len = batch_size, model_cfg.seq_len
        self.seed, self.stream_id, self.cursor = seed, stream_id, cursor
        self.groups = batch_size // workload.group_size
        self.view = view

    def next_for(self, params: Params) -> Table:
        k, g = self.cursor, self.workload.group_size
        rng = np.random.default_rng((self.seed, self.stream_id, k))
        picked = np.repeat(rng.integers(0, len(self.texts), size=self.groups), g)
        prompts = rows_of(self.prompts, picked)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), self.stream_id), k)
        new, lengths = generate(
            params if self.view is None else self.view(params),
            self.model_cfg,
            prompts["prompt"],
            prompts["prompt_len"],
            key=key,
            max_new_tokens=self.workload.max_new_tokens,
            temperature=self.workload.temperature,
            top_p=self.workload.top_p,
            stop_token=self.codec.stop,
        )
        new, lengths = jax.device_get((new, lengths))
        reward = self.scorer([self.texts[i] for i in picked], answer_texts(self.codec, new, lengths))
        tokens, mask = answer_rows(prompts["prompt"], prompts["prompt_len"], new, lengths, self.seq_len + 1)
        scored = sampled_logprobs(self.reference, self.model_cfg, tokens, self.workload.temperature)
        reference = np.asarray(jax.device_get(scored), np.float32)
        self.cursor += 1
        return {
            "tokens": tokens,
            "mask": mask,
            "advantages": group_advantages(reward, g),
            "ref_logprobs": reference,
            "reward": np.asarray(reward, np.float32),
        }

    def next(self) -> Table:
        raise TypeError("rl batches are drawn with the policy: Island.next_host_batch hands it over (next_for)")

    def empty(self) -> Table:
        width = self.seq_len + 1
        return {
            "tokens": np.zeros((0, width), np.int32),
            "mask": np.zeros((0, width - 1), np.float32),
            "advantages": np.zeros(0, np.float32),
            "ref_logprobs": np.zeros((0, width - 1), np.float32),
            "reward": np.zeros(0, np.float32),
        }
