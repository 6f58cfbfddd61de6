"""The post-training losses against hand computations, and the rows they read (islands/workloads/)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from islands.models.config import ModelConfig
from islands.models.registry import build_model
from islands.workloads.batches import ExampleStream, answer_rows, pack, pair_table, prompt_table, sft_table
from islands.workloads.evaluate import answer_logprobs
from islands.workloads.losses import (
    ADVANTAGE_EPS,
    WorkloadLoss,
    dpo_loss,
    dpo_margin,
    group_advantages,
    grpo_loss,
    masked_mean,
    sampled_logprobs,
    sequence_logprob,
    sft_loss,
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


@pytest.mark.slow
def test_the_sft_loss_is_the_answer_tokens_mean_cross_entropy() -> None:
    logprobs = jnp.array([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = jnp.array([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(sft_loss(logprobs, mask)) == pytest.approx((2 + 3 + 4) / 3)
    assert sequence_logprob(logprobs, mask).tolist() == [-5.0, -4.0]
    assert float(masked_mean(logprobs, jnp.zeros_like(mask))) == 0.0  # an empty mask is no NaN


@pytest.mark.slow
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


def test_group_advantages_are_standardized_within_each_group_by_the_unbiased_std() -> None:
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), group_size=4)
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) (TRL's torch.std); group 2: all equal, no answer is better
    std = math.sqrt(1.0 / 3.0)
    assert adv[:4] == pytest.approx(np.array([1, -1, -1, 1]) * 0.5 / (std + ADVANTAGE_EPS), rel=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    pair = group_advantages(np.array([3.0, 1.0]), group_size=2)  # a pair: ±1/√2 · ... = ±(1 / (√2 + ε))
    assert pair == pytest.approx(np.array([1.0, -1.0]) / (math.sqrt(2.0) + ADVANTAGE_EPS), rel=1e-6)


def test_a_group_of_one_has_advantage_zero_not_nan() -> None:
    """ddof = 1 has no std for one answer: its advantage is 0 (nothing to compare it with), as its r - mean is."""
    with np.errstate(all="raise"):  # no division by zero on the way
        adv = group_advantages(np.array([3.0, -1.0, 0.5]), group_size=1)
    assert adv.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.slow
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


@pytest.mark.slow
def test_sft_over_every_token_is_the_model_s_own_loss(params: object) -> None:
    tokens = np.random.default_rng(0).integers(0, 256, size=(3, TINY.seq_len + 1)).astype(np.int32)
    own, _ = build_model(TINY).loss(params, tokens)
    sft, metrics = WorkloadLoss("sft", TINY)(params, {"tokens": tokens, "mask": np.ones((3, 16), np.float32)})
    assert float(sft) == pytest.approx(float(own), rel=1e-5) and float(metrics["ce"]) == pytest.approx(
        float(own), rel=1e-5
    )


@pytest.mark.slow
def test_dpo_at_the_reference_is_log_2(params: object) -> None:
    codec = byte_text()
    table = pair_table(["12+5=", "3+4="], ["17", "7"], ["18", "8"], codec, TINY.seq_len)
    for side in ("chosen", "rejected"):
        table[f"ref_{side}"] = answer_logprobs(params, TINY, table[side], table[f"{side}_mask"], rows=2)
    loss, _ = WorkloadLoss("dpo", TINY, beta=0.1)(params, table)  # its forward of 2B rows rounds like 2 of B
    assert float(loss) == pytest.approx(math.log(2.0), abs=1e-6)
    with_sft, metrics = WorkloadLoss("dpo", TINY, beta=0.1, sft_weight=0.5)(params, table)
    chosen = sft_table(["12+5=", "3+4="], ["17", "7"], codec, TINY.seq_len)
    sft, _ = WorkloadLoss("sft", TINY)(params, chosen)
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


def _uneven_batch(kind: str, params: object) -> dict[str, np.ndarray]:
    """4 rows whose answers are 1, 2, 9 and 10 tokens long (stop included): split in 2 passes, the first holds 3
    answer tokens and the second 19, so a mean of the passes' means is not the batch's mean."""
    codec, rng = byte_text(), np.random.default_rng(0)
    prompts, answers = ["1+1=", "4+5=", "12+30=", "99+9="], ["", "9", "42424242", "108108108"]
    if kind == "dpo":
        table = pair_table(prompts, answers, ["7", "8", "4242", "1"], codec, TINY.seq_len)
        table["ref_chosen"], table["ref_rejected"] = rng.normal(-20, 3, (2, 4)).astype(np.float32)
        return table
    table = sft_table(prompts, answers, codec, TINY.seq_len)
    if kind == "rl":  # as if sampled: the reference near the policy, advantages and rewards of a batch
        ref = np.asarray(sampled_logprobs(params, TINY, table["tokens"], 0.7))
        table["ref_logprobs"] = (ref + rng.normal(0, 0.3, ref.shape) * table["mask"]).astype(np.float32)
        table["advantages"] = rng.normal(0, 1, 4).astype(np.float32)
        table["reward"] = rng.uniform(0, 1, 4).astype(np.float32)
    return table


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo", "rl"])  # each compiles two accumulated steps
def test_a_batch_in_passes_has_the_loss_and_gradient_of_the_whole_batch(kind: str, params: object) -> None:
    """train.microbatch: the loss over the batch is Σ over its passes of token (or pair) sums / the whole batch's
    count, whatever tokens fall into which pass (transformers' num_items_in_batch); figures likewise."""
    from islands.inner import WholeBatchLoss, _accumulated_grads

    table = _uneven_batch(kind, params)
    loss = WorkloadLoss(kind, TINY, beta=0.5, kl_coef=0.1, sft_weight=0.3, temperature=0.7)
    assert isinstance(loss, WholeBatchLoss)
    accumulate = jax.jit(_accumulated_grads, static_argnums=0)
    whole = jax.tree.map(lambda x: x[None], table)  # [1 pass, 4 rows, ...]
    halves = jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]), table)  # [2 passes, 2 rows, ...]
    l1, g1, m1 = accumulate(loss, params, whole)
    l2, g2, m2 = accumulate(loss, params, halves)
    assert float(l2) == pytest.approx(float(l1), rel=1e-5)
    assert {k: pytest.approx(float(v), rel=1e-5, abs=1e-6) for k, v in m1.items()} == {
        k: float(v) for k, v in m2.items()
    }
    flat1, flat2 = ravel_pytree(g1)[0], ravel_pytree(g2)[0]
    np.testing.assert_allclose(np.asarray(flat2), np.asarray(flat1), rtol=2e-4, atol=1e-6)
    # uneven passes, so averaging the passes' own means (what accumulation did before) would weigh a token of the
    # first 19/3 times one of the second, and fail the comparisons above
    assert [float(m.sum()) for m in halves["chosen_mask" if kind == "dpo" else "mask"]] == [3.0, 19.0]


@pytest.mark.slow
def test_rl_scores_its_answers_at_the_temperature_they_were_drawn_at(params: object) -> None:
    """At T != 1 an rl batch's reference log-probabilities, and the policy's in its loss, are the sampler's own
    log-probabilities of its draws, log softmax(logits / T)[token]: on-policy, and k3 is 0 where θ = θ_ref."""
    from islands.sampling import rollout
    from islands.workloads.config import WorkloadConfig
    from islands.workloads.rollouts import Rollouts

    t, n_new, seed = 0.6, 6, 1
    workload = WorkloadConfig(kind="rl", task="addition", reward="builtin:addition", temperature=t,
                              max_new_tokens=n_new, group_size=2)  # fmt: skip
    codec, texts = byte_text(), ["12+5="]
    prompts = prompt_table(texts, codec, width=TINY.seq_len - n_new)
    zero = lambda p, a: np.zeros(len(a), np.float32)  # noqa: E731
    batch = Rollouts(prompts, texts, zero, codec, params, TINY, workload, 4, seed, stream_id=0).next_for(params)
    # the sampler's draw of batch 0 (Rollouts' key: (seed, island, k) folded in), with the logits it drew from
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), 0)
    rows = {name: np.repeat(column, 4, axis=0) for name, column in prompts.items()}
    new, lengths, logits = rollout(params, TINY, rows["prompt"], rows["prompt_len"], key, jnp.float32(t),
                                   jnp.float32(1.0), max_new_tokens=n_new, stop_token=codec.stop, keep_logits=True)  # fmt: skip
    p = int(prompts["prompt_len"][0])
    drawn = jax.nn.log_softmax(logits / t, axis=-1)
    sampler, scored, at_one = [], [], []
    plain = np.asarray(token_logprobs_of(params, batch["tokens"]))
    for b in range(4):
        n = int(lengths[b])
        assert batch["tokens"][b, p : p + n].tolist() == np.asarray(new[b, :n]).tolist()  # the same draw
        sampler += [float(drawn[b, i, new[b, i]]) for i in range(n)]
        scored += batch["ref_logprobs"][b, p - 1 : p - 1 + n].tolist()
        at_one += plain[b, p - 1 : p - 1 + n].tolist()
    np.testing.assert_allclose(scored, sampler, atol=1e-4)
    assert np.max(np.abs(np.array(at_one) - sampler)) > 0.05  # at T = 1 they would not be
    _, metrics = WorkloadLoss("rl", TINY, kl_coef=0.1, temperature=t)(params, batch)
    assert float(metrics["ce"]) == pytest.approx(-np.mean(sampler), rel=1e-4)  # the policy's side: the same
    assert abs(float(metrics["kl"])) < 1e-5


def token_logprobs_of(params: object, tokens: np.ndarray) -> jax.Array:
    from islands.sampling import token_logprobs

    return token_logprobs(params, TINY, tokens)
