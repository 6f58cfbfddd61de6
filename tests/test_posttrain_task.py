"""The built-in addition task: seeded, split without overlap, correct answers, plausible wrong ones, its reward."""

from __future__ import annotations

import re

import numpy as np
import pytest

from islands.posttrain.task import (
    Addition,
    TaskError,
    addition_reward,
    builtin_task,
    carry_positions,
    in_heldout,
    one_digit_off,
    wrong_sum,
)

EQUATION = re.compile(r"([0-9]+)\+([0-9]+)=")


def _operands(prompt: str) -> tuple[int, int]:
    match = EQUATION.fullmatch(prompt)
    assert match, prompt
    return int(match[1]), int(match[2])


def _prompts(task: Addition, n: int, split: str) -> set[str]:
    return (
        {e.prompt for e in task.sft(n, split)}
        | {p.prompt for p in task.pairs(n, split)}
        | {r.prompt for r in task.prompts(n, split)}
        | {line.split("=")[0] + "=" for line in task.pretraining_text(n, split).splitlines()}
    )


@pytest.mark.parametrize("digits", [2, 3, 4, 7])  # up to 3 digits the problems are listed, from 4 sampled
@pytest.mark.slow
def test_train_and_heldout_never_share_a_prompt_across_seeds_and_digits(digits: int) -> None:
    train = set().union(*(_prompts(Addition(seed, digits), 400, "train") for seed in (0, 1)))
    heldout = set().union(*(_prompts(Addition(seed, d), 100, "heldout") for seed in (0, 5) for d in (2, digits)))
    assert len(train) > 1000 and len(heldout) > 200
    assert not train & heldout
    assert all(not in_heldout(*_operands(p)) for p in train) and all(in_heldout(*_operands(p)) for p in heldout)


@pytest.mark.parametrize("digits", [1, 2, 3])  # listed whole: every held-out problem is checked
@pytest.mark.slow
def test_no_heldout_problem_has_its_operands_in_training_in_either_order(digits: int) -> None:
    task = Addition(seed=0, digits=digits)
    n_train, n_held = task.split_size("train"), task.split_size("heldout")
    assert n_train is not None and n_held is not None
    train = {frozenset(_operands(e.prompt)) for e in task.sft(n_train)}
    held = {frozenset(_operands(e.prompt)) for e in task.sft(n_held, "heldout")}
    assert held and not train & held  # {a, b}: a+b and b+a alike
    a, b = np.divmod(np.arange(10 ** (2 * digits)), 10**digits)
    assert np.array_equal(in_heldout(a, b), in_heldout(b, a))


def test_the_two_splits_cover_every_problem_once() -> None:
    a, b = np.divmod(np.arange(10**4), 10**2)
    heldout = in_heldout(a, b)
    task = Addition(seed=0, digits=2)
    n_heldout = int(heldout.sum())
    assert 0.08 < n_heldout / heldout.size < 0.12
    train = {e.prompt for e in task.sft(heldout.size - n_heldout)}
    held = {e.prompt for e in task.sft(n_heldout, "heldout")}
    assert len(train) + len(held) == 10**4 and not train & held
    with pytest.raises(TaskError, match=f"2-digit addition has {n_heldout} heldout problems, fewer than the"):
        task.sft(n_heldout + 1, "heldout")


@pytest.mark.parametrize("digits", [2, 5])
def test_seeded_deterministic_and_a_prefix_of_more(digits: int) -> None:
    a, b = Addition(seed=3, digits=digits), Addition(seed=3, digits=digits)
    assert a.sft(300) == b.sft(300) and a.pairs(300, "heldout") == b.pairs(300, "heldout")
    assert a.sft(300)[:100] == a.sft(100)
    assert a.pairs(300)[:100] == a.pairs(100) and a.prompts(300)[:100] == a.prompts(100)
    assert a.pretraining_text(300).splitlines()[:100] == a.pretraining_text(100).splitlines()
    assert a.sft(100) != Addition(seed=4, digits=digits).sft(100)
    assert {e.prompt for e in a.sft(100)} != {p.prompt for p in a.prompts(100)}  # streams of their own


@pytest.mark.parametrize("digits", [1, 3, 6])
def test_every_answer_is_the_sum_and_every_operand_has_its_digits(digits: int) -> None:
    task = Addition(seed=0, digits=digits)
    n = 50 if digits == 1 else 500
    sft, prompts = task.sft(n), task.prompts(n)
    assert len({e.prompt for e in sft}) == n and len({r.prompt for r in prompts}) == n  # no repeats in one call
    for prompt, answer in [(e.prompt, e.response) for e in sft] + [(r.prompt, r.answer) for r in prompts]:
        a, b = _operands(prompt)
        assert a < 10**digits and b < 10**digits and answer == str(a + b)
        assert str(a) == prompt.split("+")[0] and task.reward(prompt, answer) == 1.0
    lengths = {len(_operands(e.prompt)[0].__str__()) for e in sft}
    assert max(lengths) == digits
    for line in task.pretraining_text(200).splitlines():
        prompt, total = line.split("=")
        assert sum(_operands(prompt + "=")) == int(total)


def test_rejected_answers_are_a_dropped_carry_or_one_digit_off() -> None:
    task = Addition(seed=0, digits=3)
    kinds = {"carry": 0, "digit": 0}
    for pair in task.pairs(1000):
        a, b = _operands(pair.prompt)
        assert pair.chosen == str(a + b) and pair.rejected != pair.chosen
        assert re.fullmatch(r"0|[1-9][0-9]*", pair.rejected)
        dropped = {str(a + b - 10 ** (p + 1)) for p in carry_positions(a, b)}
        off = sum(x != y for x, y in zip(pair.rejected, pair.chosen, strict=False))
        if pair.rejected in dropped:
            kinds["carry"] += 1
        else:
            assert len(pair.rejected) == len(pair.chosen) and off == 1
            assert all(abs(int(x) - int(y)) <= 1 for x, y in zip(pair.rejected, pair.chosen, strict=True))
            kinds["digit"] += 1
        assert 0.0 <= task.reward(pair.prompt, pair.rejected) < 1.0
    assert kinds["carry"] > 200 and kinds["digit"] > 200


@pytest.mark.parametrize(
    ("a", "b", "carries"),
    [(37, 485, [0, 1]), (95, 7, [0, 1]), (999, 1, [0, 1, 2]), (123, 456, []), (0, 0, []), (50, 50, [1])],
)
def test_carry_positions(a: int, b: int, carries: list[int]) -> None:
    assert carry_positions(a, b) == carries


def test_wrong_sums() -> None:
    assert wrong_sum(37, 485, (0, 0, 0)) == "512"  # the carry out of the units dropped
    assert wrong_sum(95, 7, (0, 1, 0)) == "2"  # the carry into the hundreds dropped
    assert wrong_sum(123, 456, (0, 0, 0)) in {"479", "589", "569", "578", "576"}  # no carry: a digit off
    assert {one_digit_off("10", d) for d in range(8)} == {"20", "11"}  # never a leading zero
    assert {one_digit_off("0", d) for d in range(4)} == {"1"}
    assert {one_digit_off("9", d) for d in range(4)} == {"8"}


@pytest.mark.parametrize(
    ("prompt", "answer", "reward"),
    [
        ("37+485=", "522", 1.0),
        ("37+485=", "522\n", 1.0),
        ("37+485=", " 522 \n7+1=8\n", 1.0),  # read up to the stop text, stripped
        ("37+485=", "512", 0.5 * 2 / 3),
        ("37+485=", "0522", 0.5 * 3 / 4),
        ("37+485=", "52", 0.5 * 1 / 3),  # aligned at the units: the 2 is right
        ("37+485=", "5220", 0.5 * 1 / 4),
        ("37+485=", "", 0.0),
        ("37+485=", "\n522", 0.0),
        ("37+485=", "-522", 0.0),
        ("37+485=", "522.0", 0.0),
        ("37+485=", "five hundred", 0.0),
        ("37+485=", "٥٢٢", 0.0),  # digits, but not ASCII ones
        (" 0+0= ", "0", 1.0),
        ("<|im_start|>user\n37+485=<|im_end|>\n<|im_start|>assistant\n", "522", 1.0),  # a chat template's
        ("<|im_start|>user\n1+1=2, and 37+485=<|im_end|>\n<|im_start|>assistant\n", "522", 1.0),  # the last one
    ],
)
def test_reward(prompt: str, answer: str, reward: float) -> None:
    assert addition_reward(prompt, answer) == pytest.approx(reward)


@pytest.mark.parametrize("prompt", ["37+485", "37 + 485 =", "a+b=", "1" * 31 + "+1=", "", "<|im_start|>user\nhi"])
def test_the_reward_of_what_is_not_an_addition_prompt_raises(prompt: str) -> None:
    with pytest.raises(ValueError, match="not an addition prompt"):
        addition_reward(prompt, "1")


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: builtin_task("subtraction", 0), "unknown built-in task 'subtraction' (one of addition)"),
        (lambda: builtin_task("addition", 0, digits=10), "addition's digits must be an integer from 1 to 9 (got 10)"),
        (lambda: builtin_task("addition", 0, digits=True), "digits must be an integer from 1 to 9 (got True)"),
        (lambda: builtin_task("addition", -1), "the task's seed must be an integer >= 0 (got -1)"),
        (lambda: Addition(0).sft(10, "test"), "unknown split 'test' (one of train, heldout)"),
        (lambda: Addition(0).pairs(0), "the number of examples must be an integer from 1 to"),
        (lambda: Addition(0).pretraining_text(2.5), "the number of examples must be an integer"),  # type: ignore[arg-type]
    ],
)
def test_mistakes_are_task_errors(call, says: str) -> None:
    with pytest.raises(TaskError, match=re.escape(says)):
        call()
