"""Rewards for RL: a function of a prompt and an answer, from a built-in task or from the user's own code.

`load_reward("builtin:addition")` is the task's checker (islands/posttrain/task.py);
`load_reward("mypkg.rewards:score")` imports the user's function as `model.entry` imports a model
(islands/user_code.py: on sys.path, then in the working directory), which is called as `score(prompt, answer)` with
two strings and returns a number; higher is better.

`score` runs a reward over a batch of answers and guards the island from it: a reward that raises (anything but
KeyboardInterrupt, SystemExit included), or returns what is not a real number (a bool, None, a string, an array) or
a value that is not finite as float32, is a `RewardError` of one line naming the reward, the prompt (its first
SHOWN_CHARS characters) and the cause; the island stops with that line instead of training on a corrupted reward.

With a `timeout` (workload.reward_timeout), the calls run one after another on a daemon thread of their own and a
call that has not returned `timeout` seconds after it started is a RewardError too, "did not return within ...",
naming its prompt: the island stops with that line instead of hanging. The stuck call is abandoned, not killed (a
thread cannot be): it runs on until it returns or the process exits, and no further call of that batch is made. A
reward that holds the GIL in C code for good stalls the process whatever the timeout; one in Python or waiting on
I/O does not.
"""

from __future__ import annotations

import math
import numbers
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Outcome:
    """What one call of a reward did: returned `value`, or raised `error`."""

    value: object = None
    error: BaseException | None = None


def call(fn: RewardFn, prompt: str, answer: str) -> Outcome:
    """fn(prompt, answer), whatever it returns or raises (KeyboardInterrupt included: the caller re-raises it)."""
    try:
        return Outcome(value=fn(prompt, answer))
    except BaseException as err:  # noqa: BLE001 (user code: `checked` decides what is its error and what is not)
        return Outcome(error=err)


def checked(fn: RewardFn, prompt: str, answer: str, outcome: Outcome) -> float:
    """The outcome of fn(prompt, answer) as a float that float32 holds, or a RewardError saying why there is none;
    an interrupt (anything that is neither an Exception nor SystemExit) is raised as it was."""
    if outcome.error is not None:
        err = outcome.error
        if not isinstance(err, Exception | SystemExit):
            raise err
        # user code: whatever it raises is its error, reported as one line
        raise _failed(fn, prompt, answer, f"raised {_clip(one_line(err), CAUSE_CHARS)}") from err
    value = outcome.value
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise _failed(fn, prompt, answer, f"returned {_shown_value(value)}, not a number")
    try:
        as_float = float(value)
    except (OverflowError, ValueError):  # an int beyond float's range
        as_float = math.inf
    if not math.isfinite(as_float) or abs(as_float) > FLOAT32_MAX:
        raise _failed(fn, prompt, answer, f"returned {_shown_value(value)}, not a finite float32 number")
    return as_float


def score(fn: RewardFn, prompts: Sequence[str], answers: Sequence[str], timeout: float | None = None) -> np.ndarray:
    """float32 [N]: fn of each prompt and its answer, in order; the first failure is a RewardError, a call that runs
    past `timeout` seconds one too (module docstring)."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts for {len(answers)} answers")
    pairs = list(zip(prompts, answers, strict=True))
    if timeout is None:
        return np.array([checked(fn, p, a, call(fn, p, a)) for p, a in pairs], np.float32)
    return np.array(_watched(fn, pairs, timeout), np.float32)


def _watched(fn: RewardFn, pairs: list[tuple[str, str]], timeout: float) -> list[float]:
    """The checked values of fn on each pair, the calls made on a daemon thread, each waited for `timeout` s."""
    outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
    abandoned = threading.Event()

    def calls() -> None:
        for prompt, answer in pairs:
            if abandoned.is_set():
                return
            outcomes.put(call(fn, prompt, answer))

    threading.Thread(target=calls, name="reward", daemon=True).start()
    values = []
    try:
        for prompt, answer in pairs:
            try:
                outcome = outcomes.get(timeout=timeout)
            except queue.Empty:
                raise _failed(
                    fn, prompt, answer, f"did not return within {timeout:g} s (workload.reward_timeout)"
                ) from None
            values.append(checked(fn, prompt, answer, outcome))
    finally:
        abandoned.set()
    return values
