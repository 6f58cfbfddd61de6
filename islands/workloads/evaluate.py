"""The global model's held-out evaluation under each post-training workload a run trains.

    sft   sft_ce: the held-out responses' mean cross-entropy (the sft loss, `losses.sft_loss`); sft_exact_match: the
          share of held-out prompts whose greedy answer is right
    dpo   dpo_loss: DPO's loss on held-out pairs against the reference (log 2 where θ is the reference);
          dpo_accuracy: the share of pairs whose margin over the reference (`losses.dpo_margin`) is > 0;
          dpo_exact_match: greedy answers to the pairs' prompts
    rl    rl_reward: the mean reward of the greedy answers to held-out prompts; rl_exact_match where a judge exists

A greedy answer (`islands.sampling.generate` at temperature 0, up to workload.max_new_tokens, cut at the stop) is
right when the judge says so: a built-in task's reward is 1, or (examples from a file) it equals the reference answer.
The reference's scores of the held-out pairs are computed once, when the evaluation is built: the reference is frozen.
Every figure is a mean over the held-out examples, computed in chunks of `rows` rows so that evaluation needs no more
memory than a training pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from islands.models.base import Params
from islands.models.config import ModelConfig
from islands.sampling import generate, token_logprobs
from islands.workloads.batches import Table
from islands.workloads.losses import dpo_loss, dpo_margin, sequence_logprob
from islands.workloads.rollouts import Scorer, answer_texts
from islands.workloads.text import AnswerText

Judge = Callable[[Sequence[str], Sequence[str]], np.ndarray]
"""(prompts, answers) -> bool [N]: whether each answer is right."""


@dataclass(frozen=True)
class HeldOut:
    """One workload kind's held-out examples."""

    kind: str
    prompts: Table
    """{prompt, prompt_len}: what the greedy answers continue (`batches.prompt_table`)."""
    texts: tuple[str, ...]
    """The same prompts as text."""
    judge: Judge | None
    """Exact match of an answer (None: no reference to compare with, as for rl prompts without answers)."""
    sequences: Table | None = None
    """sft: {tokens, mask}; dpo: the pair table with the reference's scores {ref_chosen, ref_rejected}."""
    scorer: Scorer | None = None
    """rl: the reward."""


@functools.partial(jax.jit, static_argnums=1)
def _token_losses(params: Params, model_cfg: ModelConfig, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """(Σ -logp over the mask, Σ mask) of a chunk."""
    lp = token_logprobs(params, model_cfg, tokens)
    return jnp.stack([-jnp.sum(lp * mask), jnp.sum(mask)])


@functools.partial(jax.jit, static_argnums=1)
def _answer_logprobs(params: Params, model_cfg: ModelConfig, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    return sequence_logprob(token_logprobs(params, model_cfg, tokens), mask)


def answer_logprobs(params: Params, model_cfg: ModelConfig, tokens: np.ndarray, mask: np.ndarray, rows: int
                    ) -> np.ndarray:  # fmt: skip
    """Each row's answer log-probability under `params` (float32 [N]), `rows` rows at a time: the reference's scores
    of DPO pairs (islands/workloads/batches.py's tables), and the policy's in evaluation."""
    parts = [
        _answer_logprobs(params, model_cfg, tokens[i : i + rows], mask[i : i + rows])
        for i in range(0, len(tokens), rows)
    ]
    return np.concatenate(jax.device_get(parts)).astype(np.float32)


def greedy_answers(
    params: Params, model_cfg: ModelConfig, prompts: Table, codec: AnswerText, max_new_tokens: int, rows: int
) -> list[str]:
    """The greedy answer text to every prompt (cut at the stop token)."""
    texts: list[str] = []
    for i in range(0, len(prompts["prompt"]), rows):
        new, lengths = generate(
            params,
            model_cfg,
            prompts["prompt"][i : i + rows],
            prompts["prompt_len"][i : i + rows],
            key=jax.random.key(0),
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            stop_token=codec.stop,
        )
        texts.extend(answer_texts(codec, *jax.device_get((new, lengths))))
    return texts


class WorkloadEval:
    """The held-out figures of every post-training kind a run trains, for one θ (module docstring)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        held: Sequence[HeldOut],
        codec: AnswerText,
        *,
        max_new_tokens: int,
        rows: int,
        beta: float,
        view: Callable[[Params], Params] | None = None,
    ) -> None:
        """`rows`: examples per program call; `beta`: DPO's β (workload.beta) for dpo_loss; `view`: what turns the
        θ evaluated into the model's parameters (workload.lora: the adapters merged into their base)."""
        self.model_cfg, self.held, self.codec, self.view = model_cfg, list(held), codec, view
        self.max_new_tokens, self.rows, self.beta = max_new_tokens, rows, beta

    def __call__(self, params: Params) -> dict[str, float]:
        """Every figure, named `KIND_FIGURE` (sft_ce, dpo_accuracy, rl_reward, ...)."""
        out: dict[str, float] = {}
        params = params if self.view is None else self.view(params)
        for held in self.held:
            out.update(self._figures(params, held))
        return out

    def _figures(self, params: Params, held: HeldOut) -> dict[str, float]:
        out: dict[str, float] = {}
        seqs = held.sequences
        if held.kind == "sft" and seqs is not None:
            sums = sum(
                np.asarray(
                    _token_losses(
                        params, self.model_cfg, seqs["tokens"][i : i + self.rows], seqs["mask"][i : i + self.rows]
                    )
                )  # fmt: skip
                for i in range(0, len(seqs["tokens"]), self.rows)
            )
            out["sft_ce"] = float(sums[0] / max(sums[1], 1.0))
        if held.kind == "dpo" and seqs is not None:
            margin = dpo_margin(
                answer_logprobs(params, self.model_cfg, seqs["chosen"], seqs["chosen_mask"], self.rows),
                answer_logprobs(params, self.model_cfg, seqs["rejected"], seqs["rejected_mask"], self.rows),
                seqs["ref_chosen"],
                seqs["ref_rejected"],
            )
            out["dpo_loss"] = float(dpo_loss(jnp.asarray(margin), self.beta))
            out["dpo_accuracy"] = float(np.mean(margin > 0))
        if held.judge is None and held.scorer is None:
            return out
        answers = greedy_answers(params, self.model_cfg, held.prompts, self.codec, self.max_new_tokens, self.rows)
        if held.judge is not None:
            out[f"{held.kind}_exact_match"] = float(np.mean(held.judge(held.texts, answers)))
        if held.scorer is not None:
            out[f"{held.kind}_reward"] = float(np.mean(held.scorer(held.texts, answers)))
        return out


PRIMARY: dict[str, tuple[str, float]] = {"sft": ("sft_ce", 1.0), "dpo": ("dpo_loss", 1.0), "rl": ("rl_reward", -1.0)}
"""A kind -> (its figure, its sign) making the run's eval loss when it is workload.kind: lower is better."""


def primary_loss(kind: str, figures: dict[str, float]) -> float:
    """The eval loss of a run whose workload.kind is `kind`: sft's cross-entropy, dpo's loss, rl's negated mean
    reward."""
    name, sign = PRIMARY[kind]
    return sign * figures[name]
