"""The post-training losses: pure functions of token log-probabilities, masks and scalars, and the model losses
(`workload_loss`) an island's inner step minimizes on a workload's batch (islands/workloads/batches.py).

Every mask is over target positions: `mask[b, t]` = 1 where token t+1 of row b is an answer token (its stop
included), so it lines up with `token_logprobs(params, cfg, tokens)[b, t]` = log p(tokens[b, t+1] | tokens[b, :t+1]).

    sft   the answer tokens' mean cross-entropy: -Σ mask·logp / Σ mask (prompt and padding add nothing)
    dpo   -log σ(β·((log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r)))) averaged over pairs, with log π(y) the
          answer's summed log-probability (Rafailov et al. 2023, arXiv 2305.18290, eq. 7); at π = π_ref it is log 2;
          plus sft_weight times the chosen answers' sft loss (Pang et al. 2024, arXiv 2404.19733: DPO alone may
          lower the right answers' likelihood along with the wrong ones', which near-miss pairs invite)
    rl    GRPO (Shao et al. 2024, arXiv 2402.03300): each answer's advantage is its reward standardized within its
          group (`group_advantages`), and the loss is -mean over answer tokens of advantage·logp, plus kl_coef times
          the mean over answer tokens of the k3 estimator of KL(π || π_ref), exp(q) - q - 1 with q = logp_ref - logp
          (Schulman 2020, "Approximating KL divergence"). One inner step per sampled batch: on-policy, so the
          importance ratio π/π_old is 1 and its gradient is that of logp, which the loss uses directly.

The batches' means are over tokens of the whole batch (not per answer then per batch), so a long answer weighs as
its tokens do; a batch split into accumulation passes averages the passes' means, as the lm loss does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from islands.models.base import Metrics, Params
from islands.models.config import ModelConfig
from islands.sampling import token_logprobs

ADVANTAGE_EPS = 1e-4
"""ε of advantage = (r - mean) / (std + ε): a group whose rewards are all equal gets advantages 0, not NaN."""

Batch = dict[str, jax.Array]
LogProbs = Callable[[Params, jax.Array], jax.Array]
"""(params, tokens int [B, T+1]) -> log p(tokens[:, t+1] | tokens[:, :t+1]), float32 [B, T]."""


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ values·mask / Σ mask (0 when the mask is empty)."""
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def sft_loss(logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """The answer tokens' mean cross-entropy (nats)."""
    return -masked_mean(logprobs, mask)


def sequence_logprob(logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """Each row's answer log-probability, Σ_t mask·logp: float32 [B]."""
    return jnp.sum(logprobs * mask, axis=-1)


def dpo_margin(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array
               ) -> jax.Array:  # fmt: skip
    """(log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r)) per pair: > 0 where the policy prefers the chosen answer
    more than the reference does (the preference accuracy's test)."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


def dpo_loss(margin: jax.Array, beta: float) -> jax.Array:
    """Mean over pairs of -log σ(β·margin)."""
    return -jnp.mean(jax.nn.log_sigmoid(beta * margin))


def group_advantages(rewards: np.ndarray, group_size: int, eps: float = ADVANTAGE_EPS) -> np.ndarray:
    """(r - mean of its group) / (std of its group + ε) for rewards [G·n] in consecutive groups of `group_size`
    (the population std, as GRPO's implementations take it): float32 [G·n]."""
    groups = np.asarray(rewards, np.float64).reshape(-1, group_size)
    mean = groups.mean(axis=1, keepdims=True)
    std = groups.std(axis=1, keepdims=True)
    return ((groups - mean) / (std + eps)).reshape(-1).astype(np.float32)


def grpo_loss(
    logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array, advantages: jax.Array, kl_coef: float
) -> tuple[jax.Array, jax.Array]:
    """(loss, the k3 KL estimate): -masked mean of advantage·logp plus kl_coef times the masked mean of
    exp(q) - q - 1, q = ref_logp - logp. advantages [B] (constants: no gradient flows into them)."""
    policy = -masked_mean(advantages[:, None] * logprobs, mask)
    q = ref_logprobs - logprobs
    kl = masked_mean(jnp.exp(q) - q - 1.0, mask)
    return policy + kl_coef * kl, kl


# -- the model losses an inner step minimizes ----------------------------------------------------------------------


def sft_model_loss(params: Params, batch: Batch, logprobs: LogProbs) -> tuple[jax.Array, Metrics]:
    """batch {tokens int32 [B, T+1], mask float32 [B, T]}."""
    ce = sft_loss(logprobs(params, batch["tokens"]), batch["mask"])
    return ce, {"ce": ce}


def dpo_model_loss(
    params: Params, batch: Batch, logprobs: LogProbs, beta: float, sft_weight: float = 0.0
) -> tuple[jax.Array, Metrics]:
    """batch {chosen, rejected int32 [B, T+1], chosen_mask, rejected_mask float32 [B, T], ref_chosen, ref_rejected
    float32 [B]: the reference's answer log-probabilities, computed once (the reference is frozen)}. Both answers
    go through one forward of 2B rows. `ce` is the chosen answers' cross-entropy."""
    tokens = jnp.concatenate([batch["chosen"], batch["rejected"]])
    lp = logprobs(params, tokens)
    n = batch["chosen"].shape[0]
    chosen, rejected = lp[:n], lp[n:]
    margin = dpo_margin(
        sequence_logprob(chosen, batch["chosen_mask"]),
        sequence_logprob(rejected, batch["rejected_mask"]),
        batch["ref_chosen"],
        batch["ref_rejected"],
    )
    ce = sft_loss(chosen, batch["chosen_mask"])
    loss = dpo_loss(margin, beta) + sft_weight * ce if sft_weight else dpo_loss(margin, beta)
    return loss, {"ce": ce, "accuracy": jnp.mean(margin > 0)}


def rl_model_loss(params: Params, batch: Batch, logprobs: LogProbs, kl_coef: float) -> tuple[jax.Array, Metrics]:
    """batch {tokens int32 [B, T+1], mask float32 [B, T] (the sampled answer's tokens), advantages float32 [B],
    ref_logprobs float32 [B, T], reward float32 [B]}. `ce` is the sampled answers' cross-entropy."""
    lp = logprobs(params, batch["tokens"])
    loss, kl = grpo_loss(lp, batch["ref_logprobs"], batch["mask"], batch["advantages"], kl_coef)
    return loss, {"ce": sft_loss(lp, batch["mask"]), "kl": kl, "reward": jnp.mean(batch["reward"])}


def model_logprobs(model_cfg: ModelConfig) -> LogProbs:
    """The model's token log-probabilities (islands/sampling.py's full forward: differentiable, remat and compute
    dtype as configured)."""
    return functools.partial(_logprobs, model_cfg=model_cfg)


def _logprobs(params: Params, tokens: jax.Array, model_cfg: ModelConfig) -> jax.Array:
    return token_logprobs(params, model_cfg, tokens)


@functools.lru_cache(maxsize=16)
def workload_loss(kind: str, model_cfg: ModelConfig, beta: float, kl_coef: float, sft_weight: float = 0.0) -> Callable:
    """The loss an island of workload `kind` minimizes, (params, batch) -> (loss, metrics). Cached: islands of one
    kind share one function, so `make_train_step`'s cache (keyed by it) compiles their step once."""
    logprobs = model_logprobs(model_cfg)
    if kind == "sft":
        return functools.partial(sft_model_loss, logprobs=logprobs)
    if kind == "dpo":
        return functools.partial(dpo_model_loss, logprobs=logprobs, beta=beta, sft_weight=sft_weight)
    if kind == "rl":
        return functools.partial(rl_model_loss, logprobs=logprobs, kl_coef=kl_coef)
    raise ValueError(f"no post-training loss for workload kind {kind!r}")
