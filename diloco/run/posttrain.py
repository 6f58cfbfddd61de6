"""The post-training part of what every driver builds (diloco/run/setup.py): each island's examples and stream, its
loss, and the held-out evaluation of the global model (docs/architecture.md, "Workloads").

Examples come from a built-in task (workload.task: train and held-out splits that share no prompt) or a JSON Lines
file (its last workload.heldout_examples examples held out, and no example of their prompts trained on:
`split_by_prompt`). The islands that run one kind on one source deal its training examples among themselves,
island j of m taking examples j, j + m, ...: each island its own share, as each has its own shard of a corpus.
Texts become token ids as the run's data is tokenized (islands/text.py), every answer ending with a stop token
(islands/workloads/text.py).

Every check that a text fits is made here, before anything trains, one line naming the key: an rl prompt or a
held-out prompt too long to leave workload.max_new_tokens of context, a reference answer (and its stop) longer than
workload.max_new_tokens, which a greedy answer could then never match.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from diloco.config import ConfigError, RunConfig
from islands.chat import ChatTemplate
from islands.island import Batches
from islands.models.base import Model
from islands.models.lora import Lora, adapt
from islands.posttrain.accuracy import exact_matches
from islands.posttrain.data import ChatSft, PreferencePair, RlPrompt, SftExample, read_examples
from islands.posttrain.rewards import load_reward, score
from islands.posttrain.task import Task, builtin_task
from islands.text import TokenizerText
from islands.workloads.batches import (
    ExampleStream,
    Table,
    chat_row,
    pack,
    pair_table,
    prompt_table,
    sft_table,
)
from islands.workloads.config import REFERENCE_START, STEP_FIGURES, IslandWorkload
from islands.workloads.evaluate import HeldOut, Judge, WorkloadEval, answer_logprobs
from islands.workloads.losses import WorkloadLoss
from islands.workloads.rollouts import Rollouts, Scorer
from islands.workloads.text import STOP_TEXT, AnswerText, answer_text
from pytrees.naming import PyTree

Example = SftExample | PreferencePair | RlPrompt


@dataclass(frozen=True)
class Examples:
    """One source's examples of one kind: those to train on and those held out."""

    train: list[Example]
    heldout: list[Example]
    where: str
    """How messages name the source: "workload.task 'addition'" or the file's path."""


def split_by_prompt(examples: Sequence[Example], heldout: int) -> tuple[list[Example], list[Example]]:
    """(train, held out) of a file's examples: its last `heldout` examples are held out, and an earlier example
    whose prompt one of them has is left out of training, so no prompt is both trained on and evaluated (a file may
    hold several responses or pairs per prompt)."""
    cut = max(len(examples) - heldout, 0)
    held = list(examples[cut:])
    prompts = {e.prompt for e in held}
    return [e for e in examples[:cut] if e.prompt not in prompts], held


def answer_of(example: Example) -> str | None:
    """The reference answer of an example: a response, a chosen answer, an rl prompt's answer (None if it has none)."""
    if isinstance(example, SftExample):
        return example.response
    if isinstance(example, PreferencePair):
        return example.chosen
    return example.answer


class PostTraining:
    """The post-training data of one process, loaded once and shared by its islands and its evaluation."""

    def __init__(self, cfg: RunConfig, init_params: PyTree, lora: Lora | None = None) -> None:
        """`init_params`: the model's parameters at θ_0 as the random init of run.seed gives them (with `lora` too:
        the structure a workload.reference path is read into)."""
        self.cfg, self.workload, self.lora = cfg, cfg.workload, lora
        self.codec: AnswerText = answer_text(cfg.data, cfg.model.vocab_size)
        self.prompt_width = cfg.model.seq_len - self.workload.max_new_tokens
        """Tokens a prompt may take when its answer is generated (the rest of the context is the answer's)."""
        self.task: Task | None = (
            builtin_task(self.workload.task, cfg.run.seed, self.workload.task_digits) if self.workload.task else None
        )
        self._init_params = init_params
        self._examples: dict[IslandWorkload, Examples] = {}

    def count_tokens(self, text: str) -> int:
        return len(self.codec.encode(text))

    @functools.cached_property
    def chat(self) -> ChatTemplate | None:
        """The run tokenizer's chat template (None without one: a conversation in the data is then refused)."""
        codec = self.codec.codec
        if not isinstance(codec, TokenizerText) or codec.chat_template is None:
            return None
        return ChatTemplate(codec.chat_template, codec.special, str(codec.template_file))

    # -- examples ------------------------------------------------------------------------------------------------

    def examples(self, source: IslandWorkload) -> Examples:
        """The examples of one kind from one source (a file, or with no path the task), loaded once."""
        if source not in self._examples:
            self._examples[source] = self._load(source)
        return self._examples[source]

    def _load(self, source: IslandWorkload) -> Examples:
        w = self.workload
        if not source.path:
            assert self.task is not None
            make = {"sft": self.task.sft, "dpo": self.task.pairs, "rl": self.task.prompts}[source.kind]
            where = f"workload.task {w.task!r}"
            loaded = Examples(make(w.task_examples, "train"), make(w.heldout_examples, "heldout"), where)
        else:
            examples = read_examples(
                Path(source.path), source.kind, self.count_tokens, self.cfg.model.seq_len, self.chat
            )
            train, heldout = split_by_prompt(examples, w.heldout_examples)
            if not train:
                raise ConfigError(
                    f"{source.path}: {len(examples)} {source.kind} examples, and workload.heldout_examples "
                    f"({w.heldout_examples}) of them are held out with every example that shares their prompts: "
                    "none is left to train on"
                )
            loaded = Examples(train, heldout, source.path)
        self._check_fits(loaded, source.kind)
        return loaded

    def _check_fits(self, examples: Examples, kind: str) -> None:
        """Refuse a prompt that leaves no room for workload.max_new_tokens (rl's, and every held-out one, which the
        evaluation answers), and a held-out reference answer that a greedy answer of that length cannot match."""
        w = self.workload
        generated = [*(examples.train if kind == "rl" else []), *examples.heldout]
        for example in generated:
            n = self.count_tokens(example.prompt)
            if n > self.prompt_width:
                raise ConfigError(
                    f"{examples.where}: prompt {example.prompt[:40]!r} has {n} tokens; answers of "
                    f"workload.max_new_tokens ({w.max_new_tokens}) leave {self.prompt_width} of model.seq_len "
                    f"({self.cfg.model.seq_len}) for a prompt"
                )
        for example in examples.heldout:
            answer = answer_of(example)
            if answer is not None and self.count_tokens(answer) + 1 > w.max_new_tokens:
                raise ConfigError(
                    f"{examples.where}: the held-out answer {answer[:40]!r} and its stop token take "
                    f"{self.count_tokens(answer) + 1} tokens, more than workload.max_new_tokens ({w.max_new_tokens})"
                )

    def share(self, name: str, names: Sequence[str]) -> list[Example]:
        """Island `name`'s share of its source's training examples (all of them for an island not configured)."""
        source = self.workload.of(name)
        train = self.examples(source).train
        peers = [n for n in names if self.workload.of(n) == source]
        if name not in peers:
            return train
        return train[peers.index(name) :: len(peers)]

    # -- what an island trains on --------------------------------------------------------------------------------

    @functools.cached_property
    def reference(self) -> PyTree:
        """The frozen reference θ_ref (workload.reference), on the default device, read once per process."""
        from diloco.run.warm_start import reference_params

        if self.lora is not None and self.workload.reference == REFERENCE_START:
            return jax.device_put(self.lora.merged({}))  # θ_0 merged: the base itself, as the islands hold it
        params, _ = reference_params(self.cfg, self._init_params)
        return jax.device_put(params)

    @property
    def view(self) -> Callable[[PyTree], PyTree] | None:
        """What turns the trained θ into the model's parameters for sampling and evaluation: the adapters merged into
        the base (`Lora.merged`) with workload.lora; None where θ is the model's parameters."""
        return None if self.lora is None else self.lora.merged

    @functools.cached_property
    def scorer(self) -> Scorer:
        """workload.reward over a batch of answers (a reward that fails is one line naming the prompt)."""
        limit = self.workload.reward_timeout
        return functools.partial(score, load_reward(self.workload.reward), timeout=limit or None)

    def model(self, kind: str, base: Model) -> Model:
        """The model an island of this kind trains: the same parameters, the workload's loss."""
        w = self.workload
        loss = WorkloadLoss(kind, self.cfg.model, w.beta, w.kl_coef, w.sft_weight, w.temperature)
        model = Model(init=base.init, loss=loss, axis_units=base.axis_units, step_figures=STEP_FIGURES[kind])
        return model if self.lora is None else adapt(model, self.lora)

    def stream(self, name: str, names: Sequence[str], stream_id: int) -> Batches:
        """Island `name`'s batches: its share of its kind's examples."""
        kind, cfg = self.workload.of(name).kind, self.cfg
        examples = self.share(name, names)
        if not examples:
            raise ConfigError(
                f"island {name} has no {kind} examples: {len(self.examples(self.workload.of(name)).train)} are dealt "
                "to the islands that share them (raise workload.task_examples, or give the file more examples)"
            )
        batch, seq_len, seed = cfg.train.batch_size, cfg.model.seq_len, cfg.run.seed
        if kind == "rl":
            texts = [e.prompt for e in examples]
            prompts = prompt_table(texts, self.codec, self.prompt_width)
            return Rollouts(prompts, texts, self.scorer, self.codec, self.reference, cfg.model, self.workload,
                            batch, seed, stream_id, view=self.view)  # fmt: skip
        return ExampleStream(self.table(kind, examples), batch, seq_len, seed, stream_id)

    def table(self, kind: str, examples: Sequence[Example]) -> Table:
        """Examples of kind sft or dpo as arrays; dpo's with the reference's answer log-probabilities."""
        prompts = [e.prompt for e in examples]
        seq_len = self.cfg.model.seq_len
        if kind == "sft" and any(isinstance(e, ChatSft) for e in examples):  # conversations: loss on assistant turns
            width, codec = seq_len + 1, self.codec
            rows = [
                chat_row(codec, e.text, e.spans, width)
                if isinstance(e, ChatSft)
                else pack(codec.encode(e.prompt), codec.encode(e.response), codec.stop, width, codec.pad)  # type: ignore[union-attr]
                for e in examples
            ]
            return {"tokens": np.stack([t for t, _ in rows]), "mask": np.stack([m for _, m in rows])}
        if kind == "sft":
            return sft_table(prompts, [e.response for e in examples], self.codec, seq_len)  # type: ignore[union-attr]
        chosen = [e.chosen for e in examples]  # type: ignore[union-attr]
        table = pair_table(prompts, chosen, [e.rejected for e in examples], self.codec, seq_len)  # type: ignore[union-attr]
        rows = self.cfg.train.microbatch or self.cfg.train.batch_size
        for side in ("chosen", "rejected"):
            table[f"ref_{side}"] = answer_logprobs(
                self.reference, self.cfg.model, table[side], table[f"{side}_mask"], rows
            )
        return table

    # -- the global model's evaluation ---------------------------------------------------------------------------

    def evaluation(self, names: Sequence[str]) -> WorkloadEval:
        """The held-out figures of every post-training kind these islands run."""
        held = []
        for kind in self.workload.kinds(tuple(names)):
            if kind == "lm":
                continue
            sources = list(dict.fromkeys(self.workload.of(n) for n in names if self.workload.of(n).kind == kind))
            heldout = [e for source in sources for e in self.examples(source).heldout]
            texts = tuple(e.prompt for e in heldout)
            held.append(
                HeldOut(
                    kind,
                    prompt_table(texts, self.codec, self.prompt_width),
                    texts,
                    self._judge(heldout, sources),
                    sequences=self.table(kind, heldout) if kind != "rl" else None,
                    scorer=self.scorer if kind == "rl" else None,
                )
            )
        w = self.workload
        rows = self.cfg.train.microbatch or self.cfg.train.batch_size
        return WorkloadEval(self.cfg.model, held, self.codec, max_new_tokens=w.max_new_tokens, rows=rows, beta=w.beta,
                            view=self.view)  # fmt: skip

    def _judge(self, heldout: Sequence[Example], sources: Sequence[IslandWorkload]) -> Judge | None:
        """Exact match: the task's reward is 1; for examples from files, the answer is the reference (None where an
        rl prompt has no reference answer)."""
        if self.task is not None and not any(source.path for source in sources):
            task = self.task
            return lambda prompts, answers: np.array(
                [task.reward(p, a) == 1.0 for p, a in zip(prompts, answers, strict=True)]
            )
        references = [answer_of(e) for e in heldout]
        if any(r is None for r in references):
            return None
        return lambda prompts, answers: exact_matches(answers, references, STOP_TEXT)  # type: ignore[arg-type]
