"""Rewards from a built-in task or a user's module (real modules written to tmp_path), scored with a guard that turns
every way a reward can fail into one line naming the reward and the prompt; exact match and preference accuracy."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from islands.posttrain.accuracy import answer_text, exact_match, exact_matches, preference_accuracy
from islands.posttrain.rewards import RewardError, load_reward, score

MODULE = "user_rewards_for_test"

USER_REWARDS = '''
import sys
import numpy as np

def length(prompt, answer):
    """A well-behaved reward: longer answers score higher."""
    return len(answer) / 10

def numpy_value(prompt, answer):
    return np.float32(0.25) if answer else np.int64(2)

def raises(prompt, answer):
    return {}["no such key\\nsecond line"]

def raises_at_length(prompt, answer):
    raise ValueError("why " * 10_000)

def exits(prompt, answer):
    sys.exit(3)

def interrupted(prompt, answer):
    raise KeyboardInterrupt

def a_bool(prompt, answer):
    return answer == "yes"

def nothing(prompt, answer):
    pass

def text(prompt, answer):
    return "1.0"

def an_array(prompt, answer):
    return np.ones(2)

def nan(prompt, answer):
    return float("nan")

def infinite(prompt, answer):
    return -float("inf")

def beyond_float32(prompt, answer):
    return 1e39

def huge_int(prompt, answer):
    return 10**400

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real module of rewards on sys.path, forgotten afterwards."""
    (tmp_path / f"{MODULE}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)


def test_a_builtin_reward() -> None:
    reward = load_reward("builtin:addition")
    values = score(reward, ["37+485=", "37+485=", "1+1="], ["522\n", "512", "two"])
    assert values.dtype == np.float32 and values.tolist() == pytest.approx([1.0, 1 / 3, 0.0])


def test_a_user_reward_scores_in_order_as_float32(user_module: str) -> None:
    values = score(load_reward(f"{user_module}:length"), ["a", "b", "c"], ["", "12345", "x" * 20])
    assert values.dtype == np.float32 and values.tolist() == pytest.approx([0.0, 0.5, 2.0])
    assert score(load_reward(f"{user_module}:numpy_value"), ["p", "p"], ["a", ""]).tolist() == [0.25, 2.0]
    assert score(load_reward(f"{user_module}:length"), [], []).shape == (0,)


def test_a_user_reward_next_to_the_config_is_found_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cwd_rewards_for_test.py").write_text("def one(prompt, answer):\n    return 1\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    try:
        assert score(load_reward("cwd_rewards_for_test:one"), ["p"], ["a"]).tolist() == [1.0]
    finally:
        sys.modules.pop("cwd_rewards_for_test", None)


@pytest.mark.parametrize(
    ("function", "cause"),
    [
        ("raises", "raised KeyError: 'no such key\\nsecond line'"),
        ("exits", "raised SystemExit: 3"),
        ("raises_at_length", "raised " + ("ValueError: " + "why " * 100)[:200] + "..."),  # its message cut short
        ("a_bool", "returned False, not a number"),
        ("nothing", "returned None, not a number"),
        ("text", "returned '1.0', not a number"),
        ("an_array", "returned array([1., 1.]), not a number"),
        ("nan", "returned nan, not a finite float32 number"),
        ("infinite", "returned -inf, not a finite float32 number"),
        ("beyond_float32", "returned 1e+39, not a finite float32 number"),
        ("huge_int", "returned " + "1" + "0" * 59 + "..., not a finite float32 number"),
    ],
)
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["in-line", "on-a-thread"])
def test_a_reward_that_fails_is_one_line_naming_it_and_the_prompt(
    user_module: str, function: str, cause: str, timeout: float | None
) -> None:
    prompt = "a long prompt\nwith a newline " + "x" * 500
    with pytest.raises(RewardError) as err:
        score(load_reward(f"{user_module}:{function}"), [prompt], ["no"], timeout=timeout)
    shown = repr(prompt[:60] + "...")
    assert str(err.value).startswith(f"reward {user_module}:{function} on prompt {shown} (answer 'no') {cause}")
    assert "\n" not in str(err.value)


def test_a_first_prompt_that_fails_is_named(user_module: str) -> None:
    with pytest.raises(RewardError, match=r"on prompt '1\+1=' \(answer 'x'\) returned nan,"):
        score(load_reward(f"{user_module}:nan"), ["1+1=", "2+2="], ["x", "y"])


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["in-line", "on-a-thread"])
def test_an_interrupt_is_not_a_reward_error(user_module: str, timeout: float | None) -> None:
    with pytest.raises(KeyboardInterrupt):
        score(load_reward(f"{user_module}:interrupted"), ["p"], ["a"], timeout=timeout)


def test_a_reward_that_does_not_return_is_one_line_naming_the_prompt_and_no_later_call_is_made() -> None:
    released, calls = threading.Event(), []

    def stuck_on_the_second(prompt: str, answer: str) -> float:
        calls.append(prompt)
        if len(calls) == 2:
            released.wait()
        return 1.0

    try:
        with pytest.raises(RewardError) as err:
            score(stuck_on_the_second, ["1+1=", "2+2=", "3+3="], ["2", "4", "6"], timeout=0.2)
    finally:
        released.set()  # the abandoned call returns; its thread makes no further call
    assert "on prompt '2+2=' (answer '4') did not return within 0.2 s (workload.reward_timeout)" in str(err.value)
    thread = next((t for t in threading.enumerate() if t.name == "reward"), None)
    if thread is not None:
        thread.join(timeout=30)
    assert calls == ["1+1=", "2+2="]


def test_a_watched_reward_scores_as_the_direct_one(user_module: str) -> None:
    reward = load_reward(f"{user_module}:length")
    answers = ["", "12345", "x" * 20]
    assert (
        score(reward, ["a", "b", "c"], answers, timeout=30.0).tolist()
        == score(reward, ["a", "b", "c"], answers).tolist()
    )


def test_a_builtin_reward_on_a_prompt_not_its_own_names_it() -> None:
    with pytest.raises(RewardError) as err:
        score(load_reward("builtin:addition"), ["1+1=", "Write a poem"], ["2", "roses"])
    assert str(err.value) == (
        "reward islands.posttrain.task:Addition.reward on prompt 'Write a poem' (answer 'roses') raised "
        "ValueError: not an addition prompt (A+B= with A and B of at most 30 digits)"
    )


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("builtin:sorting", "workload.reward 'builtin:sorting': no built-in task 'sorting' (one of addition)"),
        ("rewards.py", "workload.reward 'rewards.py' must have the form 'package.module:function' or 'builtin:NAME'"),
        ("a:b:c", "must have the form"),
        (":score", "must have the form"),
        (
            "no_such_module_xyz:score",
            "cannot import module 'no_such_module_xyz' (No module named 'no_such_module_xyz')",
        ),
        (f"{MODULE}:missing", f"module {MODULE!r} has no attribute 'missing'"),
        (f"{MODULE}:NOT_CALLABLE", "'NOT_CALLABLE' is not callable (it is a int)"),
    ],
)
def test_a_reward_that_does_not_load_is_one_line_naming_the_key(user_module: str, spec: str, says: str) -> None:
    with pytest.raises(RewardError) as err:
        load_reward(spec)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_module_that_raises_on_import_and_another_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_rewards_for_test.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as err:
        load_reward("broken_rewards_for_test:score", key="eval.reward")
    assert str(err.value) == (
        "eval.reward 'broken_rewards_for_test:score': cannot import module 'broken_rewards_for_test' "
        "(RuntimeError: boom second line)"
    )


def test_prompts_and_answers_must_pair_up() -> None:
    with pytest.raises(ValueError, match="2 prompts for 1 answers"):
        score(load_reward("builtin:addition"), ["1+1=", "2+2="], ["2"])


# -- evaluation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generated", "answer"),
    [("522\n", "522"), (" 522 \n7+1=8", "522"), ("522", "522"), ("\n522", ""), ("", ""), ("5 2\n", "5 2")],
)
def test_answer_text(generated: str, answer: str) -> None:
    assert answer_text(generated, "\n") == answer


def test_exact_match() -> None:
    generated = ["522\n1+1=2", "512\n", " 7 ", "", "10"]
    references = ["522", "522", "7", "0", " 10\n"]
    assert exact_matches(generated, references, "\n").tolist() == [True, False, True, False, True]
    assert exact_match(generated, references, "\n") == pytest.approx(0.6)
    assert exact_match(["a;b"], ["a"], ";") == 1.0 and exact_match([], [], "\n") == 0.0
    with pytest.raises(ValueError, match="2 generations for 1 references"):
        exact_match(["a", "b"], ["a"], "\n")


def test_preference_accuracy() -> None:
    assert preference_accuracy([1.0, 0.5, -2.0, 3.0], [0.0, 0.5, -1.0, 2.0]) == 0.5  # a tie is no preference
    assert preference_accuracy(np.array([2.0]), np.array([1.0])) == 1.0 and preference_accuracy([], []) == 0.0
    with pytest.raises(ValueError, match="one per pair"):
        preference_accuracy([1.0, 2.0], [1.0])
