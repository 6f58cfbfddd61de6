"""The `[workload]` section of a run config: what the islands minimize (docs/architecture.md, "Workloads").

JAX-free, like every config section (tests/test_layering.py). The run-wide checks that need other sections (island
names, the model's kind and context, vectorized islands, chunked sampling) are `workload_conflict`'s, which
`RunConfig` calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from islands.models.config import COMPUTE_DTYPES, LORA_MODULES
from islands.posttrain.rewards import BUILTIN
from islands.posttrain.task import DEFAULT_DIGITS, MAX_DIGITS, TASKS
from islands.user_code import entry_form_ok

KINDS: tuple[str, ...] = ("lm", "sft", "dpo", "rl")
"""The values of workload.kind (and of a workload.islands entry)."""

POST_TRAINING: tuple[str, ...] = ("sft", "dpo", "rl")
"""The kinds that train on examples rather than on a corpus."""

STEP_FIGURES: dict[str, tuple[str, ...]] = {"sft": (), "dpo": ("accuracy",), "rl": ("reward", "kl")}
"""What each kind's inner steps report beside the loss (`Model.step_figures`, `inner` events' fields): dpo's
preference accuracy on its batch, rl's mean reward of the sampled answers and the KL to the reference; sft's loss is
its figure."""

STEP_FIGURE_NAMES: tuple[str, ...] = tuple(sorted({name for names in STEP_FIGURES.values() for name in names}))
"""Every field an `inner` event may carry beside its loss."""

REFERENCE_START = "start"
"""workload.reference's value for θ at the start of the run."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (Hu et al. 2021, arXiv 2106.09685; islands/models/lora.py): the base weights frozen, the islands train
    low-rank adapters, and the pseudo-gradients, the outer step, the codecs and the checkpoints see the adapters only.
    The base is θ_0 as a run without LoRA would start: init.from's parameters, else the random init of run.seed."""

    rank: int = 0
    """r, the adapters' rank; 0: no LoRA (every parameter trains)."""
    alpha: float = 16.0
    """α: an adapted weight is W + (α / r)·A·B."""
    targets: tuple[str, ...] = ()
    """The block matrices adapted, by leaf name (islands/models/config.py `LORA_MODULES`: wq, wk, wv, wo, w_gate,
    w_up, w_down for the Llama family, wqkv, wo, w1, w2 for GPT-2's); []: every attention projection of the model.
    A stack of experts [E, D, F] is refused: LoRA adapts 2-D matrices."""
    dropout: float = 0.0
    """p, dropout on the adapters' input in training (PEFT's lora_dropout): x·W + (α / r)·(drop(x)·A)·B, each entry
    of x zeroed with probability p and the rest scaled by 1 / (1 - p); a mask per adapted matrix, pass, inner step
    and island, drawn from run.seed, the island's name and the step (islands/models/lora.py). 0: none. Evaluation,
    sampling and export read the merged weights and drop nothing."""
    base_dtype: str = "float32"
    """How each process holds the frozen base: "float32", or "bfloat16" (half the memory; a step computes in
    model.compute_dtype as ever, so only the base's rounding changes)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 0:
            raise ValueError(f"workload.lora.rank must be >= 1 (0: no LoRA) (got {self.rank})")
        if not (0 < self.alpha < math.inf):
            raise ValueError(f"workload.lora.alpha must be a finite number > 0 (got {self.alpha})")
        unknown = [t for t in self.targets if t not in LORA_MODULES]
        if unknown:
            raise ValueError(
                f"workload.lora.targets names {unknown[0]!r}, not a block matrix LoRA adapts "
                f"({', '.join(LORA_MODULES)})"
            )
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"workload.lora.targets names a matrix twice ({', '.join(self.targets)})")
        if not (0 <= self.dropout < 1):
            raise ValueError(f"workload.lora.dropout must be >= 0 and < 1 (got {self.dropout})")
        if self.base_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"workload.lora.base_dtype must be one of {', '.join(COMPUTE_DTYPES)} (got {self.base_dtype!r})"
            )


@dataclass(frozen=True)
class IslandWorkload:
    """What one island runs: its kind and where its examples come from (a JSON Lines file, else the built-in task)."""

    kind: str
    path: str = ""
    """A file of the kind's examples (islands/posttrain/data.py); "": workload.task's."""


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "lm"
    """What every island minimizes (a workload.islands entry overrides it for one island): "lm" (next-token loss on
    [data]'s corpus: the default, what a run without this section does), "sft" (prompt and response pairs, the loss
    the response's cross-entropy only), "dpo" (preference pairs: DPO's loss against a frozen reference model,
    workload.beta and workload.reference) or "rl" (group-relative policy optimization: the island samples
    workload.group_size answers per prompt from its current parameters, scores them with workload.reward and takes one
    policy-gradient step on them, with a KL penalty to the reference). Post-training needs a model of this project's
    families (model.kind transformer, moe, llama or llama_moe: their token log-probabilities; not custom), and
    reads its texts through the run's tokenizer (islands/text.py `tokenizer_file`: data.tokenizer, which a run from a
    Hugging Face checkpoint fills with the checkpoint's, or the tokenizer.json `diloco data prepare` wrote beside a
    data.kind = "tokens" corpus), UTF-8 bytes where the run has none."""
    path: str = ""
    """A JSON Lines file of workload.kind's examples (islands/posttrain/data.py: {"prompt", "response"} for sft,
    {"prompt", "chosen", "rejected"} for dpo, {"prompt", "answer"?} for rl; or conversations, {"messages": [...]} for
    sft, chosen and rejected messages for dpo, prompt messages for rl, rendered through the chat template of the
    run's tokenizer, an sft loss on the assistant's turns only). Its last workload.heldout_examples
    examples are held out for evaluation; the rest, less any example whose prompt a held-out one has, are dealt to
    the islands, each its own share. Exclusive with workload.task."""
    task: str = ""
    """A built-in task (islands/posttrain/task.py) whose examples are generated from run.seed: workload.task_examples
    for training, dealt to the islands, and workload.heldout_examples from its held-out split, which shares no prompt
    with the training split (addition: nor a commuted one, b+a for a+b). Exclusive with workload.path."""
    task_examples: int = 4096
    """workload.task only: training examples generated (all islands together)."""
    task_digits: int = DEFAULT_DIGITS
    """workload.task only: the task's difficulty (addition: the operands' digits, 1 to 9)."""
    heldout_examples: int = 64
    """Examples each evaluation of the global model reads (of each kind the run trains): from the held-out split of
    workload.task, or the last ones of each file."""
    beta: float = 0.1
    """DPO's β: how far the policy may move from the reference (its log-ratio's scale in the loss); > 0."""
    sft_weight: float = 0.0
    """dpo: weight of the chosen answers' cross-entropy added to DPO's loss (Pang et al. 2024: DPO alone may lower
    the right answers' likelihood along with the wrong ones', as near-miss pairs invite); 0: DPO's loss alone."""
    reference: str = REFERENCE_START
    """The frozen reference of dpo and rl: "start" (θ_0 of this run: init.from's parameters, else the random init of
    run.seed) or a run directory or checkpoint directory of this project (its newest committed θ, as init.from reads
    it). Each island reads it itself, like init.inner_state's source: a path must be reachable from every island."""
    group_size: int = 4
    """rl: answers sampled per prompt; advantages are relative to their group. train.batch_size must be a multiple
    (an inner step trains on batch_size / group_size prompts)."""
    max_new_tokens: int = 16
    """Tokens generated per answer at most (rl's samples, and the greedy answers evaluation scores); the stop token
    counts. Every reference answer the evaluation compares with must fit."""
    temperature: float = 1.0
    """rl: the sampling temperature of the policy's answers (0: greedy, which gives a group nothing to compare).
    The answers' log-probabilities, the policy's and the reference's, are scored at it too (at 1 for 0)."""
    top_p: float = 1.0
    """rl: nucleus sampling, the smallest set of tokens holding this much probability (1: all)."""
    kl_coef: float = 0.04
    """rl: weight of the KL penalty to the reference (the k3 estimator, per answer token); 0 turns it off."""
    reward: str = ""
    """rl: the reward of an answer, "builtin:NAME" (a built-in task's) or "package.module:function" (a function of
    prompt and answer returning a finite number), loaded as model.entry is."""
    reward_timeout: float = 10.0
    """rl: the most seconds one call of workload.reward may take; a call still running then stops the island with one
    line naming the reward and the prompt (islands/posttrain/rewards.py) instead of a hung island. 0: no limit."""
    islands: tuple[str, ...] = ()
    """Mixed workloads: "NAME=KIND" or "NAME=KIND:PATH" entries, island NAME running KIND instead of workload.kind
    (on its own file PATH, else on workload.path when KIND is workload.kind, else on workload.task). Every island
    trains the same parameters and the outer step averages their pseudo-gradients as for one workload."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters in place of full fine-tuning, for every kind (`LoraConfig`); off by default."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "islands", tuple(self.islands))
        if self.kind not in KINDS:
            raise ValueError(f"workload.kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        for key in ("task_examples", "heldout_examples", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"workload.{key} must be >= 1 (got {getattr(self, key)})")
        if self.group_size < 2:
            raise ValueError(
                f"workload.group_size must be >= 2 (got {self.group_size}): an answer's advantage is relative to "
                "the others of its group"
            )
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"workload.beta must be a finite number > 0 (got {self.beta})")
        if not (0 <= self.sft_weight < math.inf):
            raise ValueError(f"workload.sft_weight must be a finite number >= 0 (got {self.sft_weight})")
        if not (0 <= self.temperature < math.inf):
            raise ValueError(f"workload.temperature must be a finite number >= 0 (got {self.temperature})")
        if not (0 <= self.reward_timeout < math.inf):
            raise ValueError(
                f"workload.reward_timeout must be a finite number of seconds >= 0 (got {self.reward_timeout})"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"workload.top_p must be in (0, 1] (got {self.top_p})")
        if not (0 <= self.kl_coef < math.inf):
            raise ValueError(f"workload.kl_coef must be a finite number >= 0 (got {self.kl_coef})")
        if not self.reference:
            raise ValueError('workload.reference must be "start" or a run or checkpoint directory')
        if self.task and self.task not in TASKS:
            raise ValueError(f"workload.task must be one of {', '.join(TASKS)} (got {self.task!r})")
        if not 1 <= self.task_digits <= MAX_DIGITS:
            raise ValueError(f"workload.task_digits must be from 1 to {MAX_DIGITS} (got {self.task_digits})")
        if self.path and self.task:
            raise ValueError("workload.path and workload.task are both set: the examples come from one of them")
        if self.path and self.kind == "lm":
            raise ValueError(
                "workload.path holds workload.kind's examples, but workload.kind = \"lm\" trains on [data]'s corpus "
                '(give a workload.islands entry its file: "NAME=KIND:PATH")'
            )
        entries = self.entries()  # refuses a malformed entry
        kinds = {self.kind, *(w.kind for w in entries.values())}
        post = [k for k in POST_TRAINING if k in kinds]
        if not post and (self.path or self.task):
            key = "workload.path" if self.path else "workload.task"
            raise ValueError(f'{key} gives post-training examples, but every island runs workload.kind = "lm"')
        if "rl" in kinds and not self.reward:
            raise ValueError(
                'workload.reward must be set for workload.kind = "rl": "builtin:NAME" (a built-in task\'s reward) '
                'or "package.module:function"'
            )
        if self.reward and not _reward_form_ok(self.reward):
            raise ValueError(
                f'workload.reward {self.reward!r} must be "builtin:NAME" or have the form "package.module:function"'
            )
        if self.kind in POST_TRAINING and not (self.path or self.task):
            raise ValueError(f"workload.kind = {self.kind!r} needs its examples: set workload.path or workload.task")
        for name, w in entries.items():
            if w.kind in POST_TRAINING and not w.path and not self.task and not (self.path and w.kind == self.kind):
                raise ValueError(
                    f"workload.islands entry for {name} runs {w.kind!r} without examples: give it a file "
                    f'("{name}={w.kind}:PATH") or set workload.task'
                )

    def entries(self) -> dict[str, IslandWorkload]:
        """workload.islands as island name -> its workload (the names are checked against islands.names by
        `workload_conflict`)."""
        out: dict[str, IslandWorkload] = {}
        for entry in self.islands:
            name, sep, rest = entry.partition("=")
            kind, _, path = rest.partition(":")
            if not sep or not name or kind not in KINDS:
                raise ValueError(
                    f"workload.islands entry {entry!r} must be NAME=KIND or NAME=KIND:PATH with KIND one of "
                    f"{', '.join(KINDS)}"
                )
            if name in out:
                raise ValueError(f"workload.islands names island {name} twice")
            out[name] = IslandWorkload(kind, path)
        return out

    def of(self, island: str) -> IslandWorkload:
        """What island `island` runs: its workload.islands entry, else workload.kind on workload.path (or the task).
        An island not in the config (one admitted into a live run) runs workload.kind."""
        entry = self.entries().get(island)
        if entry is not None and (entry.path or entry.kind != self.kind):
            return entry
        return IslandWorkload(self.kind, self.path)

    def kinds(self, islands: tuple[str, ...]) -> tuple[str, ...]:
        """The kinds these islands run, in KINDS order."""
        present = {self.of(name).kind for name in islands}
        return tuple(k for k in KINDS if k in present)

    def post_training(self, islands: tuple[str, ...]) -> bool:
        """Whether any of these islands runs a post-training kind."""
        return any(k in POST_TRAINING for k in self.kinds(islands))

    @property
    def divergence_factor(self) -> float | None:
        """The eval loss's growth over the initial one that counts as diverged (diloco/run/global_run.py), where it
        means one: None keeps the run's default (lm's cross-entropy, sft's on responses); 0 (NaN/Inf only) for dpo,
        whose loss starts at log 2 and measures a margin, and rl, whose eval loss is the negated mean reward."""
        return None if self.kind in ("lm", "sft") else 0.0


def _reward_form_ok(spec: str) -> bool:
    """ "builtin:NAME" with a NAME, or the form of user code that `load_reward` loads."""
    return bool(spec[len(BUILTIN) :]) if spec.startswith(BUILTIN) else entry_form_ok(spec)


def workload_conflict(
    workload: WorkloadConfig,
    island_names: tuple[str, ...],
    model_kind: str,
    seq_len: int,
    batch_size: int,
    sampling: str,
    mode: str,
) -> str | None:
    """Why the workload cannot run with the rest of the config, naming the keys; None if it can."""
    if workload.lora.enabled and model_kind == "custom":
        return (
            'workload.lora adapts the block matrices of this project\'s models: model.kind must be "transformer", '
            '"moe", "llama" or "llama_moe" (got "custom")'
        )
    unknown = sorted(set(workload.entries()) - set(island_names))
    if unknown:
        return f"workload.islands names {', '.join(unknown)}, not in islands.names ({', '.join(island_names)})"
    kinds = workload.kinds(island_names)
    if mode == "sync" and len(kinds) > 1:
        return (
            f"train.mode = 'sync' trains one model on the union of the islands' batches: one workload for all "
            f"(workload.islands gives them {', '.join(kinds)})"
        )
    if not any(k in POST_TRAINING for k in kinds):
        return None
    if model_kind == "custom":
        return (
            f"workload kinds {', '.join(k for k in kinds if k != 'lm')} need the model's token log-probabilities: "
            'model.kind must be "transformer", "moe", "llama" or "llama_moe" (a custom model has only its own loss)'
        )
    if sampling == "chunks":
        return 'data.sampling = "chunks" leases a corpus\'s sequences: every island must run workload.kind = "lm"'
    if "rl" in kinds:
        if batch_size % workload.group_size:
            return (
                f"train.batch_size ({batch_size}) must be a multiple of workload.group_size ({workload.group_size}): "
                "an inner step trains on whole groups of answers"
            )
        if workload.max_new_tokens >= seq_len:
            return (
                f"workload.max_new_tokens ({workload.max_new_tokens}) must be below model.seq_len ({seq_len}): the "
                "prompt and its answer share the context"
            )
    return None
