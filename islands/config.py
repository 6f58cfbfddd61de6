"""The `[inner]` section of a run config: the island's inner optimizer (AdamW or Muon, its schedule, clipping).

JAX-free, like every config section, so that loading and validating a config does not import JAX
(tests/test_layering.py); `islands/inner.py` builds the optimizer and the step from it.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("cosine", "wsd")
KINDS = ("adamw", "muon")


@dataclass(frozen=True)
class InnerConfig:
    kind: str = "adamw"
    """The inner optimizer: "adamw" (every parameter) or "muon" (optax.contrib.muon, as MuLoCo, arXiv 2505.23725,
    runs it: Muon for the hidden layers' weight matrices, AdamW with inner.lr, b1, b2 and weight_decay for the
    embeddings, the tied output head, norms and biases; islands/inner.py, `muon_dimensions`, says which is which)."""
    lr: float = 3e-3
    """Peak AdamW learning rate (with inner.kind = "muon": of the parameters Muon does not take)."""
    warmup_steps: int = 100
    """Linear warmup from 0 to lr (and to muon_lr) over this many inner steps."""
    min_lr_ratio: float = 0.1
    """The schedule ends at lr * min_lr_ratio (cosine: after all the run's inner steps; wsd: after its decay)."""
    schedule: str = "cosine"
    """The learning-rate schedule: "cosine" (warmup, then cosine decay over the run's planned inner steps: its shape
    depends on train.rounds) or "wsd" (warmup-stable-decay: warmup, lr held until inner.decay_start_step, then a
    linear decay; its shape does not depend on the planned length, so a run lengthened on resume trains as one
    planned that long from the start, docs/architecture.md "A run that changes on resume")."""
    decay_start_step: int = 0
    """wsd only: the inner step at which the decay starts (round × train.inner_steps for a decay from a round's
    start); 0: not started, lr stays at its peak to the end of the run. May change on resume: the decay phase is
    started explicitly, once the run's length is known."""
    decay_steps: int = 0
    """wsd only: the decay's length in inner steps; 0: to the end of the schedule (inner.schedule_steps, else the
    run: the one part of wsd that reads train.rounds, and only once the decay has started)."""
    schedule_steps: int = 0
    """The inner steps the schedule spans (cosine: its whole length; wsd: where a decay with decay_steps = 0 ends);
    0: the run's own, train.rounds x train.inner_steps. The schedule is a function of the inner optimizer's step
    count, which a warm start with init.inner_state carries over from its source: a run that pretrains S steps with
    schedule_steps = T and its continuation with the same T train on one schedule of T steps, the continuation's
    first step at the rate the source's step S+1 would have had (the papers' warm start; docs/architecture.md,
    "Checkpoints and state")."""
    b1: float = 0.9
    """AdamW β1."""
    b2: float = 0.95
    """AdamW β2."""
    eps: float = 1e-8
    """AdamW ε."""
    weight_decay: float = 0.1
    """Decoupled weight decay (applied to every parameter)."""
    clip_norm: float = 1.0
    """Clip the gradient's global norm to this (0 disables clipping)."""
    muon_lr: float = 0.02
    """inner.kind = "muon": the peak learning rate of the matrices Muon takes, on the same schedule as inner.lr
    (Muon's orthogonalized update has unit spectral scale, so its rate is not AdamW's)."""
    muon_momentum: float = 0.95
    """inner.kind = "muon": Muon's momentum β (Nesterov, as optax's default)."""
    muon_weight_decay: float = 0.0
    """inner.kind = "muon": decoupled weight decay of the Muon matrices, multiplied by their learning rate as
    AdamW's is by its own (0: none, Muon's default; inner.weight_decay applies to the AdamW side)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"inner.kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        if not self.lr > 0:
            raise ValueError(f"inner.lr must be > 0 (got {self.lr})")
        if self.warmup_steps < 0:
            raise ValueError(f"inner.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"inner.schedule must be one of {', '.join(SCHEDULES)} (got {self.schedule!r})")
        if self.decay_start_step < 0 or self.decay_steps < 0:
            raise ValueError(
                f"inner.decay_start_step and inner.decay_steps must be >= 0 "
                f"(got {self.decay_start_step}, {self.decay_steps})"
            )
        if self.schedule != "wsd" and (self.decay_start_step or self.decay_steps):
            raise ValueError('inner.decay_start_step and inner.decay_steps apply to inner.schedule = "wsd" only')
        if self.decay_start_step and self.decay_start_step < self.warmup_steps:
            raise ValueError(
                f"inner.decay_start_step ({self.decay_start_step}) must be >= inner.warmup_steps "
                f"({self.warmup_steps}): the decay starts after the warmup"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"inner.min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        for key in ("b1", "b2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"inner.{key} must be in [0, 1) (got {getattr(self, key)})")
        if self.weight_decay < 0 or self.clip_norm < 0 or self.eps <= 0:
            raise ValueError("inner.weight_decay and inner.clip_norm must be >= 0 and inner.eps > 0")
        if self.schedule_steps < 0:
            raise ValueError(f"inner.schedule_steps must be >= 0 (got {self.schedule_steps})")
        if not self.muon_lr > 0:
            raise ValueError(f"inner.muon_lr must be > 0 (got {self.muon_lr})")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"inner.muon_momentum must be in [0, 1) (got {self.muon_momentum})")
        if self.muon_weight_decay < 0:
            raise ValueError(f"inner.muon_weight_decay must be >= 0 (got {self.muon_weight_decay})")
