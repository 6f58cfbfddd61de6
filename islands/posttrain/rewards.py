"""Rewards for RL: a function of a prompt and an answer, from a built-in task or from the user's own code.

`load_reward("builtin:addition")` is the task's checker (islands/posttrain/task.py);
`load_reward("mypkg.rewards:score")` imports the user's function as `model.entry` imports a model
(islands/user_code.py: on sys.path, then in the working directory), which is called as `score(prompt, answer)` with
two strings and returns a number; higher is better.

`score` runs a reward over a batch of answers and guards the island from it: a reward that raises (anything but
KeyboardInterrupt, SystemExit included), or returns what is not a real number (a bool, None, a string, an array) or
a value that is not finite as float32, is a `RewardError` of one line naming the reward, the prompt (its first
SHOWN_CHARS characters) and the cause; the island stops with that line instead of training on a corrupted reward.
A reward that never returns is not guarded here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np

from floor.errors import UserError
from islands.posttrain.task import TASKS, builtin_task
from islands.user_code import entry_form_ok, load_callable, one_line

RewardFn = Callable[[str, str], float]

BUILTIN = "builtin:"
"""A reward spec that starts with this names a built-in task's checker."""

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest reward a float32 array of scores holds."""

SHOWN_CHARS = 60
"""The most characters of a prompt, an answer or a returned value that a RewardError shows."""

CAUSE_CHARS = 200
"""The most characters of what a failing reward raised that a RewardError shows."""


class RewardError(UserError, ValueError):
    """A reward that cannot be loaded, or that failed on an answer; one line naming the reward and the prompt."""


def load_reward(spec: str, key: str = "workload.reward") -> RewardFn:
    """The reward `spec` names: "builtin:NAME" (a built-in task's `reward`) or "package.module:function" (the
    user's). key is the config key spec came from, for the message of a spec that does not load."""
    where = f"{key} {spec!r}"
    if not isinstance(spec, str):
        raise RewardError(f"{key} must be a string (got {spec!r})")
    if spec.startswith(BUILTIN):
        name = spec[len(BUILTIN) :]
        if name not in TASKS:
            raise RewardError(f"{where}: no built-in task {name!r} (one of {', '.join(TASKS)})")
        return builtin_task(name, seed=0).reward  # a checker depends on neither seed nor difficulty
    if not entry_form_ok(spec):
        raise RewardError(f"{where} must have the form 'package.module:function' or '{BUILTIN}NAME'")
    return load_callable(spec, where, RewardError)


def reward_name(fn: RewardFn) -> str:
    """How a message names a reward: module:qualified name where it has them."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(fn)


def _clip(text: str, limit: int = SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _shown(text: str) -> str:
    """A prompt or an answer, cut short, quoted and escaped (one line)."""
    return repr(_clip(text))


def _shown_value(value: object) -> str:
    """What a reward returned, as Python writes it, on one line, cut short."""
    return _clip(" ".join(repr(value).split()))


def _failed(fn: RewardFn, prompt: str, answer: str, cause: str) -> RewardError:
    return RewardError(f"reward {reward_name(fn)} on prompt {_shown(prompt)} (answer {_shown(answer)}) {cause}")


def _value(fn: RewardFn, prompt: str, answer: str) -> float:
    """fn(prompt, answer) as a float that float32 holds, or a RewardError saying why there is none."""
    try:
        value = fn(prompt, answer)
    except (Exception, SystemExit) as err:  # user code: whatever it raises is its error, reported as one line
        raise _failed(fn, prompt, answer, f"raised {_clip(one_line(err), CAUSE_CHARS)}") from err
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise _failed(fn, prompt, answer, f"returned {_shown_value(value)}, not a number")
    try:
        as_float = float(value)
    except (OverflowError, ValueError):  # an int beyond float's range
        as_float = math.inf
    if not math.isfinite(as_float) or abs(as_float) > FLOAT32_MAX:
        raise _failed(fn, prompt, answer, f"returned {_shown_value(value)}, not a finite float32 number")
    return as_float


def score(fn: RewardFn, prompts: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    """float32 [N]: fn of each prompt and its answer, in order; the first failure is a RewardError (module
    docstring)."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts for {len(answers)} answers")
    return np.array([_value(fn, p, a) for p, a in zip(prompts, answers, strict=True)], np.float32)
