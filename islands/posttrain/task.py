"""Built-in post-training tasks: answers a program checks, so SFT data, DPO pairs and RL prompts with a verifiable
reward come from the clone itself, with no download.

`addition` (`Addition`): the prompt "37+485=", the answer "522", then the stop text, a newline. Each operand is
drawn uniformly from [0, 10^digits), written without leading zeros; `digits` (1 to 9, default 2) is the difficulty.
A byte-level model reads it directly: a 2-digit problem is at most 6 prompt bytes and 3 answer bytes. The default is
what the project's small byte-level models learn in minutes on 2 CPU cores; every further digit is much harder for
them (benchmarks/log/ptdata.md).

- `sft(n)`: the prompt and the correct sum.
- `pairs(n)`: chosen = the correct sum, rejected = a plausible wrong one: the sum with one carry dropped (37+485 ->
  512, where the problem has a carry; half of the time) or with one digit off by one (522 -> 532 or 521).
- `prompts(n)`: the prompt, with the correct sum as the reference answer.
- `reward(prompt, answer)`: the answer is read up to the stop text and stripped; 1.0 when it is the sum exactly;
  a number of the wrong value gets PARTIAL_CREDIT times the share of its digits right in place, aligned at the units
  over the longer of the two (512 for 522: 0.5 * 2/3; 0522: 0.5 * 3/4), so RL has a gradient before its first exact
  answer; anything else (empty, text, a sign) is 0.0. The problem is the prompt's last "A+B=" (the prompt itself, or
  a conversation's user turn that a chat template rendered around it); a prompt without one raises ValueError.
- `pretraining_text(n)`: n lines "A+B=SUM" of the train split: the task itself as plain text, for a model that is
  to know the format (and the train split's sums) before post-training; a model pre-trained on another corpus (the
  default `stdlib:`) starts SFT from about chance.

Splits. Whether a problem is "heldout" is a fixed function of its unordered pair of operands (a keyed hash;
HELDOUT_PERCENT % of all pairs), the same for every seed and every `digits`, so no run's training data holds a
prompt that another run's held-out evaluation uses, nor its commuted twin (b+a, the same answer). The seed
chooses which problems of a split, and in what order: sft, pairs, prompts and the pretraining text draw from streams
of their own (SFT, DPO and RL see different problems), and `sft(n)` is the first n of `sft(n + k)`. Within one call
sft, pairs and prompts never repeat a problem (asking for more than a split holds is an error); the pretraining text
may.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from floor.errors import UserError
from islands.posttrain.accuracy import answer_text
from islands.posttrain.data import MAX_EXAMPLES, PreferencePair, RlPrompt, SftExample

SPLITS: tuple[str, ...] = ("train", "heldout")
HELDOUT_PERCENT = 10
"""The share of all unordered pairs of operands, in percent, that belongs to the held-out split."""

DEFAULT_DIGITS = 2
MAX_DIGITS = 9
"""Operands below 10^9: every problem of every `digits` has one 64-bit key (`in_heldout`)."""

PARTIAL_CREDIT = 0.5
"""The most a wrong number earns (all but its value right would still be below an exact answer's 1.0)."""

ENUMERATE_LIMIT = 1 << 20
"""Problem spaces up to this size (digits <= 3) are listed whole and shuffled; larger ones are sampled."""

_BATCH = 4096
"""Problems drawn at a time when sampling a large space (fixed, so that a prefix of the draws never depends on n)."""

_STREAMS: dict[str, int] = {"sft": 1, "dpo": 2, "rl": 3, "pretrain": 4, "wrong": 5}
_SPLIT_KEY = np.uint64(0x2545F4914F6CDD1D)
_PROMPT = re.compile(r"(?<![0-9])([0-9]{1,30})\+([0-9]{1,30})=")
"""A problem "A+B=" inside a prompt: the whole prompt, or the user's turn of a prompt rendered through a chat
template ("<|im_start|>user\n37+485=<|im_end|>\n<|im_start|>assistant\n")."""
_NUMBER = re.compile(r"[0-9]+")


class TaskError(UserError, ValueError):
    """A built-in task asked for something it cannot give (an unknown name, a split, too many problems)."""


class Task(Protocol):
    """A built-in task with an answer a program checks."""

    name: str
    stop: str
    """The text that ends an answer: the model is trained to write it, and the reward reads up to it."""

    def sft(self, n: int, split: str = "train") -> list[SftExample]: ...

    def pairs(self, n: int, split: str = "train") -> list[PreferencePair]: ...

    def prompts(self, n: int, split: str = "train") -> list[RlPrompt]: ...

    def reward(self, prompt: str, answer: str) -> float:
        """1.0 for an exact answer, partial credit allowed, in [0, 1]."""
        ...

    def pretraining_text(self, n: int, split: str = "train") -> str:
        """Plain text of the task's domain, n lines, for pre-training."""
        ...

    def split_size(self, split: str) -> int | None:
        """How many problems `split` holds, where they can be counted."""
        ...


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 whose every output bit depends on every input bit (its
    products wrap around, as they are meant to)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def in_heldout(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool: whether each problem a + b (operands below 2^32) belongs to the held-out split. Keyed on the unordered
    pair {a, b}: b + a has a + b's answer, so a problem and its commuted twin fall in the same split."""
    a, b = np.asarray(a, np.uint64), np.asarray(b, np.uint64)
    key = (np.minimum(a, b) << np.uint64(32)) | np.maximum(a, b)
    return _mix64(key ^ _SPLIT_KEY) % np.uint64(100) < np.uint64(HELDOUT_PERCENT)


def carry_positions(a: int, b: int) -> list[int]:
    """The decimal places (0 = units) whose column sum carries into the next place when adding a and b."""
    positions, carry, place = [], 0, 0
    while a or b or carry:
        carry = int(a % 10 + b % 10 + carry >= 10)
        if carry:
            positions.append(place)
        a, b, place = a // 10, b // 10, place + 1
    return positions


def one_digit_off(number: str, draw: int) -> str:
    """number with one digit one more or one less (draw chooses which), never a new leading zero."""
    options = [
        number[:i] + str(int(c) + step) + number[i + 1 :]
        for i, c in enumerate(number)
        for step in (-1, 1)
        if 0 <= int(c) + step <= 9 and not (i == 0 and len(number) > 1 and int(c) + step == 0)
    ]
    return options[draw % len(options)]


def wrong_sum(a: int, b: int, draws: tuple[int, int, int]) -> str:
    """A plausible wrong answer to a + b: one carry dropped (if the sum has one and draws[0] is even), else one digit
    off by one; draws[1] picks the carry, draws[2] the digit."""
    carries = carry_positions(a, b)
    if carries and draws[0] % 2 == 0:
        return str(a + b - 10 ** (carries[draws[1] % len(carries)] + 1))
    return one_digit_off(str(a + b), draws[2])


def digit_credit(given: str, truth: str) -> float:
    """1.0 when given is truth; for another number, PARTIAL_CREDIT times the share of places (aligned at the units,
    over the longer) that hold truth's digit; 0.0 for anything that is not digits."""
    if given == truth:
        return 1.0
    if not _NUMBER.fullmatch(given):
        return 0.0
    same = sum(g == t for g, t in zip(reversed(given), reversed(truth), strict=False))
    return PARTIAL_CREDIT * same / max(len(given), len(truth))


def addition_reward(prompt: str, answer: str) -> float:
    """The reward of `answer` (up to its stop text) to an addition prompt: the last "A+B=" the prompt holds, itself or
    rendered in a chat template's turn (module docstring)."""
    match = next(reversed(list(_PROMPT.finditer(prompt))), None)
    if match is None:
        raise ValueError("not an addition prompt (A+B= with A and B of at most 30 digits)")
    return digit_credit(answer_text(answer, Addition.stop), str(int(match[1]) + int(match[2])))


def _check_count(n: object) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_EXAMPLES:
        raise TaskError(f"the number of examples must be an integer from 1 to {MAX_EXAMPLES} (got {n!r})")
    return n


@dataclass(frozen=True)
class Addition:
    """Multi-digit addition (module docstring): a `Task`."""

    seed: int
    digits: int = DEFAULT_DIGITS
    name: ClassVar[str] = "addition"
    stop: ClassVar[str] = "\n"

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise TaskError(f"the task's seed must be an integer >= 0 (got {self.seed!r})")
        if not isinstance(self.digits, int) or isinstance(self.digits, bool) or not 1 <= self.digits <= MAX_DIGITS:
            raise TaskError(f"addition's digits must be an integer from 1 to {MAX_DIGITS} (got {self.digits!r})")

    def _rng(self, split: str, stream: str) -> np.random.Generator:
        if split not in SPLITS:
            raise TaskError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
        return np.random.default_rng([self.seed, self.digits, SPLITS.index(split), _STREAMS[stream]])

    def _operands(self, split: str, stream: str, n: int, unique: bool) -> list[tuple[int, int]]:
        """n problems (a, b) of the split, drawn from the stream; each at most once when unique."""
        rng = self._rng(split, stream)
        n, base, heldout = _check_count(n), 10**self.digits, split == "heldout"
        every = self._enumerated(split)
        if every is not None:
            a, b = every
            if unique and n > a.size:
                raise TaskError(
                    f"{self.digits}-digit addition has {a.size} {split} problems, fewer than the {n} asked for"
                )
            pick = rng.permutation(a.size)[:n] if unique else rng.integers(0, a.size, n)
            return list(zip(a[pick].tolist(), b[pick].tolist(), strict=True))
        drawn: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        while len(drawn) < n:
            a, b = np.divmod(rng.integers(0, base * base, _BATCH), base)
            keep = in_heldout(a, b) == heldout
            for problem in zip(a[keep].tolist(), b[keep].tolist(), strict=True):
                if unique and problem in seen:
                    continue
                seen.add(problem)
                drawn.append(problem)
                if len(drawn) == n:
                    break
        return drawn

    def sft(self, n: int, split: str = "train") -> list[SftExample]:
        return [SftExample(f"{a}+{b}=", str(a + b)) for a, b in self._operands(split, "sft", n, unique=True)]

    def pairs(self, n: int, split: str = "train") -> list[PreferencePair]:
        problems = self._operands(split, "dpo", n, unique=True)
        draws = self._rng(split, "wrong").integers(0, 1 << 30, size=(len(problems), 3)).tolist()
        return [
            PreferencePair(f"{a}+{b}=", str(a + b), wrong_sum(a, b, (d[0], d[1], d[2])))
            for (a, b), d in zip(problems, draws, strict=True)
        ]

    def prompts(self, n: int, split: str = "train") -> list[RlPrompt]:
        return [RlPrompt(f"{a}+{b}=", str(a + b)) for a, b in self._operands(split, "rl", n, unique=True)]

    def reward(self, prompt: str, answer: str) -> float:
        return addition_reward(prompt, answer)

    def split_size(self, split: str) -> int | None:
        """The problems of `split`, where they are few enough to count (None: too many to enumerate)."""
        every = self._enumerated(split)
        return None if every is None else int(every[0].size)

    def _enumerated(self, split: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Every problem (a, b) of `split` in order, where there are at most ENUMERATE_LIMIT problems in all."""
        if split not in SPLITS:
            raise TaskError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
        base = 10**self.digits
        if base * base > ENUMERATE_LIMIT:
            return None
        a, b = np.divmod(np.arange(base * base, dtype=np.int64), base)
        keep = in_heldout(a, b) == (split == "heldout")
        return a[keep], b[keep]

    def pretraining_text(self, n: int, split: str = "train") -> str:
        return "".join(f"{a}+{b}={a + b}\n" for a, b in self._operands(split, "pretrain", n, unique=False))


TASKS: dict[str, type[Addition]] = {"addition": Addition}
"""The built-in tasks by name."""


def builtin_task(name: str, seed: int, digits: int = DEFAULT_DIGITS) -> Task:
    """The built-in task `name` with this seed and difficulty (`digits`: the operands' digits, for addition)."""
    if name not in TASKS:
        raise TaskError(f"unknown built-in task {name!r} (one of {', '.join(TASKS)})")
    return TASKS[name](seed=seed, digits=digits)
