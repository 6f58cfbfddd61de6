"""The post-training losses: pure functions of token log-probabilities, masks and scalars, and the model losses
(`WorkloadLoss`) an island's inner step minimizes on a workload's batch (islands/workloads/batches.py).

Every mask is over target positions: `mask[b, t]` = 1 where token t+1 of row b is an answer token (its stop
included), so it lines up with `token_logprobs(params, cfg, tokens)[b, t]` = log p(tokens[b, t+1] | tokens[b, :t+1]).

    sft   the answer tokens' mean cross-entropy: -Σ mask·logp / Σ mask (prompt and padding add nothing)
    dpo   -log σ(β·((log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r)))) averaged over pairs, with log π(y) the
          answer's summed log-probability (Rafailov et al. 2023, arXiv 2305.18290, eq. 7); at π = π_ref it is log 2;
          plus sft_weight times the chosen answers' sft loss (Pang et al. 2024, arXiv 2404.19733: DPO alone may
          lower the right answers' likelihood along with the wrong ones', which near-miss pairs invite)
    rl    GRPO (Shao et al. 2024, arXiv 2402.03300): each answer's advantage is its reward standardized within its
          group, (r - mean) / (std + ε) with the unbiased std (`group_advantages`), and the loss is -mean over
          answer tokens of advantage·logp, plus kl_coef times the mean over answer tokens of the k3 estimator of
          KL(π || π_ref), exp(q) - q - 1 with q = logp_ref - logp (Schulman 2020, "Approximating KL divergence").
          One inner step per sampled batch: on-policy, so the importance ratio π/π_old is 1 and its gradient is
          that of logp, which the loss uses directly.

rl's logp and logp_ref are those of the distribution the answers were drawn from: softmax(logits / T) at
workload.temperature T, for the policy and the reference alike (`sampled_logprobs`, as TRL's GRPOTrainer divides the
logits by its temperature in both), so at any T the step is on-policy and k3 estimates the KL between the two
distributions the sampler draws from. T = 0 (greedy) has no density to score: its answers are scored at T = 1.

A batch in passes. Every term and figure is a sum over the batch's items (answer tokens; dpo's pairs, rl's answers)
divided by the whole batch's count of them, so a long answer weighs as its tokens do. `WorkloadLoss.totals` counts
them over the whole batch and the inner step hands the counts to every accumulation pass (train.microbatch), whose
shares add up to the loss and gradient of the batch taken at once, however the tokens fall into passes
(islands/inner.py, `WholeBatchLoss`; transformers' and TRL's `num_items_in_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from islands.models.base import Metrics, Params
from islands.models.config import ModelConfig
from islands.sampling import token_logprobs

ADVANTAGE_EPS = 1e-4
"""ε of advantage = (r - mean) / (std + ε): a group whose rewards are all equal gets advantages 0, not NaN."""

Batch = dict[str, jax.Array]
Totals = dict[str, jax.Array]
"""A whole batch's counts ({"tokens", "rows"}: `WorkloadLoss.totals`) that a pass's sums are divided by."""
LogProbs = Callable[[Params, jax.Array], jax.Array]
"""(params, tokens int [B, T+1]) -> log p(tokens[:, t+1] | tokens[:, :t+1]), float32 [B, T]."""


def masked_mean(values: jax.Array, mask: jax.Array, count: jax.Array | None = None) -> jax.Array:
    """Σ values·mask / count, count by default Σ mask (0 when it is 0: an empty mask is no NaN)."""
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask) if count is None else count, 1.0)


def sft_loss(logprobs: jax.Array, mask: jax.Array, tokens: jax.Array | None = None) -> jax.Array:
    """The answer tokens' mean cross-entropy (nats); over `tokens` answer tokens (a whole batch's) when given."""
    return -masked_mean(logprobs, mask, tokens)


def sequence_logprob(logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """Each row's answer log-probability, Σ_t mask·logp: float32 [B]."""
    return jnp.sum(logprobs * mask, axis=-1)


def dpo_margin(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array
               ) -> jax.Array:  # fmt: skip
    """(log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r)) per pair: > 0 where the policy prefers the chosen answer
    more than the reference does (the preference accuracy's test)."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


def dpo_loss(margin: jax.Array, beta: float, pairs: jax.Array | None = None) -> jax.Array:
    """Mean over pairs of -log σ(β·margin); Σ over these pairs / `pairs` (a whole batch's) when given."""
    terms = -jax.nn.log_sigmoid(beta * margin)
    return jnp.mean(terms) if pairs is None else jnp.sum(terms) / pairs


def group_advantages(rewards: np.ndarray, group_size: int, eps: float = ADVANTAGE_EPS) -> np.ndarray:
    """(r - mean of its group) / (std of its group + ε) for rewards [G·n] in consecutive groups of `group_size`:
    float32 [G·n]. The std is the unbiased one (ddof = 1), as TRL's GRPOTrainer (`torch.std`'s default) and verl
    take it. A group of one has advantage 0, not NaN: nothing to compare its answer with (workload.group_size >= 2
    keeps runs from asking for it)."""
    groups = np.asarray(rewards, np.float64).reshape(-1, group_size)
    mean = groups.mean(axis=1, keepdims=True)
    std = groups.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(mean)
    return ((groups - mean) / (std + eps)).reshape(-1).astype(np.float32)


def grpo_loss(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    kl_coef: float,
    tokens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(loss, the k3 KL estimate): -masked mean of advantage·logp plus kl_coef times the masked mean of
    exp(q) - q - 1, q = ref_logp - logp, the means over `tokens` answer tokens when given. advantages [B]
    (constants: no gradient flows into them)."""
    policy = -masked_mean(advantages[:, None] * logprobs, mask, tokens)
    q = ref_logprobs - logprobs
    kl = masked_mean(jnp.exp(q) - q - 1.0, mask, tokens)
    return policy + kl_coef * kl, kl


def sampled_logprobs(params: Params, model_cfg: ModelConfig, tokens: jax.Array, temperature: float) -> jax.Array:
    """log p_T(tokens[:, t+1] | tokens[:, :t+1]) under softmax(logits / T), the distribution
    `islands.sampling.next_token` draws from at temperature T (top_p aside): float32 [B, T-1]. T = 0 (greedy, no
    density) is scored at T = 1."""
    return token_logprobs(params, model_cfg, tokens, temperature or 1.0)


# -- the model losses an inner step minimizes ----------------------------------------------------------------------


def sft_model_loss(params: Params, batch: Batch, logprobs: LogProbs, totals: Totals) -> tuple[jax.Array, Metrics]:
    """batch {tokens int32 [B, T+1], mask float32 [B, T]}."""
    ce = sft_loss(logprobs(params, batch["tokens"]), batch["mask"], totals["tokens"])
    return ce, {"ce": ce}


def dpo_model_loss(
    params: Params, batch: Batch, logprobs: LogProbs, totals: Totals, beta: float, sft_weight: float = 0.0
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
    ce = sft_loss(chosen, batch["chosen_mask"], totals["tokens"])
    pairs = dpo_loss(margin, beta, totals["rows"])
    loss = pairs + sft_weight * ce if sft_weight else pairs
    return loss, {"ce": ce, "accuracy": jnp.sum(margin > 0) / totals["rows"]}


def rl_model_loss(
    params: Params, batch: Batch, logprobs: LogProbs, totals: Totals, kl_coef: float
) -> tuple[jax.Array, Metrics]:
    """batch {tokens int32 [B, T+1], mask float32 [B, T] (the sampled answer's tokens), advantages float32 [B],
    ref_logprobs float32 [B, T], reward float32 [B]}; `logprobs` at the sampling temperature, as ref_logprobs are.
    `ce` is the sampled answers' cross-entropy under that distribution."""
    lp = logprobs(params, batch["tokens"])
    loss, kl = grpo_loss(lp, batch["ref_logprobs"], batch["mask"], batch["advantages"], kl_coef, totals["tokens"])
    reward = jnp.sum(batch["reward"]) / totals["rows"]
    return loss, {"ce": sft_loss(lp, batch["mask"], totals["tokens"]), "kl": kl, "reward": reward}


@dataclass(frozen=True)
class WorkloadLoss:
    """The loss an island of workload `kind` minimizes, (params, batch[, totals]) -> (loss, metrics): an
    `islands.inner.WholeBatchLoss` (module docstring, "A batch in passes"). The model's token log-probabilities are
    islands/sampling.py's full forward (differentiable, remat and compute dtype as configured). A value: islands of
    one kind make equal ones, so `make_train_step`'s cache (keyed by it) compiles their step once."""

    kind: str
    model_cfg: ModelConfig
    beta: float = 0.1
    """dpo's β."""
    kl_coef: float = 0.0
    """rl's weight of the KL penalty."""
    sft_weight: float = 0.0
    """dpo's weight of the chosen answers' cross-entropy."""
    temperature: float = 1.0
    """rl's sampling temperature, at which its answers are scored (`sampled_logprobs`)."""

    def __post_init__(self) -> None:
        if self.kind not in ("sft", "dpo", "rl"):
            raise ValueError(f"no post-training loss for workload kind {self.kind!r}")

    def totals(self, batch: Batch) -> Totals:
        """The batch's answer tokens (sft, rl: `mask`; dpo: the chosen answers', `chosen_mask`) and rows (dpo's
        pairs, rl's answers), over every leading axis: a batch [B, ...] or one in passes [passes, B / passes, ...]."""
        mask = batch["chosen_mask" if self.kind == "dpo" else "mask"]
        return {"tokens": jnp.sum(mask), "rows": jnp.float32(math.prod(mask.shape[:-1]))}

    def __call__(self, params: Params, batch: Batch, totals: Totals | None = None) -> tuple[jax.Array, Metrics]:
        """The loss of `batch`, its sums over `totals` (default: the batch's own, `totals(batch)`)."""
        totals = self.totals(batch) if totals is None else totals
        if self.kind == "sft":
            return sft_model_loss(params, batch, self._logprobs(1.0), totals)
        if self.kind == "dpo":
            return dpo_model_loss(params, batch, self._logprobs(1.0), totals, self.beta, self.sft_weight)
        return rl_model_loss(params, batch, self._logprobs(self.temperature), totals, self.kl_coef)

    def _logprobs(self, temperature: float) -> LogProbs:
        return lambda params, tokens: sampled_logprobs(params, self.model_cfg, tokens, temperature)
