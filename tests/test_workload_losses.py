"""The post-training losses against hand computations, and the rows they read (islands/workloads/)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from islands.models.config import ModelConfig
from islands.models.registry import build_model
from islands.workloads.batches import ExampleStream, answer_rows, pack, pair_table, prompt_table, sft_table
from islands.workloads.evaluate import answer_logprobs
from islands.workloads.losses import (
    ADVANTAGE_EPS,
    dpo_loss,
    dpo_margin,
    group_advantages,
    grpo_loss,
    masked_mean,
    sequence_logprob,
    sft_loss,
    workload_loss,
)
from islands.workloads.rollouts import answer_texts
from islands.workloads.text import byte_text

TINY = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=1, n_heads=2, d_ff=64)


def test_a_row_is_prompt_answer_stop_and_padding_with_the_mask_on_the_answer_s_targets() -> None:
    tokens, mask = pack([5, 6, 7], [8], stop=10, width=7)
    assert tokens.tolist() == [5, 6, 7, 8, 10, 0, 0]
    # mask[t] scores tokens[t + 1]: the targets 8 (t = 2) and the stop 10 (t = 3), not the prompt's 6, 7 nor padding
    assert mask.tolist() == [0, 0, 1, 1, 0, 0]
    with pytest.raises(ValueError):
        pack([1, 2, 3], [4, 5, 6], stop=10, width=6)  # 7 tokens in a row of 6


def test_examples_become_bytes_with_a_newline_stop() -> None:
    table = sft_table(["1+2="], ["3"], byte_text(), seq_len=7)
    assert table["tokens"].tolist() == [[ord("1"), ord("+"), ord("2"), ord("="), ord("3"), ord("\n"), 0, 0]]
    assert table["mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0]]
    pairs = pair_table(["1+2="], ["3"], ["4"], byte_text(), seq_len=7)
    assert pairs["rejected"][0, 4] == ord("4") and pairs["rejected_mask"].tolist() == pairs["chosen_mask"].tolist()
    prompts = prompt_table(["1+2=", "10+2="], byte_text(), width=6)
    assert prompts["prompt_len"].tolist() == [4, 5] and prompts["prompt"][0].tolist() == [49, 43, 50, 61, 0, 0]


def test_generated_answers_become_rows_and_texts() -> None:
    prompt = np.array([[1, 2, 0], [3, 0, 0]], np.int32)
    new = np.array([[7, 10, 0], [8, 9, 9]], np.int32)
    tokens, mask = answer_rows(prompt, np.array([2, 1]), new, np.array([2, 3]), width=6)
    assert tokens.tolist() == [[1, 2, 7, 10, 0, 0], [3, 8, 9, 9, 0, 0]]
    assert mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    codec = byte_text()
    texts = answer_texts(codec, np.array([[52, 10, 0], [53, 54, 55]]), np.array([2, 3]))
    assert texts == ["4", "567"]  # the stop is not part of an answer; a row that never stopped keeps all it made


def test_the_sft_loss_is_the_answer_tokens_mean_cross_entropy() -> None:
    logprobs = jnp.array([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = jnp.array([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(sft_loss(logprobs, mask)) == pytest.approx((2 + 3 + 4) / 3)
    assert sequence_logprob(logprobs, mask).tolist() == [-5.0, -4.0]
    assert float(masked_mean(logprobs, jnp.zeros_like(mask))) == 0.0  # an empty mask is no NaN


def test_the_dpo_loss_by_hand() -> None:
    # pair 1: the policy likes chosen 1 nat more and rejected 1 nat less than the reference: margin 2
    # pair 2: the policy is the reference: margin 0, loss log 2
    margin = dpo_margin(
        jnp.array([-3.0, -4.0]), jnp.array([-5.0, -4.0]), jnp.array([-4.0, -4.0]), jnp.array([-4.0, -4.0])
    )
    assert margin.tolist() == [2.0, 0.0]
    beta = 0.5
    expected = (math.log1p(math.exp(-beta * 2.0)) + math.log(2.0)) / 2  # -log σ(x) = log(1 + e^-x)
    assert float(dpo_loss(margin, beta)) == pytest.approx(expected, rel=1e-6)


def test_group_advantages_are_standardized_within_each_group() -> None:
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), group_size=4)
    # group 1: mean 0.5, population std 0.5; group 2: all equal, so no answer is better than another
    assert adv[:4] == pytest.approx(np.array([1, -1, -1, 1]) * 0.5 / (0.5 + ADVANTAGE_EPS))
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_the_grpo_loss_and_its_gradient_by_hand() -> None:
    logprobs = jnp.array([[-1.0, -2.0, -9.0]])
    ref = jnp.array([[-1.5, -2.0, -9.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])  # the last position is padding
    adv = jnp.array([2.0])
    loss, kl = grpo_loss(logprobs, ref, mask, adv, kl_coef=0.1)
    policy = -(2 * -1.0 + 2 * -2.0) / 2  # -mean over the answer's tokens of advantage * logp
    k3 = (math.exp(-0.5) + 0.5 - 1.0 + 0.0) / 2  # exp(q) - q - 1 with q = ref - logp: -0.5, then 0
    assert float(kl) == pytest.approx(k3, rel=1e-6)
    assert float(loss) == pytest.approx(policy + 0.1 * k3, rel=1e-6)
    # The policy gradient pushes every answer token's log-probability up by advantage / tokens, padding not at all
    grad = jax.grad(lambda lp: grpo_loss(lp, ref, mask, adv, kl_coef=0.0)[0])(logprobs)
    assert grad.tolist() == [[-1.0, -1.0, 0.0]]


@pytest.fixture(scope="module")
def params() -> object:
    return build_model(TINY).init(jax.random.key(0))


def test_sft_over_every_token_is_the_model_s_own_loss(params: object) -> None:
    tokens = np.random.default_rng(0).integers(0, 256, size=(3, TINY.seq_len + 1)).astype(np.int32)
    own, _ = build_model(TINY).loss(params, tokens)
    sft, metrics = workload_loss("sft", TINY, 0.1, 0.0)(
        params, {"tokens": tokens, "mask": np.ones((3, 16), np.float32)}
    )
    assert float(sft) == pytest.approx(float(own), rel=1e-5) and float(metrics["ce"]) == pytest.approx(
        float(own), rel=1e-5
    )


def test_dpo_at_the_reference_is_log_2(params: object) -> None:
    codec = byte_text()
    table = pair_table(["12+5=", "3+4="], ["17", "7"], ["18", "8"], codec, TINY.seq_len)
    for side in ("chosen", "rejected"):
        table[f"ref_{side}"] = answer_logprobs(params, TINY, table[side], table[f"{side}_mask"], rows=2)
    loss, _ = workload_loss("dpo", TINY, 0.1, 0.0)(params, table)  # its forward of 2B rows rounds like 2 of B
    assert float(loss) == pytest.approx(math.log(2.0), abs=1e-6)
    with_sft, metrics = workload_loss("dpo", TINY, 0.1, 0.0, sft_weight=0.5)(params, table)
    chosen = sft_table(["12+5=", "3+4="], ["17", "7"], codec, TINY.seq_len)
    sft, _ = workload_loss("sft", TINY, 0.1, 0.0)(params, chosen)
    assert float(metrics["ce"]) == pytest.approx(float(sft), rel=1e-5)  # the chosen answers' own sft loss
    assert float(with_sft) == pytest.approx(math.log(2.0) + 0.5 * float(sft), rel=1e-5)


def test_an_example_stream_is_a_pure_function_of_its_cursor() -> None:
    table = sft_table([f"{i}+1=" for i in range(10)], [str(i + 1) for i in range(10)], byte_text(), seq_len=8)
    a = ExampleStream(table, batch_size=4, seq_len=8, seed=3, stream_id=1)
    b = ExampleStream(table, batch_size=4, seq_len=8, seed=3, stream_id=1, cursor=2)
    first, second, third = a.next(), a.next(), a.next()
    assert a.cursor == 3 and np.array_equal(third["tokens"], b.next()["tokens"])
    assert not np.array_equal(first["tokens"], second["tokens"])
    assert {k: (v.shape, v.dtype) for k, v in a.empty().items()} == {
        "tokens": ((0, 9), np.int32),
        "mask": ((0, 8), np.float32),
    }


def test_accumulation_splits_every_leaf_of_an_example_batch(params: object) -> None:
    """train.microbatch on a pytree batch: each leaf cut into passes on axis 0, the passes' mean loss and gradient
    those of the whole batch (equal-sized passes of a mean over tokens: equal when every pass has as many answer
    tokens, as here)."""
    import optax

    from islands.inner import inner_update

    table = sft_table([f"{i}+{i}=" for i in range(4)], [str(2 * i) for i in range(4)], byte_text(), TINY.seq_len)
    loss = workload_loss("sft", TINY, 0.1, 0.0)
    tx = optax.sgd(0.1)
    whole = jax.tree.map(lambda x: x[None], table)  # [1 pass, 4 rows, ...]
    halves = jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]), table)  # [2 passes, 2 rows, ...]
    _, _, m1 = inner_update(loss, tx, params, tx.init(params), whole)
    _, _, m2 = inner_update(loss, tx, params, tx.init(params), halves)
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-4)
